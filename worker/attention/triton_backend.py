"""The "triton" attention backend: every batch reads the KV pages in place.

    decode batch (one new token per row)   paged_decode_attention   (worker.attention.triton_decode)
    rows with a cached prefix, enough work  cached_prefix_attention  (worker.attention.cudnn_prefill):
                                            the prefix's pages gathered, cuDNN's fused kernel, merged;
                                            a row of fewer queries than the warm-up planned for takes
                                            the paged kernel beside it
    rows with a cached prefix, otherwise    paged_prefill_attention  (worker.attention.triton_prefill)
    rows without one                        SDPA's fused causal kernel over the new K/V, which are
                                            contiguous already (flash attention on a GPU)
    gpt-oss (sinks, windows), any prefill   paged_prefill_attention: neither SDPA nor cuDNN's fused
                                            kernel (as torch calls it) takes a sink
"""
from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from typing import NamedTuple

import torch
import torch.nn.functional as F

import worker.attention.cudnn_prefill as cudnn_prefill
from worker.attention.registry import register
from worker.attention.triton_decode import paged_decode_attention
from worker.attention.triton_prefill import PrefillBlocks, paged_prefill_attention, prefill_block_table, tile_for
from worker.batch import ForwardBatch, to_device
from worker.kv.gpu_pool import KVPool, as_stored
from worker.models.rotary import RopeInputs

log = logging.getLogger("sluice.worker")
ROPE_INSIDE_ENV = "SLUICE_ROPE_INSIDE"


class SmallRows(NamedTuple):
    """The rows of a cuDNN batch with fewer queries than the warm-up planned: the paged kernel's."""

    rows: list[int]  # their places in the batch
    q_lens: list[int]
    tokens: torch.Tensor  # int64, their queries' places in the packed q
    table_rows: torch.Tensor  # int64, ``rows`` on the device (page table and lengths)
    blocks: PrefillBlocks


class PrefillPlan(NamedTuple):
    """How a prefill batch with a cached prefix attends, decided at its first layer."""

    batch: ForwardBatch
    prefixes: list[int]  # cached tokens per row, from the host
    blocks: PrefillBlocks | None  # the paged kernel's block list; None: the cuDNN path
    small: SmallRows | None = None  # on the cuDNN path, the rows it leaves to the paged kernel
    runs: Sequence[int] = ()  # on the cuDNN path, each row's first prefix page if its pages are one run, else -1


@register("triton")
class TritonAttention:
    """The paths of the table above, chosen from host-known lengths only, once per batch."""

    # the fewest queries a row takes to the cuDNN path: from the warm-up on, the least it planned
    # (a row of fewer in a batch with a larger one would plan cuDNN's shapes while serving)
    min_rows = 0

    def __init__(self, pool: KVPool, scale: float):
        self.pool = pool
        self.scale = scale
        self._plan: PrefillPlan | None = None
        self.cudnn = True  # until cuDNN refuses a call: then the paged kernel for every prefix
        # a decode step's RoPE inside the attention's launch (SLUICE_ROPE_INSIDE=0: qk_rope's own, the A/B)
        self.rope_inside = os.environ.get(ROPE_INSIDE_ENV, "1") != "0"

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: ForwardBatch, *,
                sinks: torch.Tensor | None = None, window: int = 0, rope: RopeInputs | None = None) -> torch.Tensor:
        k_cache, v_cache = self.pool.k[layer], self.pool.v[layer]
        if batch.is_decode and rope is not None and self.rope_inside:  # qk_rope's work in the attention's launch
            return paged_decode_attention(q, k_cache, v_cache, batch.page_table, batch.seq_lens, self.scale,
                                          sinks=sinks, window=window, rope=rope, k=k, early_index=True)
        if rope is not None:
            q, k = rope.apply(q, k)
        if batch.is_decode:
            return paged_decode_attention(q, k_cache, v_cache, batch.page_table, batch.seq_lens, self.scale,
                                          sinks=sinks, window=window)
        k, v = as_stored(k, k_cache.dtype), as_stored(v, v_cache.dtype)  # the chunk's own, as later steps read them
        if sinks is not None or window:  # SDPA and cuDNN take no sinks: gpt-oss prefills through the pages
            plan = self._prefill_plan(batch, q, k_cache, cudnn=False)
            return paged_prefill_attention(q, k_cache, v_cache, batch.page_table, batch.seq_lens, batch.q_lens,
                                           self.scale, blocks=plan.blocks, sinks=sinks, window=window)
        if batch.seq_lens_host == batch.q_lens:  # no cached prefix: the new keys are all there is
            return causal_self_attention(q, k, v, batch.q_lens, self.scale)
        plan = self._prefill_plan(batch, q, k_cache)
        if plan.blocks is None:
            try:
                return self._cudnn_prefill(plan, q, k, v, k_cache, v_cache)
            except cudnn_prefill.CudnnRefused as e:
                self._refused(e)
                plan = self._plan = plan._replace(blocks=_block_table(batch, q, k_cache, plan.prefixes))
        return paged_prefill_attention(q, k_cache, v_cache, batch.page_table, batch.seq_lens, batch.q_lens,
                                       self.scale, blocks=plan.blocks)

    def warm_plans(self, heads: int, max_q: int, max_context: int) -> int:
        """Plan cuDNN's attention for every shape the long-prefix path can launch (warm-up);
        returns how many. A refusal here sends every prefill to the paged kernel, as in serving."""
        k_cache, v_cache = self.pool.k[0], self.pool.v[0]
        if not (self.cudnn and cudnn_prefill.supported(k_cache.device, self.pool.dtype, k_cache.shape[-1])):
            return 0
        try:
            shapes = cudnn_prefill.warm_plans(heads, k_cache, v_cache, max_q, max_context, self.scale, self.pool.dtype)
        except cudnn_prefill.CudnnRefused as e:
            self._refused(e)
            return 0
        self.min_rows = min(cudnn_prefill.warm_buckets(k_cache, max_q, max_context), default=0)
        return shapes

    def _cudnn_prefill(self, plan: PrefillPlan, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
        """The cuDNN path's rows, then the paged kernel's (``plan.small``) into the same output."""
        batch, small = plan.batch, plan.small
        out = cudnn_prefill.cached_prefix_attention(q, k, v, k_cache, v_cache, batch.page_table, batch.q_lens,
                                                    plan.prefixes, self.scale, skip=small.rows if small else (),
                                                    runs=plan.runs)
        if small is not None:
            rows = small.table_rows
            part = paged_prefill_attention(q.index_select(0, small.tokens), k_cache, v_cache,
                                           batch.page_table.index_select(0, rows), batch.seq_lens.index_select(0, rows),
                                           small.q_lens, self.scale, blocks=small.blocks)
            out.index_copy_(0, small.tokens, part)
        return out

    def _refused(self, e: cudnn_prefill.CudnnRefused) -> None:
        self.cudnn = False
        log.warning("%s; the paged kernel takes every prefill from now on", e)

    def _prefill_plan(self, batch: ForwardBatch, q: torch.Tensor, k_cache: torch.Tensor,
                      cudnn: bool = True) -> PrefillPlan:
        if self._plan is None or self._plan.batch is not batch or (not cudnn and self._plan.blocks is None):
            prefixes = [s - n for s, n in zip(batch.seq_lens_host, batch.q_lens)]
            cudnn = cudnn and self.cudnn and cudnn_prefill.usable(q, batch.q_lens, prefixes)
            small = [b for b, n in enumerate(batch.q_lens) if cudnn_prefill.query_bucket(n) < self.min_rows]
            if not cudnn or len(small) == len(prefixes):
                self._plan = PrefillPlan(batch, prefixes, _block_table(batch, q, k_cache, prefixes))
            else:
                self._plan = PrefillPlan(batch, prefixes, None, _small_rows(batch, q, k_cache, prefixes, small),
                                         _prefix_runs(batch, k_cache, prefixes))
        return self._plan


def _block_table(batch: ForwardBatch, q: torch.Tensor, k_cache: torch.Tensor, prefixes: list[int],
                 q_lens: list[int] | None = None) -> PrefillBlocks:
    group = q.shape[1] // k_cache.shape[2]
    return prefill_block_table(q_lens or batch.q_lens, group, q.device, tile_for(q.dtype, q.shape[2]), prefixes)


def _prefix_runs(batch: ForwardBatch, k_cache: torch.Tensor, prefixes: list[int]) -> list[int]:
    """Each row's ``cudnn_prefill.prefix_run`` from the host's page table (none without it)."""
    num_pages, page = k_cache.shape[:2]
    return [cudnn_prefill.prefix_run(row, prefix, num_pages, page)
            for row, prefix in zip(batch.page_table_host, prefixes)]


def _small_rows(batch: ForwardBatch, q: torch.Tensor, k_cache: torch.Tensor, prefixes: list[int],
                rows: list[int]) -> SmallRows | None:
    """``rows`` of the batch as a batch of their own for the paged kernel (None if there are none):
    their queries' places and row numbers copied to the device once, their block list."""
    if not rows:
        return None
    starts = [sum(batch.q_lens[:b]) for b in rows]
    q_lens = [batch.q_lens[b] for b in rows]
    tokens = [t for start, n in zip(starts, q_lens) for t in range(start, start + n)]
    blocks = _block_table(batch, q, k_cache, [prefixes[b] for b in rows], q_lens)
    return SmallRows(rows, q_lens, *to_device([tokens, rows], q.device), blocks)


def causal_self_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_lens: list[int],
                          scale: float) -> torch.Tensor:
    """Rows without a cached prefix attend over their own new ``k, v [T, kv_heads, D]``, contiguous
    already, through SDPA's fused causal kernel (flash attention on a GPU; with ``enable_gqa`` it
    ran at 571-619 TFLOP/s on an H200 where repeating the KV heads gave 491-601)."""
    out, start = torch.empty_like(q), 0
    gqa = q.shape[1] != k.shape[1]
    for n in q_lens:
        q_b, k_b, v_b = (x[start:start + n].transpose(0, 1)[None] for x in (q, k, v))
        o = F.scaled_dot_product_attention(q_b, k_b, v_b, is_causal=True, scale=scale, enable_gqa=gqa)
        out[start:start + n] = o[0].transpose(0, 1)
        start += n
    return out
