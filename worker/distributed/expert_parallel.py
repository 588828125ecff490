"""Expert parallelism: each expert of every layer belongs to one rank (``placement``: ``e % N`` by
default, or balanced by measured popularity); each rank runs only its own experts and the ranks'
partial outputs are summed.

Every rank holds every token (attention and dense layers are replicated), so a rank computes its
experts' contribution for all tokens, the routed pairs of other ranks' experts masked to id -1
(they contribute zero, and a cache lookup neither counts nor admits them), and one all_reduce per
MoE layer sums ``[T, H]``. Chosen over all_to_all dispatch because every shape is fixed by the
batch alone (no per-rank token counts to exchange, which would be a host read or a padded
worst case), so the decode step stays capturable in one CUDA graph with NCCL; the price is
all_reduce traffic of ``T x H`` per layer instead of the routed rows only, which at decode sizes is
microseconds over NVLink and at prefill sizes is small beside streaming the layer's experts.

```
 rank r:  ids [T, k] --(rank_of[layer, ids] == r ? ids : -1)--> own experts --> out_r [T, H]
 all:     out = sum_r out_r   (all_reduce, in place)
```
"""
from __future__ import annotations

from typing import Callable

import torch

from moe_offload.experts import BANK_NAMES, ExpertBanks, Experts, ResidentExperts
from moe_offload.offloaded import OffloadedExperts
from moe_offload.prefill_pipeline import ExpertShare
from worker.distributed.placement import Placement


def owned_banks(banks: ExpertBanks, owned: torch.Tensor) -> ExpertBanks:
    """A rank's experts ``owned [L, n]`` (global ids) of every layer, contiguous: local expert
    ``j`` of layer ``l`` is global ``owned[l, j]``."""
    layers = torch.arange(owned.shape[0], device=owned.device)[:, None]
    return banks._replace(**{name: getattr(banks, name)[layers, owned].contiguous()
                             for name in BANK_NAMES if getattr(banks, name) is not None})


class ExpertParallel:
    """The ``Experts`` of one rank: ``inner`` runs this rank's experts, ``reduce`` sums in place
    over the ranks. Resident experts are indexed by local id (``owned_banks``); offloaded ones by
    global id, since the cache's tables and the shared store address every expert and only the
    masking decides which this rank loads. Other attributes (``cache``, ``pipeline``, ``store``,
    ``pipeline_from``, ``stats``) are the inner backend's."""

    def __init__(self, inner: Experts, rank: int, placement: Placement, reduce: Callable[[torch.Tensor], torch.Tensor],
                 local_ids: bool, device: torch.device | str = "cpu"):
        if not 0 <= rank < placement.world:
            raise ValueError(f"rank {rank} is outside a world of {placement.world}")
        self.inner, self.rank, self.world, self.reduce, self.local_ids = inner, rank, placement.world, reduce, local_ids
        # [L, E] device maps, read by the step's masking on the device
        self.rank_of, self.local_of = placement.rank_of.to(device), placement.local_of().to(device)

    @classmethod
    def wrap(cls, experts: Experts, rank: int, placement: Placement,
             reduce: Callable[[torch.Tensor], torch.Tensor], device: torch.device | str) -> ExpertParallel:
        if isinstance(experts, ResidentExperts):
            banks = owned_banks(experts.banks, placement.owned(rank).to(experts.banks.w13.device))
            return cls(ResidentExperts(banks), rank, placement, reduce, local_ids=True, device=device)
        if isinstance(experts, OffloadedExperts) and experts.pipeline is not None:
            experts.run_share(cls._share(placement, rank))  # the pipeline streams this rank's experts only
        return cls(experts, rank, placement, reduce, local_ids=False, device=device)

    @staticmethod
    def _share(placement: Placement, rank: int) -> ExpertShare:
        share = placement.strided(rank)
        if share is None:
            raise ValueError("--expert-placement popularity:FILE needs --no-prefill-pipeline with an expert cache: "
                             "the prefill pipeline stages a round-robin share (experts r, r+N, ...) only")
        return ExpertShare(*share)

    def begin(self, pipelined: bool, flops: float = 0.0) -> None:
        self.inner.begin(pipelined, flops)

    def fetches_ahead(self, num_tokens: int, top_k: int) -> bool:
        return self.inner.fetches_ahead(num_tokens, top_k)

    def forward(self, layer: int, hidden: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                next_ids: torch.Tensor | None = None, out_dtype: torch.dtype | None = None,
                pipelined: bool | None = None, bias=None, activation: str = "silu") -> torch.Tensor:
        if bias is not None or activation != "silu":
            raise ValueError("expert parallelism over gpt-oss's experts (biases, clamped SwiGLU) is not supported yet")
        # a guess of the next layer is prefetched only where it is this rank's expert;
        # float32 partials: their sum rounds once, as one rank's sum over k would
        guess = None if next_ids is None else self.own_ids(layer + 1, next_ids)
        out = self.inner.forward(layer, hidden, weights, self.own_ids(layer, ids), guess, out_dtype=torch.float32,
                                 pipelined=pipelined)
        return self.reduce(out).to(out_dtype or hidden.dtype)

    def own_ids(self, layer: int, ids: torch.Tensor) -> torch.Tensor:
        """``layer``'s routed ``ids`` with other ranks' experts as -1 (and this rank's as local ids
        if resident); gathers from the device maps, no host read."""
        known = ids.clamp(min=0)
        mine = (self.rank_of[layer][known] == self.rank) & (ids >= 0)
        return torch.where(mine, self.local_of[layer][known] if self.local_ids else ids, -1)

    def __getattr__(self, name: str):
        if name == "inner":  # not set yet (copy, unpickling): no recursion
            raise AttributeError(name)
        return getattr(self.inner, name)
