"""One token's grouped SwiGLU over fp8 experts (weight-only): the batch-1 decode step.

The general fp8 path (``grouped_gemm_fp8``) aligns the pairs by slot and runs 16-row ``tl.dot``
tiles with 15 dead rows at one token, four launches, and an expert-cache miss is gathered before
it starts. At one token the float path's shape is the right one (``grouped_gemm_decode``): every
(slot, column tile) its own program, float32 multiply-adds with the reduction unrolled, the k
outputs summed inside the down projection, two launches; and with a fill, the gate_up launch
copies the missed experts' weights in as it runs, so the hits compute while the misses cross
PCIe. Here the weights are e4m3 bytes, each widened and multiplied by its scale block's float32
scale as it is loaded (a k step lies inside one scale block: the step is at most the block's
columns), so a step reads half the bytes of bf16's.

```
 [scales of the planned experts]  gather_missing, two small launches (a fill only)
 gate_up    grid (k + copy rows, I / BLOCK_N)   program (j, n): act[j, n], its w13 tile filled first
                                                when the plan admits its slot; copy programs move
                                                the planned experts' w2 rows
 down       grid (1, H / BLOCK_N)               out[h] = sum_j weight_j * act_j . w2[slot_j, h]
```
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from moe_offload.expert_scales import ExpertScales
from moe_offload.formats.expert_format import ScaleBlock
from moe_offload.kernels.decode_tiles import (column_tile, fill_w13_tile, pair_slot, pdl_wait, row_step, tile_step,
                                              w2_copy_program)
from moe_offload.kernels.grouped_gemm_decode import DecodeConfig
from moe_offload.kernels.triton_support import pdl_args
from moe_offload.slot_fill import SlotFill


# The bf16 path's tiles but for the k steps (a step reads as many bytes a row as bf16's), the down's
# warps and a fill's copy step (bytes).
FP8_DECODE_TILES = DecodeConfig(pair_k=128, down_k=256, down_warps=8, fill_k=512)


def scale_mode(block: ScaleBlock, block_n: int) -> str:
    """How the scales vary over a program's ``[BLOCK_K, block_n]`` tile. "k": along the reduction
    only (the block's rows span the tile's columns: a step's scales fold into the activations, one
    multiply a reduction column, and the weights meet them in one fused multiply-add); "n": along
    the columns only (per channel: the sums are scaled once at the end); "kn": along both (each
    weight times its block's scale, a step inside one block)."""
    if block.cols == 0:
        return "n"
    return "k" if block.rows % block_n == 0 else "kn"


@triton.jit
def _scale_row(s_ptr, rows, k0, SCALE_ROWS: tl.constexpr, SCALE_COLS: tl.constexpr, stride_sr):
    """The float32 scales of weight rows ``rows`` at reduction column ``k0`` (per channel: the
    row's one scale)."""
    col = 0 if SCALE_COLS == 0 else k0 // SCALE_COLS
    return tl.load(s_ptr + (rows // SCALE_ROWS).to(tl.int64) * stride_sr + col)


@triton.jit
def _scale_cols(s_ptr, row, ks, k_len, SCALE_ROWS: tl.constexpr, SCALE_COLS: tl.constexpr, stride_sr):
    """The float32 scales of reduction columns ``ks`` in weight row ``row``'s block row (mode "k":
    every column of the tile shares it), 1 past ``k_len``."""
    return tl.load(s_ptr + (row // SCALE_ROWS).to(tl.int64) * stride_sr + ks // SCALE_COLS, mask=ks < k_len,
                   other=1.0)


@triton.jit
def _scaled_dot_step(acc, x, w, s_ptr, row0, rows, ks, k_len, SCALE_ROWS: tl.constexpr, SCALE_COLS: tl.constexpr,
                     stride_sr, MODE: tl.constexpr):
    """``acc += x[:, None] * (w x scales)`` for one reduction step over weight rows ``rows`` (the
    tile's first ``row0``), the scales as ``MODE`` says ("n": left to the caller, who scales the sums)."""
    if MODE == "k":
        x = x * _scale_cols(s_ptr, row0, ks, k_len, SCALE_ROWS, SCALE_COLS, stride_sr)
        acc += x[:, None] * w.to(tl.float32)
    elif MODE == "n":
        acc += x[:, None] * w.to(tl.float32)
    else:
        s = _scale_row(s_ptr, rows, tl.min(ks, 0), SCALE_ROWS, SCALE_COLS, stride_sr)
        acc += x[:, None] * (w.to(tl.float32) * s[None, :])
    return acc


@triton.jit
def _scaled_sum(acc, s_ptr, rows, SCALE_ROWS: tl.constexpr, SCALE_COLS: tl.constexpr, stride_sr,
                MODE: tl.constexpr):
    """The tile's column sums, times the rows' channel scales in mode "n"."""
    total = tl.sum(acc, 0)
    if MODE == "n":
        total = total * _scale_row(s_ptr, rows, 0, SCALE_ROWS, SCALE_COLS, stride_sr)
    return total


# the routing's pointers not specialised on alignment (see grouped_gemm._align_kernel)
@triton.jit(do_not_specialize_on_alignment=["slots_ptr"])
def _pair_gate_up_fp8_kernel(x_ptr, w13_ptr, s13_ptr, act_ptr, slots_ptr, num_slots, inter, up_scale_row,
                             stride_ws, stride_ss, stride_sr, host13_ptr, host2_ptr, w13_bytes_ptr, w2_bytes_ptr,
                             plan_src_ptr, plan_dst_ptr, count_ptr, plan_len, stride_h13, stride_h2, stride_w2s,
                             TOP_K: tl.constexpr, HIDDEN: tl.constexpr, BLOCK_N: tl.constexpr,
                             BLOCK_K: tl.constexpr, SCALE_ROWS: tl.constexpr, SCALE_COLS: tl.constexpr,
                             MODE: tl.constexpr, EVEN: tl.constexpr, FILL: tl.constexpr, PLAN: tl.constexpr,
                             FILL_ROWS: tl.constexpr, FILL_K: tl.constexpr, PDL: tl.constexpr):
    """Program (j, n): act[j, n] = silu(x . gate) * (x . up) for slot j's columns n, from e4m3
    weights times their block scales; a slot outside ``[0, N)`` leaves its row unwritten."""
    pdl_wait(PDL)
    if w2_copy_program(TOP_K, host2_ptr, w2_bytes_ptr, plan_src_ptr, plan_dst_ptr, count_ptr, HIDDEN, inter,
                       stride_h2, stride_w2s, FILL, FILL_ROWS, FILL_K):
        return
    pair, slot, skip = pair_slot(slots_ptr, num_slots)
    if skip:
        return
    if FILL:  # w13 rows are HIDDEN bytes long and contiguous
        fill_w13_tile(host13_ptr, w13_bytes_ptr, plan_src_ptr, plan_dst_ptr, plan_len, slot,
                      tl.program_id(1) * BLOCK_N, inter, HIDDEN, stride_h13, stride_ws, HIDDEN, PLAN, BLOCK_N, FILL_K)
    cols, col_ok = column_tile(inter, BLOCK_N)
    g_rows = w13_ptr + slot * stride_ws + cols[None, :].to(tl.int64) * HIDDEN
    s_gate, rows = s13_ptr + slot * stride_ss, tl.where(col_ok, cols, 0)
    s_up, row0 = s_gate + up_scale_row * stride_sr, tl.program_id(1) * BLOCK_N
    acc_g = tl.zeros((BLOCK_K, BLOCK_N), tl.float32)
    acc_u = tl.zeros((BLOCK_K, BLOCK_N), tl.float32)
    for step in tl.static_range((HIDDEN + BLOCK_K - 1) // BLOCK_K):
        ks = step * BLOCK_K + tl.arange(0, BLOCK_K)
        x = row_step(x_ptr, ks, HIDDEN, EVEN).to(tl.float32)
        g = tile_step(g_rows, ks, col_ok, HIDDEN, 1, EVEN)
        u = tile_step(g_rows + inter * HIDDEN, ks, col_ok, HIDDEN, 1, EVEN)
        acc_g = _scaled_dot_step(acc_g, x, g, s_gate, row0, rows, ks, HIDDEN, SCALE_ROWS, SCALE_COLS, stride_sr, MODE)
        acc_u = _scaled_dot_step(acc_u, x, u, s_up, row0, rows, ks, HIDDEN, SCALE_ROWS, SCALE_COLS, stride_sr, MODE)
    gate = _scaled_sum(acc_g, s_gate, rows, SCALE_ROWS, SCALE_COLS, stride_sr, MODE)
    act = gate * tl.sigmoid(gate) * _scaled_sum(acc_u, s_up, rows, SCALE_ROWS, SCALE_COLS, stride_sr, MODE)
    tl.store(act_ptr + pair * inter + cols, act.to(act_ptr.dtype.element_ty), mask=col_ok)


@triton.jit(do_not_specialize_on_alignment=["weights_ptr", "slots_ptr"])
def _down_fp8_kernel(act_ptr, w2_ptr, s2_ptr, weights_ptr, slots_ptr, out_ptr, num_slots, hidden, stride_ws,
                     stride_ss, stride_sr, TOP_K: tl.constexpr, INTER: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_K: tl.constexpr, SCALE_ROWS: tl.constexpr, SCALE_COLS: tl.constexpr,
                     MODE: tl.constexpr, EVEN: tl.constexpr, PDL: tl.constexpr):
    """out[h] = sum_j (weight_j * act_j) . (w2[slot_j, h] x scale), one float32 accumulator; a
    slot outside ``[0, N)`` reads slot 0 and weighs 0 (its act row was never written). Per channel
    the scales differ by slot, so the host gives mode "kn" for it (each weight scaled)."""
    pdl_wait(PDL)
    cols, col_ok = column_tile(hidden, BLOCK_N)
    rows, row0 = tl.where(col_ok, cols, 0), tl.program_id(1) * BLOCK_N
    acc = tl.zeros((BLOCK_K, BLOCK_N), tl.float32)
    for j in tl.static_range(TOP_K):
        slot = tl.load(slots_ptr + j).to(tl.int64)
        ok = (slot >= 0) & (slot < num_slots)
        weight = tl.where(ok, tl.load(weights_ptr + j).to(tl.float32), 0.0)
        slot = tl.where(ok, slot, 0)
        w_rows = w2_ptr + slot * stride_ws + cols[None, :].to(tl.int64) * INTER
        for step in tl.static_range((INTER + BLOCK_K - 1) // BLOCK_K):
            ks = step * BLOCK_K + tl.arange(0, BLOCK_K)
            a = row_step(act_ptr + j * INTER, ks, INTER, EVEN)
            w = tile_step(w_rows, ks, col_ok, INTER, 1, EVEN)
            a = tl.where(ok, a.to(tl.float32) * weight, 0.0)
            acc = _scaled_dot_step(acc, a, w, s2_ptr + slot * stride_ss, row0, rows, ks, INTER, SCALE_ROWS,
                                   SCALE_COLS, stride_sr, MODE)
    tl.store(out_ptr + cols, tl.sum(acc, 0).to(out_ptr.dtype.element_ty), mask=col_ok)


def supports(hidden: torch.Tensor, scales: ExpertScales | None, fp8_activations: bool) -> bool:
    """Whether this call takes the batch-1 fp8 path: one contiguous token over fp8 (not 4-bit)
    weights, weight-only, with float32 scale grids."""
    return (scales is not None and not scales.kind and not fp8_activations and hidden.shape[0] == 1
            and hidden.is_contiguous() and scales.w13.dtype == torch.float32)


def decode_grouped_swiglu_fp8(hidden: torch.Tensor, weights: torch.Tensor, slots: torch.Tensor, w13: torch.Tensor,
                              w2: torch.Tensor, scales: ExpertScales, config: DecodeConfig | None = None,
                              out_dtype: torch.dtype | None = None, fill: SlotFill | None = None) -> torch.Tensor:
    """``hidden [1, H]`` over fp8 ``w13 [N, 2I, H]``, ``w2 [N, H, I]`` and their ``scales`` (arguments
    checked by ``grouped_swiglu``) -> ``[1, H]`` in ``out_dtype`` (default hidden's). ``fill``: the
    planned experts' scales are gathered first, their weights copied in by the gate_up launch."""
    cfg = config or FP8_DECODE_TILES
    _check(hidden, w13, w2, scales, fill)
    out = torch.empty(1, hidden.shape[1], dtype=out_dtype or hidden.dtype, device=hidden.device)
    slots, weights = slots.contiguous(), weights.contiguous()
    if fill is not None:
        fill.gather_scales(scales.tensors())
    act = _gate_up(hidden, slots, w13, w2, scales, cfg, fill)
    _down(act, weights, slots, w2, scales, out, cfg)
    return out


def _check(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, scales: ExpertScales,
           fill: SlotFill | None) -> None:
    if not (w13.is_contiguous() and w2.is_contiguous()):
        raise ValueError("the batch-1 fp8 path reads contiguous w13 and w2 banks")
    if hidden.shape[0] != 1 or not hidden.is_contiguous():
        raise ValueError(f"the batch-1 fp8 path takes one contiguous token, got {tuple(hidden.shape)}")
    if fill is None:
        return
    if fill.host_scales is None or fill.host_scales.kind:
        raise ValueError("fp8 slots fill from the host's fp8 scales")
    for host, pool in ((fill.host_w13, w13), (fill.host_w2, w2)):
        if host.shape[1:] != pool.shape[1:] or host.dtype != pool.dtype or not host.is_contiguous():
            raise ValueError(f"host bank {tuple(host.shape)} {host.dtype} does not match the slots "
                             f"{tuple(pool.shape)} {pool.dtype}")


def _step(k: int, block: ScaleBlock, mode: str) -> int:
    """The k step: ``k`` (a power of two), in mode "kn" capped at the largest power of two that
    divides the block's columns (a step inside one scale block)."""
    return min(k, block.cols & -block.cols) if mode == "kn" and block.cols else k


def _fill_args(fill: SlotFill | None, w13: torch.Tensor, w2: torch.Tensor, cfg: DecodeConfig,
               grid_n: int) -> tuple[tuple, dict, int]:
    """As ``grouped_gemm_decode._fill_args``, over the banks' bytes."""
    w13_bytes, w2_bytes = w13.view(torch.uint8), w2.view(torch.uint8)
    if fill is None:
        return (w13_bytes, w2_bytes, w13_bytes, w2_bytes, w13, w13, w13, 0, 0, 0, 0), dict(
            FILL=False, PLAN=1, FILL_ROWS=1, FILL_K=1), 0
    src, dst, count = fill.plan
    args = (fill.host_w13.view(torch.uint8), fill.host_w2.view(torch.uint8), w13_bytes, w2_bytes, src, dst, count,
            src.numel(), fill.host_w13.stride(0), fill.host_w2.stride(0), w2.stride(0))
    consts = dict(FILL=True, PLAN=triton.next_power_of_2(max(src.numel(), 1)), FILL_ROWS=cfg.fill_rows,
                  FILL_K=cfg.fill_k)
    return args, consts, triton.cdiv(triton.cdiv(w2.shape[1], cfg.fill_rows), grid_n)


def _gate_up(hidden: torch.Tensor, slots: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, scales: ExpertScales,
             cfg: DecodeConfig, fill: SlotFill | None) -> torch.Tensor:
    top_k, (num_slots, two_inter, dim) = slots.shape[1], w13.shape
    inter, block = two_inter // 2, scales.block
    act = torch.empty(top_k, inter, dtype=hidden.dtype, device=hidden.device)
    grid_n = triton.cdiv(inter, cfg.pair_n)
    fill_args, fill_consts, copy_rows = _fill_args(fill, w13, w2, cfg, grid_n)
    mode = scale_mode(block, cfg.pair_n)
    block_k = _step(cfg.pair_k, block, mode)
    s13 = scales.w13
    _pair_gate_up_fp8_kernel[(top_k + copy_rows, grid_n)](
        hidden, w13, s13, act, slots, num_slots, inter, s13.shape[1] // 2, w13.stride(0), s13.stride(0),
        s13.stride(1), *fill_args, TOP_K=top_k, HIDDEN=dim, BLOCK_N=cfg.pair_n, BLOCK_K=block_k,
        SCALE_ROWS=block.rows, SCALE_COLS=block.cols, MODE=mode, EVEN=dim % block_k == 0 and inter % cfg.pair_n == 0,
        **fill_consts, num_warps=cfg.pair_warps, **pdl_args(hidden))
    return act


def _down(act: torch.Tensor, weights: torch.Tensor, slots: torch.Tensor, w2: torch.Tensor, scales: ExpertScales,
          out: torch.Tensor, cfg: DecodeConfig) -> None:
    num_slots, dim, inter = w2.shape
    block, s2 = scales.block, scales.w2
    mode = "k" if scale_mode(block, cfg.down_n) == "k" else "kn"  # per channel: by slot, so by weight
    block_k = _step(cfg.down_k, block, mode)
    _down_fp8_kernel[(1, triton.cdiv(dim, cfg.down_n))](
        act, w2, s2, weights, slots, out, num_slots, dim, w2.stride(0), s2.stride(0), s2.stride(1),
        TOP_K=slots.shape[1], INTER=inter, BLOCK_N=cfg.down_n, BLOCK_K=block_k, SCALE_ROWS=block.rows,
        SCALE_COLS=block.cols, MODE=mode, EVEN=inter % block_k == 0 and dim % cfg.down_n == 0, num_warps=cfg.down_warps,
        **pdl_args(act))
