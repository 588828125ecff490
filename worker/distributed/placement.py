"""Which rank runs which expert of each layer: round-robin by id (``e % N``, the default), or
balanced by measured popularity (``--expert-placement popularity:FILE``, a ``--record-routing``
record of this model).

A rank owns as many experts in every layer (``E / N`` under popularity), so that its banks, slots
and masks have one fixed shape; popularity only decides which. Balancing is longest-processing-time greedy under
that count: the layer's experts by descending routed count, each to the least-loaded rank that
still has room.

```
 rank_of   [L, E]    global id -> owning rank                        (host; on the device: the step's masking)
 local_of  [L, E]    global id -> index among its rank's experts     (on the device: resident banks' ids)
 owned(r)  [L, n]    global ids of rank r's experts, ascending       (host: its banks)
```
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from moe_offload.routing_trace import RoutingTrace
from worker.runner_config import EXPERT_PLACEMENTS


class Placement(NamedTuple):
    """Which rank runs each expert: ``rank_of [L, E]`` (host); a rank owns as many experts in
    every layer."""

    rank_of: torch.Tensor  # [L, E] int64
    world: int

    def owned(self, rank: int) -> torch.Tensor:
        """``[L, n]`` the global ids of ``rank``'s experts, ascending, per layer."""
        return torch.nonzero(self.rank_of == rank)[:, 1].view(self.rank_of.shape[0], -1)

    def local_of(self) -> torch.Tensor:
        """``[L, E]`` each expert's index among its rank's experts of the layer."""
        out = torch.zeros_like(self.rank_of)
        for rank in range(self.world):
            mine = self.rank_of == rank
            out += mine * (mine.cumsum(1) - 1)
        return out

    def strided(self, rank: int) -> tuple[int, int] | None:
        """``(first, stride)`` when ``rank`` owns experts ``rank, rank + N, ...`` of every layer
        (what the prefill pipeline's share can stage), else None."""
        layers, num_experts = self.rank_of.shape
        strided = torch.arange(rank, num_experts, self.world).expand(layers, -1)
        return (rank, self.world) if torch.equal(self.owned(rank), strided) else None


def round_robin(num_layers: int, num_experts: int, world: int) -> Placement:
    """Expert ``e`` of every layer on rank ``e % N``."""
    return Placement((torch.arange(num_experts) % world).expand(num_layers, -1).contiguous(), world)


def balanced(counts: torch.Tensor, world: int) -> Placement:
    """Per layer of ``counts [L, E]`` (routed pairs per expert), ``E / N`` experts a rank, the
    ranks' summed counts balanced by LPT greedy."""
    layers, num_experts = counts.shape
    rank_of = torch.empty(layers, num_experts, dtype=torch.int64)
    for layer in range(layers):
        sizes, loads = [0] * world, [0] * world
        row = counts[layer].tolist()
        for e in sorted(range(num_experts), key=lambda e: -row[e]):  # stable: ties keep id order
            rank = min((r for r in range(world) if sizes[r] < num_experts // world), key=loads.__getitem__)
            rank_of[layer, e] = rank
            sizes[rank] += 1
            loads[rank] += row[e]
    return Placement(rank_of, world)


def routed_counts(path: str, num_layers: int, num_experts: int) -> torch.Tensor:
    """``[L, E]`` routed pairs per expert in the routing record at ``path``, checked against the model."""
    trace = RoutingTrace.load(path)
    if (trace.num_layers, trace.num_experts) != (num_layers, num_experts):
        raise ValueError(f"--expert-placement: {path} records {trace.num_layers} layers of {trace.num_experts} "
                         f"experts; the model has {num_layers} of {num_experts}")
    ids = trace.ids.permute(1, 0, 2).reshape(num_layers, -1)  # [L, N*k]
    return torch.zeros(num_layers, num_experts, dtype=torch.int64).scatter_add_(1, ids, torch.ones_like(ids))


def make_placement(spec: str, num_layers: int, num_experts: int, world: int) -> Placement:
    """The placement ``spec`` (``EXPERT_PLACEMENTS``) names, for ``world`` ranks."""
    if spec == "round-robin":
        return round_robin(num_layers, num_experts, world)
    if spec.startswith("popularity:"):
        if num_experts % world:
            raise ValueError(f"--expert-placement popularity needs --gpus {world} to divide the {num_experts} experts "
                             f"of each layer")
        return balanced(routed_counts(spec.removeprefix("popularity:"), num_layers, num_experts), world)
    raise ValueError(f"--expert-placement {spec!r} is not one of {', '.join(EXPERT_PLACEMENTS)}")


def rank_loads(placement: Placement, counts: torch.Tensor) -> torch.Tensor:
    """``[N, L]`` each rank's routed pairs per layer under ``placement``."""
    return torch.stack([(counts * (placement.rank_of == rank)).sum(1) for rank in range(placement.world)])
