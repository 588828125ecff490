"""Experts kept in host memory behind the GPU expert cache.

Decode-sized batches take two device-side steps and never wait on the host: lookup/admit (one
launch per layer: hits, victims, copy plan, routing rewritten to slots), then the grouped SwiGLU
GEMM over the slot pools, whose gate_up launch copies the planned experts from the host banks into
their slots as it reads them (``fill="gemm"``; fp8 banks at batch 1 too, their scales gathered
first; with ``"gather"``, and for other fp8 and 4-bit batches, a gather launch copies them first). With ``prefetch``, the model's guess of the next layer's experts is
admitted and gathered on a copy stream while that GEMM runs (``"gather"``) or after it
(``"gemm"``: the GEMM is then reading over PCIe itself) (``expert_prefetch``).
Prefill-sized batches route to nearly every expert of a layer; they run through the prefill
pipeline instead, which streams each layer's experts into a double buffer while the layer before
computes, and leaves the cache's contents for decode alone.
"""
from __future__ import annotations

import torch

from moe_offload.choices import FILL_MODES, LENT_SLOT_RULES, check_choice
from moe_offload.expert_cache import ExpertCache
from moe_offload.expert_prefetch import ExpertPrefetch
from moe_offload.experts import ExpertBanks
from moe_offload.grouped import ExpertBias, SlotFill, bias_args, grouped_swiglu
from moe_offload.kernels.lookup_admit import LowPriority
from moe_offload.prefill_pipeline import ExpertShare, PrefillPipeline

# A batch with at least this many routed (token, expert) pairs per expert of the layer goes through
# the pipeline: under uniform routing an expert then stays unused with probability ~e^-4, so
# streaming all of them moves about what lookups would, but overlapped and without evicting.
PIPELINE_PAIRS_PER_EXPERT = 4
# ranks the lent slots this many steps older than they are as victims (choices.LENT_SLOT_RULES)
LENT_PENALTY_STEPS = 8


def decode_slots(rule: str, lent: int, num_layers: int) -> tuple[int, LowPriority]:
    """Where decode admits under lent-slot ``rule`` with ``lent`` slots lent to a pipeline (0: none):
    its first slot, and which slots rank first as victims."""
    if lent == 0:
        return 0, LowPriority()
    if rule == "reserve":  # the pipeline's double buffer is off limits to decode (see prefill_pipeline)
        return lent, LowPriority()
    return 0, LowPriority(lent, LENT_PENALTY_STEPS * num_layers)


def _by_id(bank: torch.Tensor) -> torch.Tensor:
    """``[L, E, ...]`` -> ``[L*E, ...]``, indexed by expert id as the cache's tables are."""
    return bank.view(-1, *bank.shape[2:])


class OffloadedExperts:
    """The ``Experts`` backend for host-resident banks ``w13 [L, E, 2I, H]``, ``w2 [L, E, H, I]``
    (fp8 banks with their scale banks: every copy moves the scales beside the weights).

    With a CUDA cache the banks must be addressable by kernels: pinned or registered host memory
    (the expert store's mapped segment), or device views of it. ``pipeline`` turns the prefill
    pipeline on (the cache then needs ``3E`` slots); ``invalidate`` and ``stage`` are its modes (see
    ``choices.INVALIDATE_MODES`` and ``STAGE_MODES``), ``lent_slots`` what decode does with
    the slots it lends (``LENT_SLOT_RULES``). ``prefetch`` turns on cross-layer prefetch for decode
    (admitting at most ``prefetch_cap`` guessed misses a layer, most likely first; 0: all);
    ``fill`` is how decode copies its misses in (``FILL_MODES``).
    """

    def __init__(self, banks: ExpertBanks, cache: ExpertCache, pipeline: bool = False, invalidate: str = "fixed",
                 stage: str = "auto", lent_slots: str = "decode", prefetch: bool = False, fill: str = "gemm",
                 prefetch_cap: int = 0):
        num_layers, num_experts = banks.num_layers, banks.num_experts
        if (num_layers, num_experts) != (cache.num_layers, cache.num_experts):
            raise ValueError(f"banks hold {num_layers}x{num_experts} experts, the cache expects "
                             f"{cache.num_layers}x{cache.num_experts}")
        tensors = banks.tensors()
        if not all(t[0, 0].is_contiguous() and t.stride(0) == t.shape[1] * t.stride(1) for t in tensors):
            raise ValueError("host banks must hold each expert's rows contiguous, an expert id one stride apart "
                             "(the gathers address expert id * stride)")
        if cache.w13.is_cuda and not all(t.is_cuda or t.is_pinned() for t in tensors):
            raise ValueError("a CUDA cache gathers from pinned (mapped) host banks; these are pageable")
        if banks.format != cache.format:
            raise ValueError(f"banks of {banks.format.name} ({banks.scale_block}) do not fit a cache of "
                             f"{cache.format.name} ({cache.format.scale_block})")
        check_choice("lent-slot rule", lent_slots, LENT_SLOT_RULES)
        check_choice("fill mode", fill, FILL_MODES)
        self.cache = cache
        self.fill = fill
        self.host_w13, self.host_w2 = _by_id(banks.w13), _by_id(banks.w2)
        self.host_scales = (None if banks.scale_block is None else
                            banks.scales(0).with_tensors([_by_id(t) for t in banks.tensors()[2:]]))
        self.pipeline = (PrefillPipeline(cache, self.host_w13, self.host_w2, invalidate, stage=stage,
                                         host_scales=self.host_scales) if pipeline else None)
        self.lent_slots = lent_slots
        lent = self.pipeline.lent if self.pipeline is not None else 0
        self.decode_start, self.low = decode_slots(lent_slots, lent, num_layers)
        self.prefetch = (ExpertPrefetch(cache, self.host_w13, self.host_w2, self.host_scales, max_admit=prefetch_cap)
                         if prefetch else None)

    def run_share(self, share: ExpertShare) -> None:
        """Expert parallelism: this process runs only ``share``'s experts of each layer (routes to
        the others come as -1, which lookups skip). The pipeline then stages only those, into
        ``2 x`` that many lent slots, and decode gets the rest of the cache."""
        old = self.pipeline
        if old is None:
            return
        self.pipeline = PrefillPipeline(self.cache, self.host_w13, self.host_w2, old.invalidate, stage=old.stage,
                                        host_scales=self.host_scales, share=share)
        self.decode_start, self.low = decode_slots(self.lent_slots, self.pipeline.lent, self.cache.num_layers)

    @classmethod
    def create(cls, banks: ExpertBanks, num_slots: int, device: torch.device | str, policy: str = "lfru",
               backend: str | None = None, pipeline: bool = False, invalidate: str = "fixed",
               stage: str = "auto", lent_slots: str = "decode", prefetch: bool = False,
               fill: str = "gemm", prefetch_cap: int = 0) -> OffloadedExperts:
        return cls(banks, ExpertCache.for_banks(banks, num_slots, device, policy, backend), pipeline, invalidate, stage,
                   lent_slots, prefetch, fill, prefetch_cap)

    def pipeline_from(self, top_k: int) -> int | None:
        """The fewest tokens whose ``T * top_k`` routed pairs reach ``PIPELINE_PAIRS_PER_EXPERT`` per
        expert (None without a pipeline)."""
        if self.pipeline is None:
            return None
        return -(-PIPELINE_PAIRS_PER_EXPERT * self.cache.num_experts // top_k)

    def pipelines(self, num_tokens: int, top_k: int) -> bool:
        """Whether a batch of ``num_tokens`` routed to ``top_k`` experts each takes the pipeline."""
        start = self.pipeline_from(top_k)
        return start is not None and num_tokens >= start

    def begin(self, pipelined: bool, flops: float = 0.0) -> None:
        """A batch (``flops`` of matmul work) starts: a pipelined one begins staging layer 0 now."""
        if pipelined:
            self.pipeline.begin(flops)

    def fetches_ahead(self, num_tokens: int, top_k: int) -> bool:
        """Whether a batch of ``num_tokens`` takes a guess of each next layer's experts (``forward``'s
        ``next_ids``): decode-sized batches under prefetch, when the cache's decode slots leave room
        for a guess beside the real lookup (shapes only)."""
        return (self.prefetch is not None and not self.pipelines(num_tokens, top_k)
                and self.prefetch.fits(num_tokens * top_k, self.cache.num_slots - self.decode_start))

    def forward(self, layer: int, hidden: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                next_ids: torch.Tensor | None = None, out_dtype: torch.dtype | None = None,
                pipelined: bool | None = None, bias: ExpertBias | None = None,
                activation: str = "silu") -> torch.Tensor:
        """One MoE layer; ``next_ids [T, k]``, a guess of layer ``layer + 1``'s experts, starts their
        gather beside this layer's GEMM (only when ``fetches_ahead``: else the next real lookup
        might find no victim, and the guess is ignored). ``pipelined``: the batch's decision (None:
        from ``ids``' shape)."""
        if pipelined is None:
            pipelined = self.pipelines(*ids.shape)
        if pipelined:
            return self.pipeline.forward(layer, hidden, weights, ids, out_dtype, bias, activation)
        plan, slots = self.cache.lookup(layer, ids, self.decode_start, low=self.low)
        last = layer == self.cache.num_layers - 1
        if last and self.pipeline is not None:  # the step's tables are final: a mirror copies them
            self.pipeline.lookups_done()
        fill = None
        if self.fill == "gemm":
            fill = SlotFill(plan, self.host_w13, self.host_w2, self.host_scales)
        else:
            self.cache.fill(plan, self.host_w13, self.host_w2, self.host_scales)
        if self.prefetch is not None:
            self.prefetch.join()  # this layer's guess has landed before the GEMM reads its slots
        if fill is None:  # the guess's gather runs beside the GEMM
            self._prefetch(layer, next_ids)
        out = grouped_swiglu(hidden, weights, slots, self.cache.w13, self.cache.w2, scales=self.cache.scales,
                             backend=self.cache.backend, out_dtype=out_dtype, fill=fill, activation=activation,
                             groups=self.cache.num_experts, **bias_args(bias, ids))
        if fill is not None:  # the GEMM reads this layer's misses over PCIe: the guess's gather waits for it
            self._prefetch(layer, next_ids)
        if last and self.pipeline is not None:
            self.pipeline.lookups_joined()
        return out

    def _prefetch(self, layer: int, next_ids: torch.Tensor | None) -> None:
        if self.prefetch is not None and next_ids is not None and self.fetches_ahead(*next_ids.shape):
            self.prefetch.start(layer + 1, next_ids, self.decode_start, self.low)

    def stats(self) -> dict[str, int | float | str]:
        """The cache's totals (``moe_*``, ``moe_prefetch_*``) and the pipeline's counters
        (``prefill_*``), flat, as the scheduler reports them; reads the device, so call it off the
        hot path."""
        cache = self.cache.stats()
        stats = {f"moe_{k}": v for k, v in cache["total"].items()}
        stats.update({f"moe_prefetch_{k}": v for k, v in cache["prefetch"].items()})
        stats.update(moe_hit_rate=cache["hit_rate"], moe_cache_slots=cache["slots"], moe_policy=cache["policy"])
        if self.pipeline is not None:
            stats.update({f"prefill_{k}": v for k, v in self.pipeline.stats().items()})
        return stats

    def reset_stats(self) -> None:
        """Zero the cache's and the pipeline's counters (after a warm-up)."""
        self.cache.reset_stats()
        if self.pipeline is not None:
            self.pipeline.reset_stats()
