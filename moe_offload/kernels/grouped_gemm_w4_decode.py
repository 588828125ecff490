"""The 4-bit grouped SwiGLU GEMM for decode batches (up to DECODE_MAX_PAIRS (token, slot) pairs):
no align kernel, no sort; the plan of ``grouped_gemm_decode`` with 4-bit tiles
(``grouped_gemm_w4_tiles``):

```
 gate_up  one token      grid (k, I / pair_n)      program (j, n): its own pair, fp32 multiply-adds
                                                   of the decoded tile, the reduction over H unrolled;
                                                   act rows in fp32 times w_j (zeros where unrouted)
          more tokens    grid (T*k, I / gate_up_n) a slot's first pair runs every pair on the slot
                                                   (16-row tl.dots); the other programs exit at once
 down     T <= 4         grid (T, H / down_n)      out[t] = sum_j w_j (act_j . w2[s_j] + b) in one fp32
                                                   accumulator, both loops unrolled: combine folded in
                                                   (one token: the weighted rows read as they are)
          more tokens    grid (T*k, H / slot_n)    per slot as gate_up, rows times their weight, then
                                                   grouped_gemm.sum_over_k
```

The multiply-add tiles sum a group's products first and scale the sum once (``fma_tile``): per
weight about two integer operations of decoding, a widening and 1.5 float operations (sm90 SASS,
compiled offline: about 5.5 instructions a weight, so batch 1 is near the issue rate while the
weights stream at HBM speed; a quarter of bf16's bytes either way). Grids depend on shapes only,
so a decode step is CUDA-graph capturable. A lookup's misses (a ``SlotFill``) fill inside the
gate_up launch as the bf16 path's do: their scale banks are gathered first (a few hundred bytes an
expert), then a program whose slot the plan fills (the pair's, or the slot's first pair's) copies
its rows' packed words from the host before it reads them, and copy programs beside the pairs'
move the planned experts' w2 words. Slots outside ``[0, S)`` contribute zero.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from moe_offload.kernels.decode_tiles import (column_tile, fill_w13_tile, pdl_wait, round_pairs, routed_pair, row_step,
                                              slot_program, store_weighted_row, w2_copy_program, weighted_pair)
from moe_offload.kernels.grouped_gemm import sum_over_k
from moe_offload.kernels.grouped_gemm_decode import (DECODE_MAX_PAIRS, DECODE_MAX_TOKENS, DecodeConfig, fill_args,
                                                      tiles_from_env)
from moe_offload.kernels.grouped_gemm_w4_banks import (GROUP, W4Bank, activation_consts, bank_args, check_w4_args,
                                                       kernel_consts)
from moe_offload.kernels.grouped_gemm_w4_tiles import (activate, bias_rows, channel_scaled, group_scale,
                                                       group_scales, group_values, packed_tile, packed_words,
                                                       store_down_w4_rows, swiglu_w4_rows,
                                                       MXFP4_ROW_ALIGN)
from moe_offload.kernels.triton_support import pdl_args, reg_cap
from moe_offload.slot_fill import SlotFill

__all__ = ["DECODE_MAX_PAIRS", "W4_DECODE_TILES", "decode_grouped_swiglu_w4", "decode_tiles"]


# One token's gate_up: 8 columns a program (more programs for a latency-bound read), a 256-weight
# step (every step a multiple of 32, so both formats' groups fit); the slot path's gate_up and down
# at 64 columns x 64 steps and 128 x 64; a fill's copy step in int32 words (512 bytes, as bf16's
# 256 items). From ``scripts/bench_grouped_gemm_w4.py --decode-sweep`` (H200, qwen3-30b's shapes:
# one token 36.9 -> 33.5 us a layer in nvfp4, eight 212 -> 197 us with the slot down alone). The
# per-token down capped at 64 registers: its words read before the PDL wait took it to 93 (one
# program of 16 warps an SM); at 64 two fit, spilling nothing, 1,584 instructions a thread against
# 1,528 (``kernel_sass.py --kernels down_token``, sm90, Triton 3.6), for hidden sizes past
# 132 x 16; at qwen3-30b's 2,048 it ties uncapped (H100: 403.8 / 401.1 tok/s). Those early reads: H100,
# resident batch 1, 396.1 -> 404.1 tok/s (``bench_decode.py``, docs/architecture.md).
W4_DECODE_TILES = DecodeConfig(gate_up_n=64, gate_up_k=64, slot_down_n=128, slot_down_k=64, pair_n=8, pair_k=256,
                               fill_k=128, down_regs=64)
# The per-token down in fewer, longer steps (1024 weights, 8 columns, 8 warps) where its reduction is
# read masked anyway: mxfp4, whose 16-byte groups load whole under a mask, or an intermediate size 256
# does not divide. Same sweep: gpt-oss's shapes (mxfp4, K 2880) 77.1 -> 47.8 us a layer, qwen3-30b's
# in mxfp4 31.2 -> 27.2; nvfp4 at qwen3-30b's (768 = 3 x 256, one 8-byte group a load only unmasked)
# keeps 256, where 512 took 36.3 us against 26.4. Uncapped: 104 registers, two 8-warp programs an SM,
# with or without its early reads (103 at gpt-oss' shapes; ``kernel_sass.py --formats mxfp4 --kernels
# down_token [--geometry gpt-oss]``, Triton 3.6).
W4_LONG_DOWN = dict(down_k=1024, down_n=8, down_warps=8, down_regs=0)
# "field=N,...": the tiles below with these DecodeConfig fields changed, for timing others in a whole
# decode step (e.g. "down_early=0,down_regs=0": the down as it was before it read ahead); unset in serving
TILES_ENV = "SLUICE_W4_DECODE_TILES"


def decode_tiles(fmt: str, inter: int) -> DecodeConfig:
    """The decode path's tiles for experts of ``fmt`` with intermediate size ``inter``, changed by
    ``SLUICE_W4_DECODE_TILES`` where it is set."""
    long_down = fmt == "mxfp4" or inter % W4_DECODE_TILES.down_k
    return tiles_from_env(W4_DECODE_TILES._replace(**W4_LONG_DOWN) if long_down else W4_DECODE_TILES, TILES_ENV)


@triton.jit
def fma_tile(x_ptr, x_ok, q_ptr, s_ptr, rows, row_ok, k0, k_len: tl.constexpr, stride_qn, stride_sn,
             BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, GROUP: tl.constexpr, E8M0: tl.constexpr,
             WHOLE_X: tl.constexpr = False):
    """``sum_k x[k] * w[rows, k]`` over the K tile at k0, per group: ``[R, BLOCK_K/G]`` fp32, each
    group's products summed (in one thread) before its scale multiplies (``x_ptr`` a contiguous
    row, read as zero unless ``x_ok``; the channel scale is the caller's). WHOLE_X: every element
    of the row is written (``x_ok`` ignored), so the loads need no mask of their own."""
    q, s = packed_tile(q_ptr, s_ptr, rows, row_ok, k0, k_len, stride_qn, stride_sn, BLOCK_K, GROUP,
                       k_len % BLOCK_K == 0)
    return group_sums(q, s, x_ptr, x_ok, k0, k_len, BLOCK_R, BLOCK_K, GROUP, E8M0, WHOLE_X)


@triton.jit
def group_sums(q, s, x_ptr, x_ok, k0, k_len: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
               GROUP: tl.constexpr, E8M0: tl.constexpr, WHOLE_X: tl.constexpr):
    """``fma_tile`` over a tile already read (``packed_tile``'s words ``q`` and group scales ``s``)."""
    ks = k0 + tl.arange(0, BLOCK_K // GROUP)[:, None] * GROUP + tl.arange(0, GROUP)[None, :]
    if WHOLE_X:  # a row written in full: no mask but k's own, none where the steps divide k_len
        x = row_step(x_ptr, ks, k_len, k_len % BLOCK_K == 0).to(tl.float32)
    else:  # x_ok folds into the bound: the interpreter mistypes a 0-d bool & a block bool
        x = tl.load(x_ptr + ks, mask=ks < tl.where(x_ok, k_len, 0), other=0.0).to(tl.float32)
    # a float32 row (the down's weighted acts) loads as vectors against k-ordered registers
    values = group_values(q, BLOCK_R, BLOCK_K, GROUP, x_ptr.dtype.element_ty == tl.float32)
    part = tl.sum(values * x[None, :, :], 2)
    return part * group_scale(s, E8M0)


# the routing's pointers (and the slot kernels' pair count) not specialised (see grouped_gemm._align_kernel)
@triton.jit(do_not_specialize_on_alignment=["ids_ptr", "slots_ptr"])
def _gate_up_pair_w4_kernel(x_ptr, q_ptr, s_ptr, c_ptr, b_ptr, ids_ptr, act_ptr, slots_ptr, weights_ptr, num_slots,
                            inter, stride_qs, stride_qn, stride_ss, stride_sn, stride_cs, num_bias, stride_b,
                            host13_ptr, host2_ptr, w2_ptr, plan_src_ptr, plan_dst_ptr, count_ptr, plan_len, stride_h13,
                            stride_h2, stride_w2s, TOP_K: tl.constexpr, HIDDEN: tl.constexpr, BLOCK_N: tl.constexpr,
                            BLOCK_K: tl.constexpr, GROUP: tl.constexpr, E8M0: tl.constexpr, CHANNEL: tl.constexpr,
                            BIAS: tl.constexpr, GPT_OSS: tl.constexpr, LIMIT: tl.constexpr, ALPHA: tl.constexpr,
                            PRECISION: tl.constexpr, FILL: tl.constexpr, PLAN: tl.constexpr, FILL_ROWS: tl.constexpr,
                            FILL_K: tl.constexpr, PDL: tl.constexpr):
    """One token's gate_up: program (j, n) computes act[j, n] for its own slot, the reduction over
    ``HIDDEN`` unrolled at compile time (every step's loads issue ahead of their arithmetic), and
    stores it in float32 times the pair's routing weight, zeros for a slot outside ``[0, S)``, so
    that the per-token down reads the row as it is (``_down_token_w4_kernel``, WEIGHTED). FILL: the
    lookup's planned experts' packed words are copied in as they are read (their scales were
    gathered before), as the bf16 path does."""
    pdl_wait(PDL)
    ALIGN: tl.constexpr = MXFP4_ROW_ALIGN if GROUP == 32 else 1  # a packed row, in words
    if w2_copy_program(TOP_K, host2_ptr, w2_ptr, plan_src_ptr, plan_dst_ptr, count_ptr, HIDDEN, inter // 8,
                       stride_h2, stride_w2s, FILL, FILL_ROWS, FILL_K, ALIGN):
        return
    pair, slot, skip, cols, col_ok = weighted_pair(slots_ptr, num_slots, act_ptr, inter, BLOCK_N)
    if skip:
        return
    if FILL:  # a row is HIDDEN / 8 words
        fill_w13_tile(host13_ptr, q_ptr, plan_src_ptr, plan_dst_ptr, plan_len, slot, tl.program_id(1) * BLOCK_N,
                      inter, HIDDEN // 8, stride_h13, stride_qs, stride_qn, PLAN, BLOCK_N, FILL_K, ALIGN)
    q_slot, s_slot = q_ptr + slot * stride_qs, s_ptr + slot * stride_ss
    acc_g = tl.zeros((BLOCK_N, BLOCK_K // GROUP), tl.float32)
    acc_u = tl.zeros((BLOCK_N, BLOCK_K // GROUP), tl.float32)
    for step in tl.static_range((HIDDEN + BLOCK_K - 1) // BLOCK_K):  # past the skip the row is read whole
        acc_g += fma_tile(x_ptr, True, q_slot, s_slot, cols, col_ok, step * BLOCK_K, HIDDEN, stride_qn, stride_sn,
                          BLOCK_N, BLOCK_K, GROUP, E8M0, True)
        acc_u += fma_tile(x_ptr, True, q_slot, s_slot, inter + cols, col_ok, step * BLOCK_K, HIDDEN, stride_qn,
                          stride_sn, BLOCK_N, BLOCK_K, GROUP, E8M0, True)
    gate = channel_scaled(tl.sum(acc_g, 1), c_ptr + slot * stride_cs, cols, col_ok, CHANNEL)
    up = channel_scaled(tl.sum(acc_u, 1), c_ptr + slot * stride_cs, inter + cols, col_ok, CHANNEL)
    gate += bias_rows(b_ptr, ids_ptr, pair, True, cols, col_ok, num_bias, stride_b, BIAS)
    up += bias_rows(b_ptr, ids_ptr, pair, True, inter + cols, col_ok, num_bias, stride_b, BIAS)
    store_weighted_row(act_ptr, weights_ptr, pair, inter, cols, col_ok, activate(gate, up, GPT_OSS, LIMIT, ALPHA))


@triton.jit(do_not_specialize=["num_pairs", "plan_len"],
            do_not_specialize_on_alignment=["ids_ptr", "slots_ptr"])
def _gate_up_slot_w4_kernel(x_ptr, q_ptr, s_ptr, c_ptr, b_ptr, ids_ptr, act_ptr, slots_ptr, num_pairs, top_k,
                            num_slots, hidden, inter, stride_xt, stride_xh, stride_qs, stride_qn, stride_ss, stride_sn,
                            stride_cs, num_bias, stride_b, host13_ptr, host2_ptr, w2_ptr, plan_src_ptr, plan_dst_ptr,
                            count_ptr, plan_len, stride_h13, stride_h2, stride_w2s, BLOCK_P: tl.constexpr,
                            BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP: tl.constexpr, E8M0: tl.constexpr,
                            CHANNEL: tl.constexpr, BIAS: tl.constexpr, GPT_OSS: tl.constexpr, LIMIT: tl.constexpr,
                            ALPHA: tl.constexpr, PRECISION: tl.constexpr, FILL: tl.constexpr, PLAN: tl.constexpr,
                            FILL_ROWS: tl.constexpr, FILL_K: tl.constexpr, PDL: tl.constexpr, EVEN_K: tl.constexpr):
    """act[p, n] for every pair p on this program's slot, 16 pairs a round (one read of the slot's
    w13 tile for all of them when they fit one round); FILL as the per-pair kernel, once a slot."""
    pdl_wait(PDL)
    ALIGN: tl.constexpr = MXFP4_ROW_ALIGN if GROUP == 32 else 1
    if w2_copy_program(num_pairs, host2_ptr, w2_ptr, plan_src_ptr, plan_dst_ptr, count_ptr, hidden, inter // 8,
                       stride_h2, stride_w2s, FILL, FILL_ROWS, FILL_K, ALIGN):
        return
    slot, on_slot, rank, count, cols, col_ok = slot_program(slots_ptr, num_pairs, num_slots, inter, BLOCK_P, BLOCK_N)
    if FILL:
        if count > 0:
            fill_w13_tile(host13_ptr, q_ptr, plan_src_ptr, plan_dst_ptr, plan_len, slot, tl.program_id(1) * BLOCK_N,
                          inter, hidden // 8, stride_h13, stride_qs, stride_qn, PLAN, BLOCK_N, FILL_K, ALIGN)
    for r0 in range(0, count, 16):  # none unless this program runs its slot
        pairs, live = round_pairs(on_slot, rank, count, r0, BLOCK_P)
        act = swiglu_w4_rows(x_ptr + (pairs // top_k) * stride_xt, live, tl.program_id(0), q_ptr + slot * stride_qs,
                             s_ptr + slot * stride_ss, c_ptr + slot * stride_cs, b_ptr, ids_ptr, cols, col_ok, hidden,
                             inter, num_bias, stride_xh, stride_qn, stride_sn, stride_b, 16, BLOCK_N, BLOCK_K, GROUP,
                             E8M0, CHANNEL, BIAS, GPT_OSS, LIMIT, ALPHA, PRECISION, EVEN_K)
        tl.store(act_ptr + pairs[:, None] * inter + cols[None, :], act.to(act_ptr.dtype.element_ty),
                 mask=live[:, None] & col_ok[None, :])


@triton.jit
def _down_token_reads(q_ptr, weights_ptr, slots_ptr, token, num_slots, cols, col_ok, stride_qs, stride_qn,
                      TOP_K: tl.constexpr, INTER: tl.constexpr, BLOCK_K: tl.constexpr, GROUP: tl.constexpr):
    """What the per-token down reads of the routing and the weights' packed words, as tuples: each
    pair's index, slot (``routed_pair``), whether it is in range and its routing weight; then each
    step's words of the pair's slot (``packed_words``), in (pair, step) order."""
    pairs, slots, oks, weights, words = (), (), (), (), ()
    for j in tl.static_range(TOP_K):
        pair, slot, ok, weight = routed_pair(slots_ptr, weights_ptr, token, j, num_slots, TOP_K)
        pairs, slots, oks, weights = pairs + (pair,), slots + (slot,), oks + (ok,), weights + (weight,)
        for step in tl.static_range((INTER + BLOCK_K - 1) // BLOCK_K):
            words = words + (packed_words(q_ptr + slot * stride_qs, cols, col_ok, step * BLOCK_K, INTER, stride_qn,
                                          BLOCK_K, GROUP, INTER % BLOCK_K == 0),)
    return pairs, slots, oks, weights, words


@triton.jit(do_not_specialize_on_alignment=["ids_ptr", "weights_ptr", "slots_ptr"])
def _down_token_w4_kernel(act_ptr, q_ptr, s_ptr, c_ptr, b_ptr, ids_ptr, weights_ptr, slots_ptr, out_ptr, num_slots,
                          hidden, stride_qs, stride_qn, stride_ss, stride_sn, stride_cs, num_bias, stride_b,
                          TOP_K: tl.constexpr, INTER: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                          GROUP: tl.constexpr, E8M0: tl.constexpr, CHANNEL: tl.constexpr, BIAS: tl.constexpr,
                          PRECISION: tl.constexpr, WEIGHTED: tl.constexpr, EARLY: tl.constexpr, PDL: tl.constexpr):
    """out[t, h] = sum_j weight[t, j] * (act[t*k + j] . w2[slot_j, h] + bias[id_j, h]), one fp32
    accumulator, both loops unrolled. A slot outside ``[0, S)`` reads slot 0 with its act row
    masked to zero (it was never written) and weighs 0. WEIGHTED: one token's rows, float32,
    weighted and zeros where unrouted by ``_gate_up_pair_w4_kernel``, are read as they are, unmasked
    (weighing them here, each thread loads, converts and weighs its own copy of every act value it
    multiplies, one a weight: ``kernel_sass.py --formats nvfp4 --kernels down_token --ops 8``).

    EARLY (the gate_up before it filled no slot): the routing and the packed words of every slot
    it names are read before the wait, while the gate_up still runs, as the fp8 down does
    (``grouped_gemm_decode_fp8._down_fp8_kernel``); the act rows, and the scales and biases (a
    few KB; read early as well they took the kernel from 64 registers a thread to 86, one program
    an SM instead of two: ``kernel_sass.py --kernels down_token``), after it."""
    token = tl.program_id(0).to(tl.int64)
    cols, col_ok = column_tile(hidden, BLOCK_N)
    if EARLY:
        early = _down_token_reads(q_ptr, weights_ptr, slots_ptr, token, num_slots, cols, col_ok, stride_qs, stride_qn,
                                  TOP_K, INTER, BLOCK_K, GROUP)
    pdl_wait(PDL)
    if not EARLY:
        early = _down_token_reads(q_ptr, weights_ptr, slots_ptr, token, num_slots, cols, col_ok, stride_qs, stride_qn,
                                  TOP_K, INTER, BLOCK_K, GROUP)
    pairs, slots, oks, weights, words = early
    STEPS: tl.constexpr = (INTER + BLOCK_K - 1) // BLOCK_K
    acc = tl.zeros((BLOCK_N, BLOCK_K // GROUP), tl.float32)
    bias = tl.zeros((BLOCK_N,), tl.float32)
    for j in tl.static_range(TOP_K):
        scale = channel_scaled(tl.full((BLOCK_N,), 1.0, tl.float32), c_ptr + slots[j] * stride_cs, cols, col_ok,
                               CHANNEL)
        if not WEIGHTED:
            scale = scale * weights[j]
        for step in tl.static_range(STEPS):
            s = group_scales(s_ptr + slots[j] * stride_ss, cols, col_ok, step * BLOCK_K, INTER, stride_sn, BLOCK_K,
                             GROUP, INTER % BLOCK_K == 0)
            part = group_sums(words[j * STEPS + step], s, act_ptr + pairs[j] * INTER, oks[j], step * BLOCK_K, INTER,
                              BLOCK_N, BLOCK_K, GROUP, E8M0, WEIGHTED)
            acc += part * scale[:, None]
        bias += weights[j] * bias_rows(b_ptr, ids_ptr, pairs[j], oks[j], cols, col_ok, num_bias, stride_b, BIAS)
    out = tl.sum(acc, 1) + bias
    tl.store(out_ptr + token * hidden + cols, out.to(out_ptr.dtype.element_ty), mask=col_ok)


@triton.jit(do_not_specialize=["num_pairs"],
            do_not_specialize_on_alignment=["ids_ptr", "weights_ptr", "slots_ptr"])
def _down_slot_w4_kernel(act_ptr, q_ptr, s_ptr, c_ptr, b_ptr, ids_ptr, weights_ptr, slots_ptr, pair_out_ptr,
                         num_pairs, num_slots, hidden, inter, stride_qs, stride_qn, stride_ss, stride_sn, stride_cs,
                         num_bias, stride_b, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                         GROUP: tl.constexpr, E8M0: tl.constexpr, CHANNEL: tl.constexpr, BIAS: tl.constexpr,
                         PRECISION: tl.constexpr, PDL: tl.constexpr, EVEN_K: tl.constexpr):
    """pair_out[p, h] = weight[p] * (act[p] . w2[s, h] + bias[id_p, h]) for every pair p on slot s."""
    pdl_wait(PDL)
    slot, on_slot, rank, count, cols, col_ok = slot_program(slots_ptr, num_pairs, num_slots, hidden, BLOCK_P, BLOCK_N)
    for r0 in range(0, count, 16):  # none unless this program runs its slot
        pairs, live = round_pairs(on_slot, rank, count, r0, BLOCK_P)
        store_down_w4_rows(pair_out_ptr, weights_ptr, pairs, act_ptr + pairs * inter, live, tl.program_id(0),
                           q_ptr + slot * stride_qs, s_ptr + slot * stride_ss, c_ptr + slot * stride_cs, b_ptr,
                           ids_ptr, cols, col_ok, hidden, inter, num_bias, stride_qn, stride_sn, stride_b, 16, BLOCK_N,
                           BLOCK_K, GROUP, E8M0, CHANNEL, BIAS, PRECISION, EVEN_K)


def decode_grouped_swiglu_w4(hidden: torch.Tensor, weights: torch.Tensor, slots: torch.Tensor, w13: W4Bank,
                             w2: W4Bank, *, fmt: str, out_dtype: torch.dtype | None = None,
                             config: DecodeConfig | None = None, bias_ids: torch.Tensor | None = None,
                             activation: str = "swiglu", fill: SlotFill | None = None) -> torch.Tensor:
    """The decode path: ``[T, H]`` in ``out_dtype`` (default hidden's) for at most
    ``DECODE_MAX_PAIRS`` pairs, two launches (three past ``DECODE_MAX_TOKENS`` tokens). With a
    ``fill`` the planned experts' scales are gathered first, their packed weights copied in by the
    gate_up launch."""
    check_w4_args(hidden, weights, slots, w13, w2, fmt, activation, out_dtype, bias_ids)
    num_tokens, top_k = slots.shape
    if num_tokens * top_k > DECODE_MAX_PAIRS:
        raise ValueError(f"the decode path takes at most {DECODE_MAX_PAIRS} (token, slot) pairs; "
                         f"got {num_tokens} x {top_k}")
    cfg = config or decode_tiles(fmt, w13.packed.shape[1] // 2)
    _check_config(cfg, fmt)
    out = torch.empty(num_tokens, hidden.shape[1], dtype=out_dtype or hidden.dtype, device=hidden.device)
    if num_tokens == 0:
        return out
    slots, weights = slots.contiguous(), weights.contiguous()
    ids = slots if bias_ids is None else bias_ids.contiguous()
    consts = kernel_consts(fmt, hidden.dtype)
    if fill is not None:
        fill.check_quantized(w13.packed, w2.packed, fmt)
        fill.gather_scales(_scale_banks(w13, w2))
    act, weighted = _gate_up(hidden, weights, slots, ids, w13, w2, cfg, consts, activation, fill)
    if num_tokens <= DECODE_MAX_TOKENS:
        _down_per_token(act, weights, slots, ids, w2, out, cfg, consts, weighted, early=fill is None)
    else:
        _down_per_slot(act, weights, slots, ids, w2, out, cfg, consts)
    return out


def _check_config(cfg: DecodeConfig, fmt: str) -> None:
    steps = (cfg.gate_up_k, cfg.down_k, cfg.slot_down_k, cfg.pair_k)
    if any(k % GROUP[fmt] or k < 32 or k & (k - 1) for k in steps) or min(cfg.gate_up_n, cfg.slot_down_n) < 16:
        raise ValueError(f"decode tiles {cfg}: reduction steps must be powers of two, multiples of {fmt}'s group "
                         f"{GROUP[fmt]} and >= 32, the per-slot kernels' columns >= 16 (tl.dot)")


def _scale_banks(bank13: W4Bank, bank2: W4Bank) -> tuple[torch.Tensor, ...]:
    """The slots' scale banks in ``ExpertScales.tensors()`` order (channel scales as ``[S, N, 1]``)."""
    banks = (bank13.scale, bank2.scale)
    if bank13.channel_scale is not None:
        banks += (bank13.channel_scale.unsqueeze(-1), bank2.channel_scale.unsqueeze(-1))
    return banks


def _words(bank: torch.Tensor) -> torch.Tensor:
    return bank.view(torch.int32)


def _block_p(num_pairs: int) -> int:
    return max(16, triton.next_power_of_2(num_pairs))


def _gate_up(hidden: torch.Tensor, weights: torch.Tensor, slots: torch.Tensor, ids: torch.Tensor, bank: W4Bank,
             bank2: W4Bank, cfg: DecodeConfig, consts: dict, activation: str,
             fill: SlotFill | None) -> tuple[torch.Tensor, bool]:
    """``act [T*k, I]`` and whether its rows are weighted: one token's are, in float32, zeros for
    out-of-range slots; more tokens' are in hidden's dtype, rows of out-of-range slots left
    unwritten (the downs never read them)."""
    num_tokens, top_k = slots.shape
    num_slots, dim, inter = bank.packed.shape[0], hidden.shape[1], bank.packed.shape[1] // 2
    one_row = num_tokens == 1 and hidden.stride(1) == 1
    act = torch.empty(num_tokens * top_k, inter, dtype=torch.float32 if one_row else hidden.dtype,
                      device=hidden.device)
    (q, s, c, b), strides, bank_consts = bank_args(bank)
    consts = {**consts, **bank_consts, **activation_consts(activation), **pdl_args(hidden)}
    if one_row:
        grid_n = triton.cdiv(inter, cfg.pair_n)
        copy_args, fill_consts, copy_rows = fill_args(fill, bank.packed, bank2.packed, cfg, grid_n, _words)
        _gate_up_pair_w4_kernel[(top_k + copy_rows, grid_n)](
            hidden, q, s, c, b, ids, act, slots, weights, num_slots, inter, *strides, *copy_args, TOP_K=top_k,
            HIDDEN=dim, BLOCK_N=cfg.pair_n, BLOCK_K=cfg.pair_k, **consts, **fill_consts, num_warps=cfg.pair_warps,
            **reg_cap(cfg.pair_regs))
        return act, True
    grid_n = triton.cdiv(inter, cfg.gate_up_n)
    copy_args, fill_consts, copy_rows = fill_args(fill, bank.packed, bank2.packed, cfg, grid_n, _words)
    _gate_up_slot_w4_kernel[(num_tokens * top_k + copy_rows, grid_n)](
        hidden, q, s, c, b, ids, act, slots, num_tokens * top_k, top_k, num_slots, dim, inter, hidden.stride(0),
        hidden.stride(1), *strides, *copy_args, BLOCK_P=_block_p(num_tokens * top_k), BLOCK_N=cfg.gate_up_n,
        BLOCK_K=cfg.gate_up_k, **consts, **fill_consts, EVEN_K=dim % cfg.gate_up_k == 0, num_warps=cfg.num_warps,
        num_stages=cfg.num_stages)
    return act, False


def _down_per_token(act: torch.Tensor, weights: torch.Tensor, slots: torch.Tensor, ids: torch.Tensor, bank: W4Bank,
                    out: torch.Tensor, cfg: DecodeConfig, consts: dict, weighted: bool, early: bool) -> None:
    num_tokens, top_k = slots.shape
    num_slots, dim = bank.packed.shape[:2]
    (q, s, c, b), strides, bank_consts = bank_args(bank)
    _down_token_w4_kernel[(num_tokens, triton.cdiv(dim, cfg.down_n))](
        act, q, s, c, b, ids, weights, slots, out, num_slots, dim, *strides, TOP_K=top_k, INTER=act.shape[1],
        BLOCK_N=cfg.down_n, BLOCK_K=cfg.down_k, **consts, **bank_consts, WEIGHTED=weighted,
        EARLY=early and bool(cfg.down_early), num_warps=cfg.down_warps, **reg_cap(cfg.down_regs), **pdl_args(act))


def _down_per_slot(act: torch.Tensor, weights: torch.Tensor, slots: torch.Tensor, ids: torch.Tensor, bank: W4Bank,
                   out: torch.Tensor, cfg: DecodeConfig, consts: dict) -> None:
    num_tokens, top_k = slots.shape
    num_slots, dim = bank.packed.shape[:2]
    num_pairs = num_tokens * top_k
    pair_out = torch.empty(num_pairs, dim, dtype=act.dtype, device=out.device)
    (q, s, c, b), strides, bank_consts = bank_args(bank)
    _down_slot_w4_kernel[(num_pairs, triton.cdiv(dim, cfg.slot_down_n))](
        act, q, s, c, b, ids, weights, slots, pair_out, num_pairs, num_slots, dim, act.shape[1], *strides,
        BLOCK_P=_block_p(num_pairs), BLOCK_N=cfg.slot_down_n, BLOCK_K=cfg.slot_down_k, **consts, **bank_consts,
        EVEN_K=act.shape[1] % cfg.slot_down_k == 0, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        **pdl_args(act))
    sum_over_k(pair_out, slots.reshape(-1), out, num_slots, top_k)
