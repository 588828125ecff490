"""Top-k routing: router logits -> (combine weights, expert ids), fixed shapes, no host reads."""
from __future__ import annotations

import torch

from moe_offload.kernels._triton import use_triton
from moe_offload.kernels.topk_softmax import topk_softmax, topk_softmax_eager


def route(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax over all experts, keep the top k, optionally renormalise them to sum to one.

    This is the normalisation of both Mixtral (always renormalised, which equals a softmax over the
    top-k logits) and Qwen3-MoE (renormalised when ``norm_topk_prob``). Returns float32 weights
    ``[T, k]`` and int64 expert ids ``[T, k]``. One fused launch on CUDA (``kernels.topk_softmax``).
    """
    if use_triton(router_logits):
        return topk_softmax(router_logits, top_k, renormalize)
    return topk_softmax_eager(router_logits, top_k, renormalize)
