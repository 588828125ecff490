"""Router softmax, top-k and renormalisation in one launch (a program per token row).

Eagerly this is softmax, topk, sum and divide: four launches per MoE layer, each a few µs on a
decode step. The kernel keeps the row's ``E`` probabilities in registers and takes the top k by k
rounds of arg-max (highest first, the lower id on ties, as ``torch.topk`` orders them on CPU).
"""
from __future__ import annotations

import functools

import torch

from moe_offload.kernels.triton_support import next_pow2, pdl_args


def topk_softmax(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``router_logits [T, E]`` -> float32 weights ``[T, k]`` and int64 ids ``[T, k]``, best first."""
    tokens, experts = router_logits.shape
    if not 1 <= top_k <= experts:
        raise ValueError(f"top_k {top_k} must be in [1, {experts}]")
    logits = router_logits.contiguous()
    weights = torch.empty(tokens, top_k, dtype=torch.float32, device=logits.device)
    ids = torch.empty(tokens, top_k, dtype=torch.int64, device=logits.device)
    if tokens:
        _kernel()[(tokens,)](logits, weights, ids, experts, TOP_K=top_k, BLOCK_K=next_pow2(top_k),
                             BLOCK_E=next_pow2(experts), RENORMALIZE=renormalize, num_warps=1,
                             **pdl_args(logits))
    return weights, ids


def topk_softmax_eager(router_logits: torch.Tensor, top_k: int,
                       renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


@functools.cache
def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def topk_softmax_kernel(logits_ptr, weights_ptr, ids_ptr, experts, TOP_K: tl.constexpr,
                            BLOCK_K: tl.constexpr, BLOCK_E: tl.constexpr, RENORMALIZE: tl.constexpr,
                            PDL: tl.constexpr):
        if PDL:  # see triton_support.pdl_args
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        row = tl.program_id(0).to(tl.int64)
        e = tl.arange(0, BLOCK_E)
        x = tl.load(logits_ptr + row * experts + e, mask=e < experts, other=-float("inf")).to(tl.float32)
        p = tl.exp(x - tl.max(x, axis=0))
        p = p / tl.sum(p, axis=0)
        p = tl.where(e < experts, p, -1.0)  # padding never wins a round
        slots = tl.arange(0, BLOCK_K)
        top_w = tl.zeros([BLOCK_K], tl.float32)
        top_i = tl.zeros([BLOCK_K], tl.int64)
        for j in tl.static_range(TOP_K):
            best = tl.max(p, axis=0)
            idx = tl.min(tl.where(p == best, e, BLOCK_E), axis=0)
            top_w = tl.where(slots == j, best, top_w)
            top_i = tl.where(slots == j, idx.to(tl.int64), top_i)
            p = tl.where(e == idx, -1.0, p)
        if RENORMALIZE:
            top_w = top_w / tl.sum(tl.where(slots < TOP_K, top_w, 0.0), axis=0)
        tl.store(weights_ptr + row * TOP_K + slots, top_w, mask=slots < TOP_K)
        tl.store(ids_ptr + row * TOP_K + slots, top_i, mask=slots < TOP_K)

    return topk_softmax_kernel
