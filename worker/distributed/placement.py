"""Which rank runs which expert of each layer: round-robin by id (``e % N``, the default), or
balanced by measured popularity (``--expert-placement popularity:FILE``, a ``--record-routing``
record of this model).

Every rank owns ``E / N`` experts of each layer, so that every rank's banks, slots and masks have
one fixed shape; popularity only decides which. Balancing is longest-processing-time greedy under
that count: the layer's experts by descending routed count, each to the least-loaded rank that
still has room.

```
 owned     [L, E/N]  global ids of a rank's experts, ascending       (host: banks, the pipeline's share)
 rank_of   [L, E]    global id -> owning rank                        (device: the step's masking)
 local_of  [L, E]    global id -> index among its rank's experts     (device: resident banks)
```
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from moe_offload.routing_trace import RoutingTrace

PLACEMENTS = ("round-robin", "popularity:FILE")


class Placement(NamedTuple):
    """Every rank's experts: ``owned[r]`` is rank r's ``[L, E/N]`` global ids, ascending."""

    owned: torch.Tensor  # [N, L, E/N] int64

    def rank_of(self) -> torch.Tensor:
        world, _, count = self.owned.shape
        return self._per_id(torch.arange(world)[:, None].expand(world, count))

    def local_of(self) -> torch.Tensor:
        world, _, count = self.owned.shape
        return self._per_id(torch.arange(count)[None, :].expand(world, count))

    def _per_id(self, values: torch.Tensor) -> torch.Tensor:
        """``[L, E]``: ``values [N, E/N]`` at each rank's owned ids, per layer."""
        world, layers, count = self.owned.shape
        by_layer = self.owned.permute(1, 0, 2).reshape(layers, -1)
        return torch.empty(layers, world * count, dtype=torch.int64).scatter_(
            1, by_layer, values.reshape(1, -1).expand(layers, -1).contiguous())


def round_robin(num_layers: int, num_experts: int, world: int) -> Placement:
    """Expert ``e`` of every layer on rank ``e % N``."""
    owned = torch.arange(num_experts).view(-1, world).t()  # [N, E/N]: rank r's r, r + N, ...
    return Placement(owned[:, None, :].expand(world, num_layers, -1).contiguous())


def balanced(counts: torch.Tensor, world: int) -> Placement:
    """Per layer of ``counts [L, E]`` (routed pairs per expert), ``E / N`` experts a rank, the
    ranks' summed counts balanced by LPT greedy."""
    layers, num_experts = counts.shape
    owned = torch.empty(world, layers, num_experts // world, dtype=torch.int64)
    for layer in range(layers):
        ranks: list[list[int]] = [[] for _ in range(world)]
        loads = [0] * world
        for e in torch.argsort(counts[layer], descending=True, stable=True).tolist():
            rank = min((r for r in range(world) if len(ranks[r]) < num_experts // world), key=loads.__getitem__)
            ranks[rank].append(e)
            loads[rank] += int(counts[layer, e])
        owned[:, layer] = torch.tensor([sorted(r) for r in ranks])
    return Placement(owned)


def routed_counts(path: str, num_layers: int, num_experts: int) -> torch.Tensor:
    """``[L, E]`` routed pairs per expert in the routing record at ``path``, checked against the model."""
    trace = RoutingTrace.load(path)
    if (trace.num_layers, trace.num_experts) != (num_layers, num_experts):
        raise ValueError(f"--expert-placement: {path} records {trace.num_layers} layers of {trace.num_experts} "
                         f"experts; the model has {num_layers} of {num_experts}")
    ids = trace.ids.permute(1, 0, 2).reshape(num_layers, -1)  # [L, N*k]
    return torch.zeros(num_layers, num_experts, dtype=torch.int64).scatter_add_(1, ids, torch.ones_like(ids))


def make_placement(spec: str, num_layers: int, num_experts: int, world: int) -> Placement:
    """The placement ``spec`` (``PLACEMENTS``) names, for ``world`` ranks."""
    if num_experts % world:
        raise ValueError(f"--gpus {world} must divide the {num_experts} experts of each layer")
    if spec == "round-robin":
        return round_robin(num_layers, num_experts, world)
    if spec.startswith("popularity:"):
        return balanced(routed_counts(spec.removeprefix("popularity:"), num_layers, num_experts), world)
    raise ValueError(f"--expert-placement {spec!r} is not one of {', '.join(PLACEMENTS)}")


def rank_loads(placement: Placement, counts: torch.Tensor) -> torch.Tensor:
    """``[N, L]`` each rank's routed pairs per layer under ``placement``."""
    return torch.stack([counts.gather(1, owned) for owned in placement.owned]).sum(-1)
