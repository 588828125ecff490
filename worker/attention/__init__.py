"""Attention backends over the paged KV pool, chosen by name from a small registry
(``worker.attention.registry``, which the backends import; this package imports them to register
them)."""
from __future__ import annotations

from worker.attention.registry import BACKENDS, AttentionBackend, create_backend, register
from worker.attention import torch_backend  # noqa: F401  (registers "torch")
from worker.attention import triton_backend  # noqa: F401  (registers "triton": the paged kernels)

__all__ = ["BACKENDS", "AttentionBackend", "create_backend", "register"]
