"""Decode batches over fp8 experts (weight-only, up to DECODE_MAX_PAIRS (token, slot) pairs): the
plan of the float decode path (``grouped_gemm_decode``) over e4m3 weights and their float32 scales.

The general fp8 path (``grouped_gemm_fp8``) aligns the pairs by slot and runs 16-row ``tl.dot``
tiles, four launches, and an expert-cache miss is gathered before it starts. With few pairs a
program finds its slot's pairs itself, with few tokens the k outputs are summed inside the down,
and with a fill the gate_up launch copies the missed experts' weights in as it runs, so the hits
compute while the misses cross PCIe (their scales, a few hundred bytes an expert, are gathered
first). How a tile meets its scales (``scale_mode``): "k" when a block's rows span the tile's
columns (128x128 blocks): the scales of a step are a vector over k; "n" per channel: the sums are
scaled; "kn" otherwise: each weight times its block's scale, the step inside one block.

```
 [scales of the planned experts]  gather_missing, one small launch (a fill only)
 T = 1
 gate_up    grid (k + copy rows, I / BLOCK_N)   program (j, n): act[j, n], float32 multiply-adds
                                                with the reduction unrolled, its w13 tile filled
                                                first when the plan admits its slot; copy programs
                                                move the planned experts' w2 rows
 T > 1
 gate_up    grid (T*k + copy rows, I / BLOCK_N) a slot's first pair runs every pair on the slot
                                                (16-row tl.dots over the dequantized tile; the
                                                other programs exit at once), filling first
 T <= DECODE_MAX_TOKENS
 down       grid (T, H / BLOCK_N)               out[t, h] = sum_j weight_tj * act_tj . w2[slot_tj, h]
 larger
 down       grid (T*k, H / BLOCK_N)             per slot as gate_up, rows times their weight, then
                                                grouped_gemm.sum_over_k
```
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from moe_offload.expert_scales import ExpertScales
from moe_offload.formats.expert_format import ScaleBlock
from moe_offload.kernels.decode_tiles import (column_tile, fill_w13_tile, pdl_wait, round_pairs, routed_pair,
                                              row_step, slot_program, store_weighted, store_weighted_row, tile_step,
                                              w2_copy_program, weighted_pair)
from moe_offload.kernels.grouped_gemm import sum_over_k
from moe_offload.kernels.grouped_gemm_decode import (DECODE_MAX_PAIRS, DECODE_MAX_TOKENS, DecodeConfig, fill_args,
                                                      tiles_from_env)
from moe_offload.kernels.triton_support import pdl_args, reg_cap
from moe_offload.slot_fill import SlotFill


# The bf16 path's tiles but for one token's (gate_up 16 columns by 128 with 8 warps, down 8 columns
# by 256 with 16: the fastest of `bench_grouped_gemm.py --fp8-decode-sweep` on the H200) and a fill's
# copy step (bytes). The per-slot kernels' tiles are bf16's guesses. The one-token loops
# software-pipelined instead (tl.range stages of cp.async copies to shared memory, commit ea14b16,
# reverted) were slower on the H200 (2026-12-05, the op 26.8 us unrolled): the best gate_up 31.2 us
# (32 columns by 256, 4 warps, 3 stages), every down 55 us or more, a decode step 260 tok/s from 446.
FP8_DECODE_TILES = DecodeConfig(pair_k=128, pair_warps=8, down_n=8, down_k=256, down_warps=16, fill_k=512)
# Without a fill, batches past this many pairs run faster on the general fp8 kernels (H200,
# qwen3-30b's shapes, one layer: 4 tokens 80.1 us there against 95.8 here, 8 tokens 117.7 against
# 162.9); with one, this path copies the misses in its gate_up where the general one gathers first.
RESIDENT_MAX_PAIRS = 16
# "field=N,...": FP8_DECODE_TILES with these DecodeConfig fields changed, for timing other tiles in a
# whole decode step (e.g. "pair_n=32,pair_warps=4"); unset in serving
TILES_ENV = "SLUICE_FP8_DECODE_TILES"


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
    scales = _step_scales(s_ptr, row0, rows, ks, k_len, SCALE_ROWS, SCALE_COLS, stride_sr, MODE)
    return _scaled_fma(acc, x, w, scales, MODE)


@triton.jit
def _step_scales(s_ptr, row0, rows, ks, k_len, SCALE_ROWS: tl.constexpr, SCALE_COLS: tl.constexpr, stride_sr,
                 MODE: tl.constexpr):
    """A step's scales as ``_scaled_fma`` takes them: the reduction columns' ``[BLOCK_K]`` in mode
    "k", the weight rows' ``[BLOCK_N]`` in "kn" (the step inside one block); mode "n" reads none."""
    if MODE == "k":
        scales = _scale_cols(s_ptr, row0, ks, k_len, SCALE_ROWS, SCALE_COLS, stride_sr)
    elif MODE == "kn":
        scales = _scale_row(s_ptr, rows, tl.min(ks, 0), SCALE_ROWS, SCALE_COLS, stride_sr)
    else:
        scales = 1.0
    return scales


@triton.jit
def _scaled_fma(acc, x, w, scales, MODE: tl.constexpr):
    """``acc + x[:, None] * (w x scales)``, the scales from ``_step_scales``: in mode "k" they meet
    the activations (one multiply a reduction column), in "kn" the weights' columns."""
    w = w.to(tl.float32)
    if MODE == "k":
        x = x * scales
    elif MODE == "kn":
        w = w * scales[None, :]
    return acc + x[:, None] * w


@triton.jit
def _scaled_sum(acc, s_ptr, rows, SCALE_ROWS: tl.constexpr, SCALE_COLS: tl.constexpr, stride_sr,
                MODE: tl.constexpr):
    """The tile's column sums, times the rows' channel scales in mode "n"."""
    total = tl.sum(acc, 0)
    if MODE == "n":
        total = total * _scale_row(s_ptr, rows, 0, SCALE_ROWS, SCALE_COLS, stride_sr)
    return total


@triton.jit
def _dequant_step(w, s_ptr, row0, rows, ks, k_len, SCALE_ROWS: tl.constexpr, SCALE_COLS: tl.constexpr, stride_sr,
                  MODE: tl.constexpr):
    """A step's ``[BLOCK_K, BLOCK_N]`` tile in float32 times its scales for a dot (mode "n": unscaled,
    the caller scales the products' columns, ``_scaled_columns``)."""
    w = w.to(tl.float32)
    scales = _step_scales(s_ptr, row0, rows, ks, k_len, SCALE_ROWS, SCALE_COLS, stride_sr, MODE)
    if MODE == "k":
        w = w * scales[:, None]
    elif MODE == "kn":
        w = w * scales[None, :]
    return w


@triton.jit
def _scaled_columns(acc, s_ptr, rows, SCALE_ROWS: tl.constexpr, SCALE_COLS: tl.constexpr, stride_sr,
                    MODE: tl.constexpr):
    """``acc [M, BLOCK_N]`` times the rows' channel scales in mode "n" (one slot's)."""
    if MODE == "n":
        acc = acc * _scale_row(s_ptr, rows, 0, SCALE_ROWS, SCALE_COLS, stride_sr)[None, :]
    return acc


@triton.jit
def _dot_rows(a_ptrs, a_ok, w_ptrs, col_ok, s_ptr, row0, rows, k_len, PRECISION: tl.constexpr,
              BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SCALE_ROWS: tl.constexpr, SCALE_COLS: tl.constexpr,
              stride_sr, MODE: tl.constexpr):
    """``a . (w x scales)`` ``[16, BLOCK_N]`` in float32: 16 activation rows (``a_ptrs [16, 1]``,
    contiguous over k, rows not ``a_ok`` read as 0) against one slot's fp8 rows (``w_ptrs [1, N]``,
    contiguous over k), each step's tile dequantized to the activations' dtype."""
    acc = tl.zeros((16, BLOCK_N), tl.float32)
    for k0 in range(0, k_len, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < k_len
        a = tl.load(a_ptrs + ks[None, :], mask=a_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_ptrs + ks[:, None], mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        w = _dequant_step(w, s_ptr, row0, rows, ks, k_len, SCALE_ROWS, SCALE_COLS, stride_sr, MODE)
        acc = tl.dot(a, w.to(a.dtype), acc, input_precision=PRECISION)
    return _scaled_columns(acc, s_ptr, rows, SCALE_ROWS, SCALE_COLS, stride_sr, MODE)


# the routing's pointers not specialised on alignment (see grouped_gemm._align_kernel)
@triton.jit(do_not_specialize_on_alignment=["slots_ptr"])
def _pair_gate_up_fp8_kernel(x_ptr, w13_ptr, s13_ptr, act_ptr, slots_ptr, weights_ptr, num_slots, inter,
                             up_scale_row, stride_ws, stride_ss, stride_sr, host13_ptr, host2_ptr, w2_bytes_ptr,
                             plan_src_ptr, plan_dst_ptr, count_ptr, plan_len, stride_h13, stride_h2, stride_w2s,
                             w13_bytes_ptr, TOP_K: tl.constexpr, HIDDEN: tl.constexpr, BLOCK_N: tl.constexpr,
                             BLOCK_K: tl.constexpr, SCALE_ROWS: tl.constexpr, SCALE_COLS: tl.constexpr,
                             MODE: tl.constexpr, EVEN: tl.constexpr, FILL: tl.constexpr, PLAN: tl.constexpr,
                             FILL_ROWS: tl.constexpr, FILL_K: tl.constexpr, PDL: tl.constexpr):
    """Program (j, n): act[j, n] = weight_j * silu(x . gate) * (x . up) in float32 for slot j's
    columns n, from e4m3 weights times their block scales; a slot outside ``[0, N)`` gets zeros.
    So the per-token down reads its rows as they are (``_down_fp8_kernel``, WEIGHTED)."""
    pdl_wait(PDL)
    if w2_copy_program(TOP_K, host2_ptr, w2_bytes_ptr, plan_src_ptr, plan_dst_ptr, count_ptr, HIDDEN, inter,
                       stride_h2, stride_w2s, FILL, FILL_ROWS, FILL_K):
        return
    pair, slot, skip, cols, col_ok = weighted_pair(slots_ptr, num_slots, act_ptr, inter, BLOCK_N)
    if skip:
        return
    if FILL:  # w13 rows are HIDDEN bytes long and contiguous
        fill_w13_tile(host13_ptr, w13_bytes_ptr, plan_src_ptr, plan_dst_ptr, plan_len, slot,
                      tl.program_id(1) * BLOCK_N, inter, HIDDEN, stride_h13, stride_ws, HIDDEN, PLAN, BLOCK_N, FILL_K)
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
    store_weighted_row(act_ptr, weights_ptr, pair, inter, cols, col_ok, act)


@triton.jit
def _down_reads(w2_ptr, weights_ptr, slots_ptr, token, num_slots, cols, col_ok, stride_ws, TOP_K: tl.constexpr,
                INTER: tl.constexpr, BLOCK_K: tl.constexpr, EVEN: tl.constexpr):
    """What the per-token down reads of the routing and the weights, as tuples: each pair's slot,
    whether it is in range, and its combine weight (``routed_pair``), then each step's w2 tile
    ``[BLOCK_K, BLOCK_N]`` of the pair's slot, in (pair, step) order."""
    slots, oks, weights, tiles = (), (), (), ()
    for j in tl.static_range(TOP_K):
        _, slot, ok, weight = routed_pair(slots_ptr, weights_ptr, token, j, num_slots, TOP_K)
        slots, oks, weights = slots + (slot,), oks + (ok,), weights + (weight,)
        w_rows = w2_ptr + slot * stride_ws + cols[None, :].to(tl.int64) * INTER
        for step in tl.static_range((INTER + BLOCK_K - 1) // BLOCK_K):
            tiles = tiles + (tile_step(w_rows, step * BLOCK_K + tl.arange(0, BLOCK_K), col_ok, INTER, 1, EVEN),)
    return slots, oks, weights, tiles


@triton.jit(do_not_specialize_on_alignment=["weights_ptr", "slots_ptr"])
def _down_fp8_kernel(act_ptr, w2_ptr, s2_ptr, weights_ptr, slots_ptr, out_ptr, num_slots, hidden, stride_ws,
                     stride_ss, stride_sr, TOP_K: tl.constexpr, INTER: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_K: tl.constexpr, SCALE_ROWS: tl.constexpr, SCALE_COLS: tl.constexpr,
                     MODE: tl.constexpr, EVEN: tl.constexpr, WEIGHTED: tl.constexpr, EARLY: tl.constexpr,
                     PDL: tl.constexpr):
    """Program (t, n): out[t, h] = sum_j (weight_tj * act_tj) . (w2[slot_tj, h] x scale), one float32
    accumulator; a slot outside ``[0, N)`` reads slot 0 and weighs 0 (its act row was never
    written). WEIGHTED: one token's rows, float32, weighted and zeros where unrouted by its gate_up,
    are read as they are (compiled for sm90, 736 instructions a thread where weighing them here
    takes 1,088: each thread converts, weighs and masks its own copy of every act value it
    multiplies, as many as its weights; ``kernel_sass.py --ops``). Per channel the scales differ
    by slot, so the host gives mode "kn" for it (each weight scaled).

    EARLY (the gate_up before it filled no slot): the routing and every w2 tile are read before the
    wait, while the gate_up still runs; the launch before the gate_up wrote the last of them
    (``triton_support.pdl_args``). The act rows (the gate_up's) and the scales (small, in L2) after it."""
    token = tl.program_id(0).to(tl.int64)
    cols, col_ok = column_tile(hidden, BLOCK_N)
    rows, row0 = tl.where(col_ok, cols, 0), tl.program_id(1) * BLOCK_N
    if EARLY:
        early = _down_reads(w2_ptr, weights_ptr, slots_ptr, token, num_slots, cols, col_ok, stride_ws, TOP_K,
                            INTER, BLOCK_K, EVEN)
    pdl_wait(PDL)
    if not EARLY:
        early = _down_reads(w2_ptr, weights_ptr, slots_ptr, token, num_slots, cols, col_ok, stride_ws, TOP_K,
                            INTER, BLOCK_K, EVEN)
    slots, oks, weights, tiles = early
    STEPS: tl.constexpr = (INTER + BLOCK_K - 1) // BLOCK_K
    acc = tl.zeros((BLOCK_K, BLOCK_N), tl.float32)
    for j in tl.static_range(TOP_K):
        for step in tl.static_range(STEPS):
            ks = step * BLOCK_K + tl.arange(0, BLOCK_K)
            a = row_step(act_ptr + (token * TOP_K + j) * INTER, ks, INTER, EVEN).to(tl.float32)
            if not WEIGHTED:
                a = tl.where(oks[j], a * weights[j], 0.0)
            acc = _scaled_dot_step(acc, a, tiles[j * STEPS + step], s2_ptr + slots[j] * stride_ss, row0, rows, ks,
                                   INTER, SCALE_ROWS, SCALE_COLS, stride_sr, MODE)
    tl.store(out_ptr + token * hidden + cols, tl.sum(acc, 0).to(out_ptr.dtype.element_ty), mask=col_ok)


@triton.jit(do_not_specialize=["num_pairs", "plan_len"], do_not_specialize_on_alignment=["slots_ptr"])
def _slot_gate_up_fp8_kernel(x_ptr, w13_ptr, s13_ptr, act_ptr, slots_ptr, num_pairs, top_k, num_slots, inter,
                             up_scale_row, stride_xt, stride_ws, stride_ss, stride_sr, host13_ptr, host2_ptr,
                             w2_bytes_ptr, plan_src_ptr, plan_dst_ptr, count_ptr, plan_len, stride_h13, stride_h2,
                             stride_w2s, w13_bytes_ptr, HIDDEN: tl.constexpr, BLOCK_P: tl.constexpr,
                             BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SCALE_ROWS: tl.constexpr,
                             SCALE_COLS: tl.constexpr, MODE: tl.constexpr, PRECISION: tl.constexpr,
                             FILL: tl.constexpr, PLAN: tl.constexpr, FILL_ROWS: tl.constexpr, FILL_K: tl.constexpr,
                             PDL: tl.constexpr):
    """act[p, n] = silu(x[p // k] . gate[s, n]) * (x[p // k] . up[s, n]) for every pair p on slot s,
    16 pairs a round, the slot's tile filled first when the plan admits it."""
    pdl_wait(PDL)
    if w2_copy_program(num_pairs, host2_ptr, w2_bytes_ptr, plan_src_ptr, plan_dst_ptr, count_ptr, HIDDEN, inter,
                       stride_h2, stride_w2s, FILL, FILL_ROWS, FILL_K):
        return
    slot, on_slot, rank, count, cols, col_ok = slot_program(slots_ptr, num_pairs, num_slots, inter, BLOCK_P, BLOCK_N)
    if count == 0:
        return
    if FILL:
        fill_w13_tile(host13_ptr, w13_bytes_ptr, plan_src_ptr, plan_dst_ptr, plan_len, slot,
                      tl.program_id(1) * BLOCK_N, inter, HIDDEN, stride_h13, stride_ws, HIDDEN, PLAN, BLOCK_N, FILL_K)
    g_ptrs = w13_ptr + slot * stride_ws + cols[None, :].to(tl.int64) * HIDDEN
    s_gate, rows, row0 = s13_ptr + slot * stride_ss, tl.where(col_ok, cols, 0), tl.program_id(1) * BLOCK_N
    for r0 in range(0, count, 16):
        pairs, live = round_pairs(on_slot, rank, count, r0, BLOCK_P)
        a_ptrs = x_ptr + (pairs // top_k)[:, None] * stride_xt
        gate = _dot_rows(a_ptrs, live, g_ptrs, col_ok, s_gate, row0, rows, HIDDEN, PRECISION, BLOCK_N, BLOCK_K,
                         SCALE_ROWS, SCALE_COLS, stride_sr, MODE)
        up = _dot_rows(a_ptrs, live, g_ptrs + inter * HIDDEN, col_ok, s_gate + up_scale_row * stride_sr, row0, rows,
                       HIDDEN, PRECISION, BLOCK_N, BLOCK_K, SCALE_ROWS, SCALE_COLS, stride_sr, MODE)
        act = gate * tl.sigmoid(gate) * up
        tl.store(act_ptr + pairs[:, None] * inter + cols[None, :], act.to(act_ptr.dtype.element_ty),
                 mask=live[:, None] & col_ok[None, :])


@triton.jit(do_not_specialize=["num_pairs"], do_not_specialize_on_alignment=["weights_ptr", "slots_ptr"])
def _slot_down_fp8_kernel(act_ptr, w2_ptr, s2_ptr, weights_ptr, slots_ptr, pair_out_ptr, num_pairs, num_slots, hidden,
                          stride_ws, stride_ss, stride_sr, INTER: tl.constexpr, BLOCK_P: tl.constexpr,
                          BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SCALE_ROWS: tl.constexpr,
                          SCALE_COLS: tl.constexpr, MODE: tl.constexpr, PRECISION: tl.constexpr, PDL: tl.constexpr):
    """pair_out[p, h] = weight[p] * act[p] . (w2[s, h] x scale) for every pair p on slot s."""
    pdl_wait(PDL)
    slot, on_slot, rank, count, cols, col_ok = slot_program(slots_ptr, num_pairs, num_slots, hidden, BLOCK_P, BLOCK_N)
    w_ptrs = w2_ptr + slot * stride_ws + cols[None, :].to(tl.int64) * INTER
    s_slot, rows, row0 = s2_ptr + slot * stride_ss, tl.where(col_ok, cols, 0), tl.program_id(1) * BLOCK_N
    for r0 in range(0, count, 16):  # none unless this program runs its slot
        pairs, live = round_pairs(on_slot, rank, count, r0, BLOCK_P)
        acc = _dot_rows(act_ptr + pairs[:, None] * INTER, live, w_ptrs, col_ok, s_slot, row0, rows, INTER, PRECISION,
                        BLOCK_N, BLOCK_K, SCALE_ROWS, SCALE_COLS, stride_sr, MODE)
        store_weighted(pair_out_ptr, acc, weights_ptr, pairs, live, cols, col_ok, hidden)


def supports(hidden: torch.Tensor, slots: torch.Tensor, scales: ExpertScales | None, fp8_activations: bool,
             filling: bool) -> bool:
    """Whether this call takes the fp8 decode path: contiguous tokens of at most ``DECODE_MAX_PAIRS``
    pairs (``RESIDENT_MAX_PAIRS`` when not ``filling``) over fp8 (not 4-bit) weights, weight-only,
    with float32 scale grids."""
    max_pairs = DECODE_MAX_PAIRS if filling else RESIDENT_MAX_PAIRS
    return (scales is not None and not scales.kind and not fp8_activations and slots.numel() <= max_pairs
            and hidden.is_contiguous() and scales.w13.dtype == torch.float32)


def decode_grouped_swiglu_fp8(hidden: torch.Tensor, weights: torch.Tensor, slots: torch.Tensor, w13: torch.Tensor,
                              w2: torch.Tensor, scales: ExpertScales, config: DecodeConfig | None = None,
                              out_dtype: torch.dtype | None = None, fill: SlotFill | None = None) -> torch.Tensor:
    """``hidden [T, H]`` over fp8 ``w13 [N, 2I, H]``, ``w2 [N, H, I]`` and their ``scales`` (arguments
    checked by ``grouped_swiglu``) -> ``[T, H]`` in ``out_dtype`` (default hidden's). ``fill``: the
    planned experts' scales are gathered first, their weights copied in by the gate_up launch."""
    cfg = config or decode_tiles()
    _check(hidden, slots, w13, w2, fill)
    out = torch.empty(hidden.shape, dtype=out_dtype or hidden.dtype, device=hidden.device)
    if hidden.shape[0] == 0:  # nothing routed: a lookup planned nothing
        return out
    slots, weights = slots.contiguous(), weights.contiguous()
    if fill is not None:
        fill.gather_scales(scales.tensors())
    act, weighted = _gate_up(hidden, weights, slots, w13, w2, scales, cfg, fill)
    if hidden.shape[0] <= DECODE_MAX_TOKENS:  # a fill's gate_up writes w2 rows: the down reads them after it
        _down_per_token(act, weights, slots, w2, scales, out, cfg, weighted, early=fill is None)
    else:
        _down_per_slot(act, weights, slots, w2, scales, out, cfg)
    return out


def decode_tiles() -> DecodeConfig:
    """``FP8_DECODE_TILES``, changed by ``SLUICE_FP8_DECODE_TILES`` where it is set."""
    return tiles_from_env(FP8_DECODE_TILES, TILES_ENV)


def _check(hidden: torch.Tensor, slots: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
           fill: SlotFill | None) -> None:
    if not (w13[0].is_contiguous() and w2[0].is_contiguous()):
        raise ValueError("the fp8 decode path reads each slot's w13 and w2 rows contiguous")
    if not hidden.is_contiguous() or slots.numel() > DECODE_MAX_PAIRS:
        raise ValueError(f"the fp8 decode path takes contiguous tokens of at most {DECODE_MAX_PAIRS} pairs, got "
                         f"{tuple(hidden.shape)} x {slots.shape[-1]}")
    if fill is not None:
        fill.check_quantized(w13, w2, "")


def _step(k: int, block: ScaleBlock, mode: str) -> int:
    """The k step: ``k`` (a power of two), in mode "kn" capped at the largest power of two that
    divides the block's columns (a step inside one scale block)."""
    return min(k, block.cols & -block.cols) if mode == "kn" and block.cols else k


def _bytes(bank: torch.Tensor) -> torch.Tensor:
    return bank.view(torch.uint8)


def _scale_consts(block: ScaleBlock, block_n: int, block_k: int, mode: str | None = None) -> dict:
    """The scale constexprs of a launch whose tiles are ``block_n`` columns and (at most) ``block_k`` deep."""
    mode = mode or scale_mode(block, block_n)
    return dict(BLOCK_K=_step(block_k, block, mode), SCALE_ROWS=block.rows, SCALE_COLS=block.cols, MODE=mode)


def _precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"


def _gate_up(hidden: torch.Tensor, weights: torch.Tensor, slots: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
             scales: ExpertScales, cfg: DecodeConfig, fill: SlotFill | None) -> tuple[torch.Tensor, bool]:
    """``act [T*k, I]`` and whether its rows are weighted: one token's are, in float32, zeros for
    out-of-range slots; more tokens' are in hidden's dtype, rows of out-of-range slots left unwritten
    (the downs never read them)."""
    (num_tokens, top_k), (num_slots, two_inter, dim) = slots.shape, w13.shape
    inter, block, s13 = two_inter // 2, scales.block, scales.w13
    one_row = num_tokens == 1
    act = torch.empty(num_tokens * top_k, inter, dtype=torch.float32 if one_row else hidden.dtype,
                      device=hidden.device)
    block_n = cfg.pair_n if one_row else cfg.gate_up_n
    grid_n = triton.cdiv(inter, block_n)
    copy_args, fill_consts, copy_rows = fill_args(fill, w13, w2, cfg, grid_n, _bytes)
    common = (s13, act, slots)
    tail = (*copy_args, _bytes(w13))
    if one_row:
        consts = _scale_consts(block, block_n, cfg.pair_k)
        _pair_gate_up_fp8_kernel[(top_k + copy_rows, grid_n)](
            hidden, w13, *common, weights, num_slots, inter, s13.shape[1] // 2, w13.stride(0), s13.stride(0),
            s13.stride(1), *tail, TOP_K=top_k, HIDDEN=dim, BLOCK_N=block_n, **consts,
            EVEN=dim % consts["BLOCK_K"] == 0 and inter % block_n == 0, **fill_consts, num_warps=cfg.pair_warps,
            **reg_cap(cfg.pair_regs), **pdl_args(hidden))
        return act, True
    _slot_gate_up_fp8_kernel[(num_tokens * top_k + copy_rows, grid_n)](
        hidden, w13, *common, num_tokens * top_k, top_k, num_slots, inter, s13.shape[1] // 2, hidden.stride(0),
        w13.stride(0), s13.stride(0), s13.stride(1), *tail, HIDDEN=dim, BLOCK_P=_block_p(num_tokens * top_k),
        BLOCK_N=block_n, **_scale_consts(block, block_n, cfg.gate_up_k), PRECISION=_precision(hidden.dtype),
        **fill_consts, num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pdl_args(hidden))
    return act, False


def _block_p(num_pairs: int) -> int:
    return max(16, triton.next_power_of_2(num_pairs))


def _down_per_token(act: torch.Tensor, weights: torch.Tensor, slots: torch.Tensor, w2: torch.Tensor,
                    scales: ExpertScales, out: torch.Tensor, cfg: DecodeConfig, weighted: bool, early: bool) -> None:
    num_slots, dim, inter = w2.shape
    block, s2 = scales.block, scales.w2
    mode = "k" if scale_mode(block, cfg.down_n) == "k" else "kn"  # per channel: by slot, so by weight
    consts = _scale_consts(block, cfg.down_n, cfg.down_k, mode)
    _down_fp8_kernel[(slots.shape[0], triton.cdiv(dim, cfg.down_n))](
        act, w2, s2, weights, slots, out, num_slots, dim, w2.stride(0), s2.stride(0), s2.stride(1),
        TOP_K=slots.shape[1], INTER=inter, BLOCK_N=cfg.down_n, **consts,
        EVEN=inter % consts["BLOCK_K"] == 0 and dim % cfg.down_n == 0, WEIGHTED=weighted,
        EARLY=early and bool(cfg.down_early), num_warps=cfg.down_warps, **pdl_args(act))


def _down_per_slot(act: torch.Tensor, weights: torch.Tensor, slots: torch.Tensor, w2: torch.Tensor,
                   scales: ExpertScales, out: torch.Tensor, cfg: DecodeConfig) -> None:
    (num_tokens, top_k), (num_slots, dim, inter) = slots.shape, w2.shape
    num_pairs, s2 = num_tokens * top_k, scales.w2
    pair_out = torch.empty(num_pairs, dim, dtype=act.dtype, device=out.device)
    _slot_down_fp8_kernel[(num_pairs, triton.cdiv(dim, cfg.slot_down_n))](
        act, w2, s2, weights, slots, pair_out, num_pairs, num_slots, dim, w2.stride(0), s2.stride(0), s2.stride(1),
        INTER=inter, BLOCK_P=_block_p(num_pairs), BLOCK_N=cfg.slot_down_n,
        **_scale_consts(scales.block, cfg.slot_down_n, cfg.slot_down_k), PRECISION=_precision(act.dtype),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pdl_args(act))
    sum_over_k(pair_out, slots.reshape(-1), out, num_slots, top_k)
