"""Grouped SwiGLU expert GEMM: every token runs through its k routed experts and the outputs are
combined with the routing weights.

Weight banks are indexed by "slot": for resident experts a slot is the expert id, under offload it
is a slot of the expert cache. ``w13[s]`` is ``[2I, H]`` (gate rows then up rows), ``w2[s]`` is
``[H, I]``.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def grouped_swiglu(
    hidden: torch.Tensor,
    weights: torch.Tensor,
    slots: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
) -> torch.Tensor:
    """``hidden [T, H]``, ``weights [T, k]``, ``slots [T, k]`` -> ``[T, H]`` in hidden's dtype."""
    return grouped_swiglu_eager(hidden, weights, slots, w13, w2)


def grouped_swiglu_eager(
    hidden: torch.Tensor,
    weights: torch.Tensor,
    slots: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
) -> torch.Tensor:
    """Reference: one dense GEMM pair per expert used in the batch.

    Reads the routing on the host (which experts occur), so it is the CPU path and the parity
    oracle, never the GPU hot path.
    """
    num_tokens, top_k = slots.shape
    inter = w2.shape[-1]
    out = torch.zeros(num_tokens, hidden.shape[-1], dtype=torch.float32, device=hidden.device)
    flat_slots = slots.reshape(-1)
    for slot in torch.unique(flat_slots).tolist():
        rows = torch.nonzero(flat_slots == slot).squeeze(-1)
        tokens = rows // top_k
        gate_up = F.linear(hidden[tokens], w13[slot])
        act = F.silu(gate_up[:, :inter]) * gate_up[:, inter:]
        expert_out = F.linear(act, w2[slot])
        out.index_add_(0, tokens, expert_out.float() * weights.reshape(-1)[rows, None])
    return out.to(hidden.dtype)
