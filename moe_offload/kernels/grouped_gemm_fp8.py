"""Triton grouped SwiGLU GEMM over fp8 (e4m3) expert banks: weight-only, dequantized in the GEMM.

The plan is the bf16 kernel's (``moe_offload.kernels.grouped_gemm``) and so are its alignment and
sum-over-k launches; only the two GEMMs differ. A weight tile is loaded in fp8 (half the bytes),
converted to the activation dtype (exact: every e4m3 value is a bf16, fp16 and fp32 value), and
the scale multiplies the partial product rather than the weight tile:

```
 acc[m, n] += (a[m, k0:k0+BK] . q[n, k0:k0+BK]) * scale[n // rows, k0 // cols]    block scales
 acc[m, n]  = (a[m, :] . q[n, :]) * scale[n // rows, 0]                           per channel
```

The first form is exact algebra while one scale covers the whole K tile, i.e. BLOCK_K divides
``cols`` (checked on the host); per-channel scales (``cols == 0``) cover all of K and multiply once
after the loop. Scaling a BLOCK_M x BLOCK_N product costs less than scaling a BLOCK_K x BLOCK_N
weight tile whenever BLOCK_M < BLOCK_K, which is every decode batch. ``w13``'s scale is the gate's
grid stacked on the up's, so gate row n reads scale row ``n // rows`` and up row n reads
``ceil(I / rows) + n // rows``.

``fp8_activations`` selects the fp8 x fp8 variant for measurement: each GEMM's input is quantized
per token and 128 columns first (``quant_fp8``; one more launch before each GEMM) and the dots run
on fp8 tensor cores, the product scaled by the rows' activation scales as well.

Callers go through ``moe_offload.grouped.grouped_swiglu``, which checks the arguments.
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl

from moe_offload.fp8 import ScaleBlock
from moe_offload.kernels.grouped_gemm import (Alignment, BlockConfig, _pair_tile, align_by_slot, pick_config,
                                              sum_over_k)
from moe_offload.kernels.quant_fp8 import ACT_GROUP, quantize_activations

if TYPE_CHECKING:
    from moe_offload.expert_scales import ExpertScales


def default_config(num_tokens: int, dtype: torch.dtype) -> BlockConfig:
    """Fp8-weight tiles for H200, first guess from vLLM's tuned fused_moe table
    ``E=128,N=768,device_name=NVIDIA_H200,dtype=fp8_w8a8,block_shape=[128,128].json``: BLOCK_K 128
    (one scale column per K tile) and BLOCK_N 128 (64 gate + 64 up columns here) at every size;
    M 16 up to 128 tokens, then M 64 with 4 stages. vLLM's M 64 for one token is dropped: our
    decode GEMMs dot in bf16, where M 16 is the smallest tile and wastes least. Fp32 activations
    (tests, CPU) keep the bf16 file's fp32 tile (BLOCK_K 32 divides 128)."""
    return pick_config(num_tokens, dtype, _FP8_CONFIGS)


_FP8_CONFIGS = ((32, BlockConfig(16, 128, 128, 1, 4, 3)), (128, BlockConfig(16, 128, 128, 16, 4, 3)),
                (None, BlockConfig(64, 128, 128, 16, 4, 4)))


def fit_block_k(config: BlockConfig, block: ScaleBlock) -> BlockConfig:
    """Shrink BLOCK_K to a power of two dividing the scale block's columns (a no-op for 128x128
    blocks and per-channel scales), so one scale covers every K tile."""
    if block.cols == 0 or block.cols % config.block_k == 0:
        return config
    block_k = math.gcd(config.block_k, block.cols & -block.cols)
    return config._replace(block_k=block_k)


def check_config(config: BlockConfig, block: ScaleBlock, fp8_activations: bool = False) -> None:
    if block.rows < 1 or block.cols < 0:
        raise ValueError(f"scale block {block} must have rows >= 1 and cols >= 0")
    if block.cols and block.cols % config.block_k:
        raise ValueError(f"BLOCK_K {config.block_k} must divide the scale block's {block.cols} columns")
    if min(config.block_m, config.block_n // 2, config.block_k) < 16:
        raise ValueError(f"tiles {config} are below tl.dot's 16 (block_n counts gate and up columns)")
    if fp8_activations and (ACT_GROUP % config.block_k or config.block_k < 32):
        raise ValueError(f"fp8 activations need BLOCK_K >= 32 (fp8 dots) dividing {ACT_GROUP}; got {config.block_k}")


@triton.jit
def _scaled_dot(a, a_scale, q_ptrs, w_mask, s_ptrs, s_mask, k0, scale_cols, stride_sc, acc,
                K_BLOCKED: tl.constexpr, A_FP8: tl.constexpr, PRECISION: tl.constexpr):
    """acc + a . dequant(q) for one K tile. With K_BLOCKED the tile's weight scale column
    multiplies the product (else the caller applies the per-channel scale after the loop); with
    A_FP8 ``a`` is fp8 too, the dot runs on fp8 tensor cores, and the rows' scales multiply."""
    w = tl.load(q_ptrs, mask=w_mask, other=0.0)
    if A_FP8:
        part = tl.dot(a, w, input_precision=PRECISION) * a_scale[:, None]
        if K_BLOCKED:
            part = part * _weight_scale(s_ptrs, s_mask, k0, scale_cols, stride_sc)[None, :]
        acc = acc + part
    elif K_BLOCKED:
        part = tl.dot(a, w.to(a.dtype), input_precision=PRECISION)
        acc = acc + part * _weight_scale(s_ptrs, s_mask, k0, scale_cols, stride_sc)[None, :]
    else:
        acc = tl.dot(a, w.to(a.dtype), acc, input_precision=PRECISION)
    return acc


@triton.jit
def _weight_scale(s_ptrs, s_mask, k0, scale_cols, stride_sc):
    return tl.load(s_ptrs + (k0 // scale_cols) * stride_sc, mask=s_mask, other=0.0)


@triton.jit
def _act_scale(as_ptrs, k0, act_group, mask, A_FP8: tl.constexpr):
    """Rows' activation scales for the K tile at k0 (a placeholder without A_FP8)."""
    scale = 0.0
    if A_FP8:
        scale = tl.load(as_ptrs + k0 // act_group, mask=mask, other=0.0)
    return scale


# pair and block counts, and the routing's pointers, not specialised (see grouped_gemm._align_kernel)
@triton.jit(do_not_specialize=["num_pairs", "num_blocks"],
            do_not_specialize_on_alignment=["slots_ptr"])
def _gate_up_fp8_kernel(x_ptr, xs_ptr, w13_ptr, s13_ptr, act_ptr, sorted_pairs_ptr, total_ptr, slots_ptr,
                        num_pairs, top_k, hidden, inter, num_blocks, scale_rows, scale_cols, up_scale_row, act_group,
                        stride_xt, stride_xh, stride_xst, stride_ws, stride_wn, stride_wh,
                        stride_ss, stride_sr, stride_sc,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                        K_BLOCKED: tl.constexpr, A_FP8: tl.constexpr, PRECISION: tl.constexpr):
    """act[row, n] = silu(x[token] . w13[slot, n]) * (x[token] . w13[slot, I + n]), w13 dequantized."""
    rows, pairs, slot, cols, col_ok, done = _pair_tile(num_blocks, inter, total_ptr, sorted_pairs_ptr, slots_ptr,
                                                       BLOCK_M, BLOCK_N, GROUP_M)
    if done:
        return
    tokens = tl.where(pairs < num_pairs, pairs // top_k, 0).to(tl.int64)
    a_ptrs = x_ptr + tokens[:, None] * stride_xt
    as_ptrs = xs_ptr + tokens * stride_xst
    g_ptrs = w13_ptr + slot * stride_ws + cols[None, :].to(tl.int64) * stride_wn
    u_ptrs = g_ptrs + inter * stride_wn
    gs_ptrs = s13_ptr + slot * stride_ss + (cols // scale_rows).to(tl.int64) * stride_sr
    us_ptrs = gs_ptrs + up_scale_row * stride_sr
    acc_g = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for k0 in range(0, hidden, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < hidden
        a = tl.load(a_ptrs + ks[None, :] * stride_xh, mask=(pairs < num_pairs)[:, None] & k_ok[None, :], other=0.0)
        a_scale = _act_scale(as_ptrs, k0, act_group, pairs < num_pairs, A_FP8)
        w_mask = k_ok[:, None] & col_ok[None, :]
        acc_g = _scaled_dot(a, a_scale, g_ptrs + ks[:, None] * stride_wh, w_mask, gs_ptrs, col_ok, k0, scale_cols,
                            stride_sc, acc_g, K_BLOCKED, A_FP8, PRECISION)
        acc_u = _scaled_dot(a, a_scale, u_ptrs + ks[:, None] * stride_wh, w_mask, us_ptrs, col_ok, k0, scale_cols,
                            stride_sc, acc_u, K_BLOCKED, A_FP8, PRECISION)
    if not K_BLOCKED:
        acc_g = acc_g * tl.load(gs_ptrs, mask=col_ok, other=0.0)[None, :]
        acc_u = acc_u * tl.load(us_ptrs, mask=col_ok, other=0.0)[None, :]
    act = acc_g * tl.sigmoid(acc_g) * acc_u
    # Padding rows are stored too (as zeros) so the down GEMM reads no uninitialised memory.
    out_ptrs = act_ptr + rows[:, None].to(tl.int64) * inter + cols[None, :]
    tl.store(out_ptrs, act.to(act_ptr.dtype.element_ty), mask=col_ok[None, :])


@triton.jit(do_not_specialize=["num_pairs", "num_blocks"],
            do_not_specialize_on_alignment=["slots_ptr", "weights_ptr"])
def _down_fp8_kernel(act_ptr, acts_ptr, w2_ptr, s2_ptr, out_ptr, sorted_pairs_ptr, total_ptr, slots_ptr, weights_ptr,
                     num_pairs, hidden, inter, num_blocks, scale_rows, scale_cols, act_group, stride_ast,
                     stride_ws, stride_wh, stride_wi, stride_ss, stride_sr, stride_sc,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                     K_BLOCKED: tl.constexpr, A_FP8: tl.constexpr, PRECISION: tl.constexpr):
    """out[pair, h] = weight[pair] * (act[row] . w2[slot, h]), w2 (and act, with A_FP8) dequantized by
    their block scales; ``sum_over_k`` adds up a token's k rows afterwards."""
    rows, pairs, slot, cols, col_ok, done = _pair_tile(num_blocks, hidden, total_ptr, sorted_pairs_ptr, slots_ptr,
                                                       BLOCK_M, BLOCK_N, GROUP_M)
    if done:
        return
    row_ok = pairs < num_pairs
    a_ptrs = act_ptr + rows[:, None].to(tl.int64) * inter
    as_ptrs = acts_ptr + rows.to(tl.int64) * stride_ast
    w_ptrs = w2_ptr + slot * stride_ws + cols[None, :].to(tl.int64) * stride_wh
    s_ptrs = s2_ptr + slot * stride_ss + (cols // scale_rows).to(tl.int64) * stride_sr
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for k0 in range(0, inter, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < inter
        a = tl.load(a_ptrs + ks[None, :], mask=k_ok[None, :], other=0.0)
        a_scale = _act_scale(as_ptrs, k0, act_group, row_ok, A_FP8)
        acc = _scaled_dot(a, a_scale, w_ptrs + ks[:, None] * stride_wi, k_ok[:, None] & col_ok[None, :], s_ptrs,
                          col_ok, k0, scale_cols, stride_sc, acc, K_BLOCKED, A_FP8, PRECISION)
    if not K_BLOCKED:
        acc = acc * tl.load(s_ptrs, mask=col_ok, other=0.0)[None, :]
    weight = tl.load(weights_ptr + pairs, mask=row_ok, other=0.0).to(tl.float32)
    acc = acc * weight[:, None]
    out_ptrs = out_ptr + pairs[:, None].to(tl.int64) * hidden + cols[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


def fused_grouped_swiglu_fp8(hidden: torch.Tensor, weights: torch.Tensor, slots: torch.Tensor,
                             w13: torch.Tensor, w2: torch.Tensor, scales: ExpertScales,
                             config: BlockConfig | None = None, fp8_activations: bool = False,
                             out_dtype: torch.dtype | None = None, groups: int | None = None) -> torch.Tensor:
    """The Triton path of ``grouped_swiglu`` for fp8 banks; arguments are already checked
    (``groups`` as there).

    ``fp8_activations`` quantizes each GEMM's input per token and 128 columns
    (``quant_fp8.quantize_activations``) and runs fp8 x fp8 dots; else the weights are converted
    to the activation dtype (weight-only)."""
    num_tokens, top_k = slots.shape
    num_slots, dim = w2.shape[0], hidden.shape[1]
    block = scales.block
    cfg = config or fit_block_k(default_config(num_tokens, hidden.dtype), block)
    check_config(cfg, block, fp8_activations)
    out = torch.empty(num_tokens, dim, dtype=out_dtype or hidden.dtype, device=hidden.device)
    if num_tokens * top_k == 0:
        return out
    slots = slots.reshape(-1).contiguous()
    align = align_by_slot(slots, num_slots, cfg.block_m, groups=groups)
    x = quantize_activations(hidden.contiguous()) if fp8_activations else (hidden, hidden)
    act = _gate_up(x, hidden.dtype, w13, scales.w13, block, slots, align, top_k, cfg, fp8_activations)
    a = quantize_activations(act, total=align.total) if fp8_activations else (act, act)
    pair_out = torch.empty(slots.numel(), dim, dtype=hidden.dtype, device=hidden.device)
    _down(a, w2, scales.w2, block, slots, weights.reshape(-1).contiguous(), align, pair_out, cfg, fp8_activations)
    sum_over_k(pair_out, slots, out, num_slots, top_k)
    return out


def _precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"


def _gate_up(x: tuple[torch.Tensor, torch.Tensor], dtype: torch.dtype, w13: torch.Tensor, s13: torch.Tensor,
             block: ScaleBlock, slots: torch.Tensor, align: Alignment, top_k: int, cfg: BlockConfig,
             fp8_activations: bool) -> torch.Tensor:
    """``x = (activations, their scales)``; without fp8 activations the second is a placeholder."""
    (xq, xs), (dim, inter) = x, (w13.shape[2], w13.shape[1] // 2)
    act = torch.empty(align.sorted_pairs.numel(), inter, dtype=dtype, device=xq.device)
    n1 = cfg.block_n // 2
    _gate_up_fp8_kernel[(align.num_blocks * triton.cdiv(inter, n1),)](
        xq, xs, w13, s13, act, align.sorted_pairs, align.total, slots,
        slots.numel(), top_k, dim, inter, align.num_blocks, block.rows, block.cols, s13.shape[1] // 2, ACT_GROUP,
        xq.stride(0), xq.stride(1), xs.stride(0), *w13.stride(), *s13.stride(),
        BLOCK_M=cfg.block_m, BLOCK_N=n1, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m, K_BLOCKED=block.cols > 0,
        A_FP8=fp8_activations, PRECISION=_precision(dtype), num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return act


def _down(a: tuple[torch.Tensor, torch.Tensor], w2: torch.Tensor, s2: torch.Tensor, block: ScaleBlock,
          slots: torch.Tensor, weights: torch.Tensor, align: Alignment, pair_out: torch.Tensor, cfg: BlockConfig,
          fp8_activations: bool) -> None:
    (aq, a_scale), (dim, inter) = a, (w2.shape[1], w2.shape[2])
    _down_fp8_kernel[(align.num_blocks * triton.cdiv(dim, cfg.block_n),)](
        aq, a_scale, w2, s2, pair_out, align.sorted_pairs, align.total, slots, weights,
        slots.numel(), dim, inter, align.num_blocks, block.rows, block.cols, ACT_GROUP, a_scale.stride(0),
        *w2.stride(), *s2.stride(),
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m, K_BLOCKED=block.cols > 0,
        A_FP8=fp8_activations, PRECISION=_precision(pair_out.dtype), num_warps=cfg.num_warps,
        num_stages=cfg.num_stages)
