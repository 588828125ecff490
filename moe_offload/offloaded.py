"""Experts kept in host memory behind the GPU expert cache, for decode.

``forward`` is three device-side steps and never waits on the host: lookup/admit (one launch per
layer: hits, victims, copy plan, routing rewritten to slots), gather of the planned experts from the
host banks into their slots, then the grouped SwiGLU GEMM over the slot pools.
"""
from __future__ import annotations

import torch

from moe_offload.expert_cache import ExpertCache
from moe_offload.experts import ExpertBanks
from moe_offload.grouped import grouped_swiglu


class OffloadedExperts:
    """The ``Experts`` backend for host-resident banks ``w13 [L, E, 2I, H]``, ``w2 [L, E, H, I]``.

    With a CUDA cache the banks must be addressable by kernels: pinned or registered host memory
    (the expert store's mapped segment), or device views of it.
    """

    def __init__(self, banks: ExpertBanks, cache: ExpertCache):
        num_layers, num_experts = banks.num_layers, banks.num_experts
        if (num_layers, num_experts) != (cache.num_layers, cache.num_experts):
            raise ValueError(f"banks hold {num_layers}x{num_experts} experts, the cache expects "
                             f"{cache.num_layers}x{cache.num_experts}")
        if not (banks.w13.is_contiguous() and banks.w2.is_contiguous()):
            raise ValueError("host banks must be contiguous: the gather addresses experts by id * size")
        if cache.w13.is_cuda and not all(t.is_cuda or t.is_pinned() for t in banks):
            raise ValueError("a CUDA cache gathers from pinned (mapped) host banks; these are pageable")
        self.cache = cache
        self.host_w13 = banks.w13.view(num_layers * num_experts, *banks.w13.shape[2:])
        self.host_w2 = banks.w2.view(num_layers * num_experts, *banks.w2.shape[2:])

    @classmethod
    def create(cls, banks: ExpertBanks, num_slots: int, device: torch.device | str, policy: str = "lfru",
               backend: str | None = None) -> OffloadedExperts:
        return cls(banks, ExpertCache.for_banks(banks, num_slots, device, policy, backend))

    def forward(self, layer: int, hidden: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        plan, slots = self.cache.lookup(layer, ids)
        self.cache.fill(plan, self.host_w13, self.host_w2)
        return grouped_swiglu(hidden, weights, slots, self.cache.w13, self.cache.w2)
