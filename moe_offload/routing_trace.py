"""Record the routing of every token to a trace file, and replay a recorded trace.

A token is known by its sequence key (the sequence's first KV page) and its position, as in
``synthetic_routing``: a replay routes each request as recorded when the run hands out KV pages
as the recorded one did (``scheduler.generate``, the benchmarks); a server with other arrivals gets
recorded routing of whichever request held that page. Recording writes, inside the step and on the device, one row per token into
fixed buffers at a device-side cursor (so it also runs inside captured CUDA graphs, with no host
read and no extra sync); ``trace()`` reads them at exit. Rows of sequence key 0 (the KV scratch
page: CUDA-graph warm-ups and idle rows) are dropped when a trace is read.

```
 row      | step | sequence | position | ids [L, k] int32 | weights [L, k] float32 |
 cursor   [1] int64: rows written so far; rows past the capacity land on a scratch row and are lost
```
"""
from __future__ import annotations

import logging
from typing import NamedTuple

import torch

from moe_offload.routing import Routing
from moe_offload.synthetic_routing import TokenKeys

log = logging.getLogger("sluice.moe_offload")
TRACE_FORMAT = "sluice-routing-trace-1"


class RoutingTrace(NamedTuple):
    """Recorded routing, one row per token in launch order (host tensors)."""

    num_experts: int
    step: torch.Tensor  # [N] int64, the forward pass (0, 1, ...)
    sequence: torch.Tensor  # [N] int64, sequence key
    position: torch.Tensor  # [N] int64
    ids: torch.Tensor  # [N, L, k] int64
    weights: torch.Tensor  # [N, L, k] float32

    @property
    def num_layers(self) -> int:
        return self.ids.shape[1]

    def steps(self) -> list[list[torch.Tensor]]:
        """Per forward pass, per layer, the distinct experts routed to (what one cache lookup sees)."""
        order = torch.argsort(self.step, stable=True)
        bounds = torch.unique_consecutive(self.step[order], return_counts=True)[1].tolist()
        return [[torch.unique(rows[:, layer]) for layer in range(self.num_layers)]
                for rows in torch.split(self.ids[order], bounds)]

    @property
    def top_k(self) -> int:
        return self.ids.shape[2]

    def save(self, path: str) -> None:
        torch.save({"format": TRACE_FORMAT, **self._asdict()}, path)

    @classmethod
    def load(cls, path: str) -> RoutingTrace:
        data = torch.load(path, map_location="cpu", weights_only=True)
        if not isinstance(data, dict) or data.get("format") != TRACE_FORMAT:
            raise ValueError(f"{path} is not a routing trace ({TRACE_FORMAT})")
        return cls(**{field: data[field] for field in cls._fields})


class RecordingRouting:
    """Wraps a ``Routing`` and records what it chooses, up to ``capacity`` tokens."""

    uses_keys = True

    def __init__(self, inner: Routing, num_layers: int, num_experts: int, top_k: int, capacity: int,
                 device: torch.device | str):
        if capacity < 1:
            raise ValueError(f"a routing record needs room for at least one token, got {capacity}")
        self.inner, self.num_experts, self.capacity = inner, num_experts, capacity
        self.meta = torch.zeros(capacity + 1, 3, dtype=torch.int64, device=device)  # + the scratch row
        self.ids = torch.zeros(capacity + 1, num_layers, top_k, dtype=torch.int32, device=device)
        self.weights = torch.zeros(capacity + 1, num_layers, top_k, dtype=torch.float32, device=device)
        self.cursor = torch.zeros(1, dtype=torch.int64, device=device)
        self.step = torch.zeros(1, dtype=torch.int64, device=device)
        self.rows: torch.Tensor | None = None

    def begin(self, keys: TokenKeys | None) -> None:
        self.inner.begin(keys if self.inner.uses_keys else None)
        count = keys.sequence.numel()
        rows = self.cursor + torch.arange(count, device=self.cursor.device)
        self.rows = rows.clamp(max=self.capacity)
        self.meta[self.rows] = torch.stack([self.step.expand(count), keys.sequence, keys.positions], dim=1)
        self.cursor += count
        self.step += 1

    def __call__(self, layer: int, hidden: torch.Tensor, router: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        weights, ids = self.inner(layer, hidden, router)
        self.ids[self.rows, layer] = ids.to(torch.int32)
        self.weights[self.rows, layer] = weights.float()
        return weights, ids

    def predict(self, layer: int, hidden: torch.Tensor, router: torch.Tensor) -> torch.Tensor:
        return self.inner.predict(layer, hidden, router)  # a guess is not routing: not recorded

    def clear(self) -> None:
        """Forget what was recorded so far (e.g. warm-up steps)."""
        self.cursor.zero_()

    def trace(self) -> RoutingTrace:
        """What was recorded so far (reads the device: call it off the hot path)."""
        written = int(self.cursor)
        if written > self.capacity:
            log.warning("routing record: %d tokens past the capacity of %d were not recorded",
                        written - self.capacity, self.capacity)
        n = min(written, self.capacity)
        meta = self.meta[:n].cpu()
        keep = meta[:, 1] != 0
        return RoutingTrace(self.num_experts, meta[keep, 0], meta[keep, 1], meta[keep, 2],
                            self.ids[:n].cpu()[keep].long(), self.weights[:n].cpu()[keep])


class ReplayRouting:
    """Routes each token as ``trace`` recorded it (found by sequence key and position); a token the
    trace lacks takes ``fallback``'s choice and is counted in ``missing`` (a device counter)."""

    uses_keys = True

    def __init__(self, trace: RoutingTrace, fallback: Routing, device: torch.device | str):
        keys = (trace.sequence << 32) | trace.position
        unique, inverse = torch.unique(keys, return_inverse=True)
        first = torch.full((unique.numel(),), keys.numel(), dtype=torch.int64)
        first.scatter_reduce_(0, inverse, torch.arange(keys.numel()), "amin")  # a key's first row
        if unique.numel() == 0:
            raise ValueError("the routing trace holds no tokens")
        self.keys = unique.to(device)
        self.ids = trace.ids[first].to(device)
        self.weights = trace.weights[first].to(device)
        self.fallback = fallback
        self.missing = torch.zeros(1, dtype=torch.int64, device=device)
        self.index: torch.Tensor | None = None
        self.found: torch.Tensor | None = None

    def begin(self, keys: TokenKeys | None) -> None:
        self.fallback.begin(keys if self.fallback.uses_keys else None)
        query = (keys.sequence << 32) | keys.positions
        self.index = torch.searchsorted(self.keys, query).clamp(max=self.keys.numel() - 1)
        self.found = (self.keys[self.index] == query)[:, None]
        self.missing += (~self.found).sum()

    def __call__(self, layer: int, hidden: torch.Tensor, router: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        weights, ids = self.fallback(layer, hidden, router)
        return (torch.where(self.found, self.weights[self.index, layer], weights),
                torch.where(self.found, self.ids[self.index, layer], ids))

    def predict(self, layer: int, hidden: torch.Tensor, router: torch.Tensor) -> torch.Tensor:
        """The fallback's guess: a trace replayed on the model that recorded it sees the hidden
        states of the recording, so the model's router guesses as it would have."""
        return self.fallback.predict(layer, hidden, router)
