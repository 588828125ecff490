"""Cross-layer expert prefetch for decode under offload.

Without it, a layer's misses cross PCIe only after its own router ran, so the link and the GPU take
turns. With it, the experts predicted for layer ``l+1`` (e.g. layer ``l+1``'s router applied to
layer ``l``'s hidden state, as Pre-gated MoE and HOBBIT do) are admitted to the cache and
gathered on a copy stream while the GPU works on; layer ``l+1``'s lookup then finds them resident
and fetches only the mispredictions. Where the guess starts is the caller's
(``OffloadedExperts``): with the misses gathered before the GEMM (``--expert-fill gather``), right
after layer ``l``'s lookup and gather, so the guess crosses PCIe beside layer ``l``'s GEMM:

```
 compute: lookup+gather l | admit guess l+1 | GEMM l | attention, router l+1 | lookup+gather l+1 | wait | GEMM l+1
                                  | planned                                                        ^ fetched
 copy:                            +-- gather guess l+1 (PCIe) -------------------------------------+
```

With the misses filled by the GEMM (``gemm``, the default) that GEMM reads PCIe itself, so the guess
is admitted after it and crosses beside the next layer's attention and router instead.

- The admission is an ahead lookup (``kernels.lookup_admit``) on the compute stream, so every table
  write stays in one stream's order; only the bytes move on the copy stream.
- It never takes a slot that layer ``l`` reads (its GEMM may run beside the gather) or one it marked
  itself, and drops what does not fit; the real lookup of ``l+1`` never takes a slot the guess
  marked, so the gather it still writes is never overwritten. A wrong guess costs its bytes and the
  slot it took, never a result.
- Layer ``l+1`` waits for ``fetched`` before its GEMM and before the next guess is admitted, so each
  forward pass ends with the copy stream joined: a captured decode graph forks and joins it.
- The gather runs on ``gather_missing.PROGRAMS`` programs (its few-program form), not its wide
  grid: it runs beside the dense GEMVs, which slowed 3.7x beside the wide grid's thousands of
  programs waiting on PCIe (architecture.md, Hybrid models).
- The plan is read by the copy stream after the compute stream let go of it: it is held here until
  the compute stream has waited for the gather, so the allocator cannot hand its memory to later
  compute work first.
"""
from __future__ import annotations

import torch

from moe_offload.expert_cache import ExpertCache
from moe_offload.grouped import ExpertScales
from moe_offload.kernels.gather_missing import PROGRAMS
from moe_offload.kernels.lookup_admit import CopyPlan, LowPriority
from moe_offload.prefill_pipeline import CudaStreams, HostStreams, PipelineStreams

EVENTS = ("planned", "fetched")


class ExpertPrefetch:
    """Admits and gathers a predicted next layer's experts into ``cache`` from the host banks
    ``host_w13 [L*E, 2I, H]``, ``host_w2 [L*E, H, I]`` (and ``host_scales`` for a quantized cache),
    its gather on ``programs`` programs (0: the wide grid), admitting at most ``max_admit`` guessed
    misses a layer, the most likely first (0: every one that fits)."""

    def __init__(self, cache: ExpertCache, host_w13: torch.Tensor, host_w2: torch.Tensor,
                 host_scales: ExpertScales | None = None, streams: PipelineStreams | None = None,
                 programs: int = PROGRAMS, max_admit: int = 0):
        self.cache = cache
        self.programs = programs
        self.max_admit = max_admit
        self.host = (host_w13, host_w2, host_scales)
        device = cache.w13.device
        self.streams = streams or (CudaStreams(device, EVENTS) if device.type == "cuda" else HostStreams())
        self.pending: CopyPlan | None = None  # the plan of the gather in flight

    def fits(self, num_routed: int, num_slots: int) -> bool:
        """Whether ``num_slots`` managed slots still hold a victim for every miss of a real lookup
        of ``num_routed`` (token, expert) pairs after a guess of as many marked its experts: both
        are experts of one layer, at most ``min(2 * num_routed, E)`` slots (shapes only)."""
        return num_slots >= min(2 * num_routed, self.cache.num_experts)

    def start(self, layer: int, guess: torch.Tensor, slot_start: int, low: LowPriority) -> None:
        """Admit ``guess [T, k]`` (expert ids of ``layer``) into ``[slot_start, S)`` and start
        gathering its misses on the copy stream."""
        self.join()
        plan, _ = self.cache.lookup(layer, guess, slot_start, low=low, ahead=True, max_admit=self.max_admit)
        self.streams.record("planned", "compute")
        self.streams.wait("copy", "planned")
        with self.streams.on_copy(f"prefetch layer {layer}"):
            self.cache.fill(plan, *self.host, programs=self.programs)
        self.streams.record("fetched", "copy")
        self.pending = plan

    def join(self) -> None:
        """Work enqueued on the compute stream from now on waits for the gather in flight."""
        if self.pending is not None:
            self.streams.wait("compute", "fetched")
            self.pending = None
