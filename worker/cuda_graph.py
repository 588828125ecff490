"""CUDA graphs of the whole decode step: embedding -> layers -> final norm -> lm_head, then sampling.

A decode step launches hundreds of small kernels; replaying them as graphs takes the host out of
the loop. Two graphs per batch-size bucket, the forward and the sampling, so that a step with
grammar-constrained rows can launch its forward before the host has read the previous tokens and
filled its mask, and sample after (``launch``, then ``sample``; ``run`` does both). They are
captured lazily on first use (or all at once with ``capture_all``), into one shared memory pool. The graphs read static input buffers, which each
step fills from one pinned host tensor (one non-blocking copy, then device slicing copies):

```
 inputs[bucket] int64 | ids | buffer_slot | positions | out_loc | seq_lens | top_k | seed | step | state_slot |
                      mask_row | temp,top_p (f32 pairs) |
 page_table [max_batch, max_pages] int64 (shared; a step writes [:bucket, :its widest row])
 window_loc [max_batch], window_table [max_batch, max_pages] int64: gpt-oss's sliding layers' slots
                      and pages in the window pool (where the model has one), written alike
 tokens [capacity] int64: a device copy of the scheduler's token buffer; rows with a buffer_slot read it
 mask [rows, ceil(V/32)] int32: a device copy of the step's grammar mask (worker.token_mask); rows
                      with mask_row -1 (unconstrained, padding) skip it, so unmasked steps copy nothing
```

Rows past the batch duplicate row 0 (token, position, pages, sampling) except that their KV goes to
slot 0 of the scratch page 0, which no sequence owns and every reader masks, and a hybrid model's
state to the scratch state slot 0: they route to row 0's experts, so padding never pulls extra
experts into the cache, and their outputs are dropped.
Attention runs through the paged Triton decode kernel (``worker.attention.triton_decode``), whose
grid depends only on the page table's fixed width. Sampling always takes the general path (no
``all_greedy`` host flag), so greedy and sampled requests share a graph.
"""
from __future__ import annotations

import copy
import struct
from dataclasses import replace
from typing import NamedTuple

import torch

from worker.attention import AttentionBackend
from worker.batch import ForwardBatch, SequenceChunk, host_int64, window_lists
from worker.kv.gpu_pool import KVPool
from worker.models.moe_transformer import MoETransformer
from worker.sampling import Sampling, SamplingTensors, sample, seed32
from worker.token_mask import TokenMask, mask_words

BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64)
INT_FIELDS = 10  # ids, buffer_slot, positions, out_loc, seq_lens, top_k, seed, step, state_slot, mask_row; f32 pairs
_MASK32 = 0xFFFFFFFF  # seeds and steps as SamplingTensors.build keeps them


class _Captured(NamedTuple):
    forward: torch.cuda.CUDAGraph | None  # ids -> logits; None: the step runs eagerly on the static buffers
    sample: torch.cuda.CUDAGraph | None  # logits (grammar-masked) -> next tokens
    inputs: torch.Tensor  # [(INT_FIELDS + 1) * bucket] int64
    logits: torch.Tensor  # [bucket, V] float32
    next_tokens: torch.Tensor  # [bucket] int64


class Launched(NamedTuple):
    """A step whose forward graph is launched and whose sampling is not (``DecodeGraphs.sample``)."""

    step: _Captured
    batch: int
    masked: bool
    words: torch.Tensor | None  # the step's mask words on the device, read when it samples


def decode_buckets(max_batch: int, pipeline_from: int | None) -> tuple[int, ...]:
    """Batch sizes that get a graph. A batch of ``pipeline_from`` tokens or more streams its
    experts through the prefill pipeline (streams and events, not capturable, and not a decode
    path), so the largest bucket stops just below that size and bigger batches run eagerly, as they
    would anyway."""
    limit = max_batch if pipeline_from is None else min(max_batch, pipeline_from - 1)
    return tuple(sorted({b for b in BUCKETS if b < limit} | {limit})) if limit > 0 else ()


class DecodeGraphs:
    """Runs pure decode batches of up to ``max_batch`` sequences through captured graphs.

    ``attention`` must take decode batches with any page-table contents (the "triton" backend).
    ``use_graphs=False`` runs the same static-buffer step eagerly (CPU tests of the packing)."""

    def __init__(self, model: MoETransformer, attention: AttentionBackend, kv_pool: KVPool, max_context: int,
                 max_batch: int, use_graphs: bool = True, window_attention: AttentionBackend | None = None):
        self.model = copy.copy(model)  # shares weights, rotary tables and experts; only attention differs
        self.model.attention = attention
        self.model.window_attention = window_attention or model.window_attention
        self.window_pages = self.model.window_attention.pool.num_pages if self.model.window_attention else 0
        self.device = model.weights.embed.device
        self.vocab = model.cfg.vocab_size
        self.hybrid = model.cfg.is_hybrid
        self.page_size = kv_pool.page_size
        self.max_context = max_context
        self.max_pages = min(-(-max_context // self.page_size), kv_pool.num_pages)
        self.buckets = decode_buckets(max_batch, model.experts.pipeline_from(model.cfg.top_k))
        self.use_graphs = use_graphs
        self.page_table = torch.zeros(max(self.buckets, default=0), self.max_pages, dtype=torch.int64,
                                      device=self.device)
        self.window_table = torch.zeros_like(self.page_table)
        self.window_loc = torch.zeros(max(self.buckets, default=0), dtype=torch.int64, device=self.device)
        self.tokens = torch.zeros(64, dtype=torch.int64, device=self.device)
        self.mask = torch.zeros(64, mask_words(self.vocab), dtype=torch.int32, device=self.device)
        self.pool = torch.cuda.graph_pool_handle() if use_graphs else None
        self.captured: dict[int, _Captured] = {}

    def supports(self, chunks: list[SequenceChunk]) -> bool:
        """Pure decode (one new token per sequence), few enough sequences, within the page table."""
        return (0 < len(chunks) <= max(self.buckets, default=0) and all(len(c.token_ids) == 1 for c in chunks)
                and max(c.prefix_len for c in chunks) < min(self.max_context, self.max_pages * self.page_size)
                and (not self.hybrid or min(c.prefix_len for c in chunks) > 0))  # a fresh state is cleared eagerly

    @torch.inference_mode()
    def run(self, chunks: list[SequenceChunk], sampling: list[Sampling], steps: list[int],
            token_buffer: torch.Tensor | None = None, mask: TokenMask | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``(logits [B, V], next_tokens [B])``: views of the graph's outputs, valid until the next
        ``run`` (use them, or copy them, before the next step is launched)."""
        return self.sample(self.launch(chunks, sampling, steps, token_buffer, mask))

    @torch.inference_mode()
    def launch(self, chunks: list[SequenceChunk], sampling: list[Sampling], steps: list[int],
               token_buffer: torch.Tensor | None = None, mask: TokenMask | None = None) -> Launched:
        """Replay the forward graph of the batch's bucket; ``mask.words`` is read only by ``sample``,
        so the host may still be writing it (in stream order) until then."""
        B = len(chunks)
        bucket = next(b for b in self.buckets if b >= B)
        rows = mask.rows if mask is not None else [-1] * B
        host, width, reads = self._pack(chunks, sampling, steps, rows, bucket, token_buffer is not None)
        if reads:
            self._mirror(token_buffer, reads)
        masked = mask is not None and max(rows) >= 0
        if masked:
            self._fit_mask(mask.words)
        step = self.captured.get(bucket) or self.capture(bucket)
        dev = host.to(self.device, non_blocking=True)
        n = step.inputs.numel()
        step.inputs.copy_(dev[:n])
        self.page_table[:bucket, :width].copy_(dev[n:n + bucket * width].view(bucket, width))
        if self.window_pages:
            rest = dev[n + bucket * width:]
            self.window_loc[:bucket].copy_(rest[:bucket])
            self.window_table[:bucket, :width].copy_(rest[bucket:].view(bucket, width))
        if step.forward is not None:
            step.forward.replay()
        else:
            step.logits.copy_(self._forward(step.inputs, bucket))
        return Launched(step, B, masked, mask.words if masked else None)

    @torch.inference_mode()
    def sample(self, launched: Launched) -> tuple[torch.Tensor, torch.Tensor]:
        """Replay the sampling graph of a launched step: ``(logits, next_tokens)`` as ``run``."""
        step, B = launched.step, launched.batch
        if launched.masked:
            self.mask[:launched.words.shape[0]].copy_(launched.words, non_blocking=True)
        if step.sample is not None:
            step.sample.replay()
        else:
            step.next_tokens.copy_(self._sample(step.inputs, step.logits.shape[0], step.logits))
        return step.logits[:B], step.next_tokens[:B]

    @torch.inference_mode()
    def capture_all(self) -> None:
        for bucket in self.buckets:
            if bucket not in self.captured:
                self.capture(bucket)

    @torch.inference_mode()
    def capture(self, bucket: int) -> _Captured:
        """Warm up once on a side stream (Triton compiles, cuBLAS initialises), then capture. The
        warm-up runs an idle batch (every row on the scratch page), so capturing never touches a
        sequence's KV."""
        inputs = torch.zeros((INT_FIELDS + 1) * bucket, dtype=torch.int64, device=self.device)
        fields, floats = self._fields(inputs, bucket)
        fields[1].fill_(-1)  # no buffer slot
        fields[4].fill_(1)  # seq_len 1: the row's own token on the scratch page
        fields[5].fill_(self.vocab)
        fields[9].fill_(-1)  # no mask row
        floats[1].fill_(1.0)  # top_p
        self.page_table[:bucket].zero_()
        self.window_table[:bucket].zero_()
        self.window_loc[:bucket].zero_()
        if not self.use_graphs:
            step = _Captured(None, None, inputs, *self._step(inputs, bucket))
        else:
            side = torch.cuda.Stream(self.device)
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):
                self._step(inputs, bucket)
            torch.cuda.current_stream(self.device).wait_stream(side)
            forward, sample_graph = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
            with torch.cuda.graph(forward, pool=self.pool, capture_error_mode="thread_local"):
                logits = self._forward(inputs, bucket)
            with torch.cuda.graph(sample_graph, pool=self.pool, capture_error_mode="thread_local"):
                next_tokens = self._sample(inputs, bucket, logits)
            step = _Captured(forward, sample_graph, inputs, logits, next_tokens)
        self.captured[bucket] = step
        return step

    # ==== inside the graph ====

    def _step(self, inputs: torch.Tensor, bucket: int) -> tuple[torch.Tensor, torch.Tensor]:
        logits = self._forward(inputs, bucket)
        return logits, self._sample(inputs, bucket, logits)

    def _forward(self, inputs: torch.Tensor, bucket: int) -> torch.Tensor:
        f, _ = self._fields(inputs, bucket)
        ids = torch.where(f[1] >= 0, self.tokens[f[1].clamp(min=0)], f[0])
        rows = torch.arange(bucket, device=self.device)
        batch = ForwardBatch(ids, f[2], f[3], rows, self.page_table[:bucket], f[4], num_tokens=bucket,
                             is_decode=True, state_slots=f[8] if self.hybrid else None)
        if self.window_pages:
            batch.window = replace(batch, out_loc=self.window_loc[:bucket], page_table=self.window_table[:bucket])
        return self.model.forward(batch)

    def _sample(self, inputs: torch.Tensor, bucket: int, logits: torch.Tensor) -> torch.Tensor:
        f, floats = self._fields(inputs, bucket)
        tensors = SamplingTensors(floats[0], f[5], floats[1], f[6], f[7], all_greedy=False, mask=self.mask,
                                  mask_rows=f[9])
        return sample(logits, tensors)

    @staticmethod
    def _fields(inputs: torch.Tensor, bucket: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``[INT_FIELDS, bucket]`` int64 and ``[2, bucket]`` float32 views of one input block."""
        n = INT_FIELDS * bucket
        return inputs[:n].view(INT_FIELDS, bucket), inputs[n:].view(torch.float32).view(2, bucket)

    # ==== on the host ====

    def _pack(self, chunks: list[SequenceChunk], sampling: list[Sampling], steps: list[int], mask_rows: list[int],
              bucket: int, has_buffer: bool) -> tuple[torch.Tensor, int, int]:
        """One host tensor: the input block, then the page table ``[bucket, width]``. Returns it, the
        width, and how many token-buffer rows the batch reads (0: none)."""
        P = self.page_size
        ids, slots, pos, loc, lens, table = [], [], [], [], [], []
        for b, c in enumerate(chunks):
            n = c.prefix_len // P + 1  # pages holding the prefix and the new token
            if len(c.pages) < n or c.prefix_len < 0:
                raise ValueError(f"sequence {b}: {c.prefix_len + 1} tokens in all, {len(c.pages)} pages")
            ids.append(c.token_ids[0])
            slots.append(c.buffer_slot if has_buffer else -1)
            pos.append(c.prefix_len)
            loc.append(c.pages[n - 1] * P + c.prefix_len % P)
            lens.append(c.prefix_len + 1)
            table.append(c.pages[:n])
        pad = bucket - len(chunks)
        width = max(len(t) for t in table)
        rows = [t + [0] * (width - len(t)) for t in table]
        ints = [ids, slots, pos, loc, lens, [p.top_k or self.vocab for p in sampling],
                [seed32(p) for p in sampling], [s & _MASK32 for s in steps], [max(c.state_slot, 0) for c in chunks]]
        flat = [v for field in ints for v in field + field[:1] * pad] + mask_rows + [-1] * pad
        flat[3 * bucket + len(chunks):4 * bucket] = [0] * pad  # padded rows write the scratch slot ...
        flat[8 * bucket + len(chunks):9 * bucket] = [0] * pad  # ... and the scratch state
        floats = [p.temperature for p in sampling] + [sampling[0].temperature] * pad
        floats += [p.top_p for p in sampling] + [sampling[0].top_p] * pad
        flat += struct.unpack(f"<{bucket}q", struct.pack(f"<{2 * bucket}f", *floats))
        for row in rows + rows[:1] * pad:
            flat += row
        if self.window_pages:
            flat += self._window_rows(chunks, width, pad)
        host = host_int64(flat)
        return (host.pin_memory() if self.device.type == "cuda" else host), width, max(slots) + 1

    def _window_rows(self, chunks: list[SequenceChunk], width: int, pad: int) -> list[int]:
        """The sliding layers' slots ``[bucket]`` (padding on the scratch slot) and page table
        ``[bucket, width]`` (padding duplicates row 0), checked against the window pool."""
        loc, table = window_lists(chunks, self.page_size, width, self.window_pages, self.model.cfg.sliding_window)
        return loc + [0] * pad + table + table[:width] * pad

    def _mirror(self, token_buffer: torch.Tensor, reads: int) -> None:
        """Copy the rows of the token buffer the batch reads into the graphs' own ``tokens``; a
        larger buffer than seen so far reallocates it, which drops the graphs that read the old one."""
        if reads > token_buffer.numel():
            raise ValueError(f"a chunk reads token buffer row {reads - 1}; the buffer has {token_buffer.numel()}")
        if reads > self.tokens.numel():
            self.tokens = torch.zeros(1 << (reads - 1).bit_length(), dtype=torch.int64, device=self.device)
            self._drop_graphs()
        self.tokens[:reads].copy_(token_buffer[:reads])

    def _drop_graphs(self) -> None:
        """Forget every graph (they read a buffer that was just replaced); the next ones capture
        into a fresh memory pool: once its last graph is gone, torch's allocator will not capture
        into a pool again (an internal assert on the H200, torch 2.11)."""
        self.captured.clear()
        if self.use_graphs:
            self.pool = torch.cuda.graph_pool_handle()

    def _fit_mask(self, words: torch.Tensor) -> None:
        """Check the step's mask words against the graphs' own copy, which ``sample`` fills (device
        to device); more rows than seen so far reallocate it, which drops the graphs that read the
        old one (before the step's graphs are picked)."""
        if words.shape[1] != self.mask.shape[1]:
            raise ValueError(f"mask words {tuple(words.shape)} for a vocabulary of {self.vocab}")
        if words.shape[0] > self.mask.shape[0]:
            self.mask = torch.zeros(words.shape, dtype=torch.int32, device=self.device)
            self._drop_graphs()
