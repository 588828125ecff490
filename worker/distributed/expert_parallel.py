"""Expert parallelism: expert ``e`` of every layer belongs to rank ``e % N``; each rank runs only
its own experts and the ranks' partial outputs are summed.

Every rank holds every token (attention and dense layers are replicated), so a rank computes its
experts' contribution for all tokens, the routed pairs of other ranks' experts masked to id -1
(they contribute zero, and a cache lookup neither counts nor admits them), and one all_reduce per
MoE layer sums ``[T, H]``. Chosen over all_to_all dispatch because every shape is fixed by the
batch alone (no per-rank token counts to exchange, which would be a host read or a padded
worst case), so the decode step stays capturable in one CUDA graph with NCCL; the price is
all_reduce traffic of ``T x H`` per layer instead of the routed rows only, which at decode sizes is
microseconds over NVLink and at prefill sizes is small beside streaming the layer's experts.

```
 rank r:  ids [T, k] --(ids % N == r ? ids : -1)--> own experts --> out_r [T, H]
 all:     out = sum_r out_r   (all_reduce, in place)
```
"""
from __future__ import annotations

from typing import Callable

import torch

from moe_offload.experts import ExpertBanks, Experts, ResidentExperts
from moe_offload.offloaded import OffloadedExperts
from moe_offload.prefill_pipeline import ExpertShare


def owned_banks(banks: ExpertBanks, rank: int, world: int) -> ExpertBanks:
    """Rank ``rank``'s experts ``rank, rank + N, ...`` of every layer, contiguous: local expert
    ``j`` is global ``rank + N * j``."""
    return banks._replace(**{name: getattr(banks, name)[:, rank::world].contiguous()
                             for name in ("w13", "w2", "w13_scale", "w2_scale") if getattr(banks, name) is not None})


class ExpertParallel:
    """The ``Experts`` of one rank: ``inner`` runs this rank's experts, ``reduce`` sums in place
    over the ranks. Resident experts are indexed by local id (``owned_banks``); offloaded ones by
    global id, since the cache's tables and the shared store address every expert and only the
    masking decides which this rank loads. Other attributes (``cache``, ``pipeline``, ``store``,
    ``pipeline_from``, ``stats``) are the inner backend's."""

    def __init__(self, inner: Experts, rank: int, world: int, reduce: Callable[[torch.Tensor], torch.Tensor],
                 local_ids: bool):
        if not 0 <= rank < world:
            raise ValueError(f"rank {rank} is outside a world of {world}")
        self.inner, self.rank, self.world, self.reduce, self.local_ids = inner, rank, world, reduce, local_ids

    @classmethod
    def wrap(cls, experts: Experts, rank: int, world: int,
             reduce: Callable[[torch.Tensor], torch.Tensor]) -> ExpertParallel:
        if isinstance(experts, ResidentExperts):
            return cls(ResidentExperts(owned_banks(experts.banks, rank, world)), rank, world, reduce, local_ids=True)
        if isinstance(experts, OffloadedExperts):
            experts.run_share(ExpertShare(rank, world))  # the pipeline streams this rank's experts only
        return cls(experts, rank, world, reduce, local_ids=False)

    def begin(self, pipelined: bool, flops: float = 0.0) -> None:
        self.inner.begin(pipelined, flops)

    def fetches_ahead(self, num_tokens: int, top_k: int) -> bool:
        return self.inner.fetches_ahead(num_tokens, top_k)

    def forward(self, layer: int, hidden: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                next_ids: torch.Tensor | None = None, out_dtype: torch.dtype | None = None,
                pipelined: bool | None = None) -> torch.Tensor:
        # a guess of the next layer is prefetched only where it is this rank's expert;
        # float32 partials: their sum rounds once, as one rank's sum over k would
        guess = None if next_ids is None else self.own_ids(next_ids)
        out = self.inner.forward(layer, hidden, weights, self.own_ids(ids), guess, out_dtype=torch.float32,
                                 pipelined=pipelined)
        return self.reduce(out).to(out_dtype or hidden.dtype)

    def own_ids(self, ids: torch.Tensor) -> torch.Tensor:
        """``ids`` with other ranks' experts as -1 (and this rank's as local ids if resident)."""
        mine = ids if not self.local_ids else ids // self.world
        return torch.where(ids % self.world == self.rank, mine, -1)

    def __getattr__(self, name: str):
        if name == "inner":  # not set yet (copy, unpickling): no recursion
            raise AttributeError(name)
        return getattr(self.inner, name)
