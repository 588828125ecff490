"""Top-k routing: router logits -> (combine weights, expert ids), fixed shapes, no host reads."""
from __future__ import annotations

import torch


def route(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax over all experts, keep the top k, optionally renormalise them to sum to one.

    This is the normalisation of both Mixtral (always renormalised, which equals a softmax over the
    top-k logits) and Qwen3-MoE (renormalised when ``norm_topk_prob``). Returns float32 weights
    ``[T, k]`` and int64 expert ids ``[T, k]``.
    """
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids
