"""The attention backend protocol and the registry the backends join by name: below the backends,
so that each imports it and nothing imports back up (``worker/attention/__init__.py`` imports
the backends to register them)."""
from __future__ import annotations

from typing import Callable, Protocol

import torch

from worker.batch import ForwardBatch
from worker.kv.gpu_pool import KVPool
from worker.models.rotary import RopeInputs


class AttentionBackend(Protocol):
    pool: KVPool

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: ForwardBatch, *,
                sinks: torch.Tensor | None = None, window: int = 0, rope: RopeInputs | None = None) -> torch.Tensor:
        """Attend ``q [T, heads, D]`` over each sequence's cached and new tokens (causal), return
        ``[T, heads, D]``. With ``rope``, ``q, k`` are the projection's, and the backend rotates
        them and stores the new ``k, v [T, kv_heads, D]`` in the pool (``rope.apply``, one launch;
        the Triton decode attention does it inside its own); without, they are rotated and in the
        pool already. A prefill without a cached prefix reads the new keys from ``k, v``.
        gpt-oss: ``sinks [heads]`` (float32) are logits that join each softmax's denominator with
        no value; ``window`` > 0 limits a query to the ``window`` keys ending at its own position."""
        ...

    def warm_plans(self, heads: int, max_q: int, max_context: int) -> int:
        """Build before serving whatever the backend plans per shape on first use (prefill chunks of
        up to ``max_q`` queries of ``heads`` heads, contexts up to ``max_context``); returns how many
        shapes it planned."""
        ...


BACKENDS: dict[str, Callable[[KVPool, float], AttentionBackend]] = {}


def register(name: str):
    def wrap(factory):
        BACKENDS[name] = factory
        return factory
    return wrap


def create_backend(name: str, pool: KVPool, scale: float) -> AttentionBackend:
    if name not in BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; choose from {sorted(BACKENDS)}")
    return BACKENDS[name](pool, scale)
