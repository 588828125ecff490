"""The grouped SwiGLU expert GEMM for decode batches (a few tokens): two launches, no sort.

The general path (``grouped_gemm``) groups the T*k (token, slot) pairs by slot with an align
kernel, and sums each token's k outputs in a fourth launch. With a few tokens the grouping can be
found inside the GEMM and the sum inside the down projection:

```
 gate_up  grid (T*k, I / BLOCK_N)   pair p runs only if it is its slot's first pair: one program
                                    reads the slot's w13 tile once for every pair routed to it
                                    (a [T*k, H] x [H, BLOCK_N] dot over the pairs on the slot,
                                    the other rows masked; the other programs exit at once)
 down     grid (T, H / BLOCK_N)     token t: out[t] = sum_j (weight[t, j] * act[t, j]) . w2[slot_j]
                                    in one float32 accumulator, rounded once: the combine is
                                    folded into the down projection
```

The down launch reads a slot's w2 once per token that uses it, so the path pays for slots that
several tokens share; DECODE_MAX_TOKENS keeps it to batches where few do. Slots outside ``[0, N)``
contribute zero, as on the general path. Callers go through ``moe_offload.grouped.grouped_swiglu``,
which checks the arguments and keeps the eager twin (``grouped_swiglu_eager``).
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

# Batches up to this many tokens take this path. A duplicate (two tokens on one slot) costs one
# more read of w2 (a third of an expert); uniform routing of 4 tokens x top-8 over 128 experts
# expects about 3.7 of them (~12 MB at qwen3-30b's shapes), about what the two launches saved cost.
DECODE_MAX_TOKENS = 4


class DecodeConfig(NamedTuple):
    """Tile sizes: gate_up columns (each of gate and up) and reduction step, down columns and
    reduction step, warps."""

    gate_up_n: int = 32
    gate_up_k: int = 128
    down_n: int = 16
    down_k: int = 256
    num_warps: int = 4
    num_stages: int = 3


@triton.jit
def _decode_gate_up_kernel(x_ptr, w13_ptr, act_ptr, slots_ptr, num_pairs, top_k, num_slots, hidden, inter,
                           stride_xt, stride_xh, stride_ws, stride_wn, stride_wh,
                           BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                           PRECISION: tl.constexpr):
    """act[p, n] = silu(x[p // k] . w13[s, n]) * (x[p // k] . w13[s, I + n]) for every pair p on slot s."""
    slot = tl.load(slots_ptr + tl.program_id(0)).to(tl.int64)
    ps = tl.arange(0, BLOCK_P)
    on_slot = tl.load(slots_ptr + ps, mask=ps < num_pairs, other=-1).to(tl.int64) == slot
    first = tl.min(tl.where(on_slot, ps, BLOCK_P), 0)
    if (slot < 0) | (slot >= num_slots) | (first != tl.program_id(0)):
        return
    tokens = (ps // top_k).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < inter
    g_ptrs = w13_ptr + slot * stride_ws + cols[None, :].to(tl.int64) * stride_wn
    u_ptrs = g_ptrs + inter * stride_wn
    acc_g = tl.zeros((BLOCK_P, BLOCK_N), tl.float32)
    acc_u = tl.zeros((BLOCK_P, BLOCK_N), tl.float32)
    for k0 in range(0, hidden, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < hidden
        a = tl.load(x_ptr + tokens[:, None] * stride_xt + ks[None, :] * stride_xh,
                    mask=on_slot[:, None] & k_ok[None, :], other=0.0)
        w_mask = k_ok[:, None] & col_ok[None, :]
        g = tl.load(g_ptrs + ks[:, None] * stride_wh, mask=w_mask, other=0.0)
        u = tl.load(u_ptrs + ks[:, None] * stride_wh, mask=w_mask, other=0.0)
        acc_g = tl.dot(a, g, acc_g, input_precision=PRECISION)
        acc_u = tl.dot(a, u, acc_u, input_precision=PRECISION)
    act = acc_g * tl.sigmoid(acc_g) * acc_u
    out_ptrs = act_ptr + ps[:, None].to(tl.int64) * inter + cols[None, :]
    tl.store(out_ptrs, act.to(act_ptr.dtype.element_ty), mask=on_slot[:, None] & col_ok[None, :])


@triton.jit
def _decode_down_kernel(act_ptr, w2_ptr, weights_ptr, slots_ptr, out_ptr, top_k, num_slots, hidden, inter,
                        stride_ws, stride_wh, stride_wi, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                        PRECISION: tl.constexpr):
    """out[t, h] = sum_j (weight[t, j] * act[t*k + j]) . w2[slot_j, h], one float32 accumulator.

    A tl.dot with one live row (the other 15 masked, never loaded) rather than a vector product,
    so the loads are software-pipelined as in the GEMMs; the k experts run as one flat loop."""
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < hidden
    row0 = tl.arange(0, 16)[:, None] == 0
    steps = tl.cdiv(inter, BLOCK_K)
    acc = tl.zeros((16, BLOCK_N), tl.float32)
    for step in range(0, top_k * steps):
        pair = token * top_k + step // steps
        ks = (step % steps) * BLOCK_K + tl.arange(0, BLOCK_K)
        slot = tl.load(slots_ptr + pair).to(tl.int64)
        in_range = slot + 0 * ks  # a vector compare: the interpreter rejects a broadcast scalar mask
        k_ok = (ks < inter) & (in_range >= 0) & (in_range < num_slots)  # an unwritten act row is never read
        weight = tl.load(weights_ptr + pair).to(tl.float32)  # pair < T*k: in bounds
        a = tl.load(act_ptr + pair * inter + ks[None, :] + 0 * row0, mask=row0 & k_ok[None, :], other=0.0)
        a = (a.to(tl.float32) * weight).to(act_ptr.dtype.element_ty)
        w = tl.load(w2_ptr + tl.where(slot < num_slots, tl.maximum(slot, 0), 0) * stride_ws
                    + cols[None, :].to(tl.int64) * stride_wh + ks[:, None] * stride_wi,
                    mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        acc = tl.dot(a, w, acc, input_precision=PRECISION)
    out = tl.sum(tl.where(row0, acc, 0.0), 0)
    tl.store(out_ptr + token * hidden + cols, out.to(out_ptr.dtype.element_ty), mask=col_ok)


def decode_grouped_swiglu(hidden: torch.Tensor, weights: torch.Tensor, slots: torch.Tensor, w13: torch.Tensor,
                          w2: torch.Tensor, config: DecodeConfig | None = None) -> torch.Tensor:
    """The decode path of ``grouped_swiglu`` (``hidden [T, H]`` with T <= DECODE_MAX_TOKENS, float
    banks); arguments are already checked."""
    num_tokens, top_k = slots.shape
    if num_tokens > DECODE_MAX_TOKENS:
        raise ValueError(f"the decode path takes at most {DECODE_MAX_TOKENS} tokens; got {num_tokens}")
    num_slots, inter, dim = w2.shape[0], w2.shape[2], hidden.shape[1]
    cfg = config or DecodeConfig()
    out = torch.empty(num_tokens, dim, dtype=hidden.dtype, device=hidden.device)
    if num_tokens == 0:
        return out
    slots, weights = slots.contiguous(), weights.contiguous()
    act = torch.empty(num_tokens * top_k, inter, dtype=hidden.dtype, device=hidden.device)
    precision = "ieee" if hidden.dtype == torch.float32 else "tf32"
    _decode_gate_up_kernel[(num_tokens * top_k, triton.cdiv(inter, cfg.gate_up_n))](
        hidden, w13, act, slots, num_tokens * top_k, top_k, num_slots, dim, inter,
        hidden.stride(0), hidden.stride(1), w13.stride(0), w13.stride(1), w13.stride(2),
        BLOCK_P=max(16, triton.next_power_of_2(num_tokens * top_k)), BLOCK_N=cfg.gate_up_n,
        BLOCK_K=cfg.gate_up_k, PRECISION=precision, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    _decode_down_kernel[(num_tokens, triton.cdiv(dim, cfg.down_n))](
        act, w2, weights, slots, out, top_k, num_slots, dim, inter, w2.stride(0), w2.stride(1), w2.stride(2),
        BLOCK_N=cfg.down_n, BLOCK_K=cfg.down_k, PRECISION=precision, num_warps=cfg.num_warps,
        num_stages=cfg.num_stages)
    return out
