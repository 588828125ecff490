"""The grouped SwiGLU expert GEMM for decode batches (up to DECODE_MAX_PAIRS (token, slot)
pairs): no align kernel, no sort.

The general path (``grouped_gemm``) groups the T*k pairs by slot with an align kernel, then runs
gate_up, down, and a sum of each token's k outputs: four launches. With few pairs a program can
find its slot's pairs itself, and with a few tokens the sum fits in the down projection:

```
 gate_up    grid (T*k, I / BLOCK_N)  pair p runs only if it is its slot's first pair: one program
                                     reads the slot's w13 tile once for every pair routed to it
                                     (its pairs compacted into 16-row tl.dots; the other
                                     programs exit at once); one token (T = 1, k distinct
                                     slots): every pair its own program, float32 multiply-adds
                                     with the reduction unrolled, as the per-token down
 T <= DECODE_MAX_TOKENS: 2 launches
 down       grid (T, H / BLOCK_N)    token t: out[t] = sum_j (weight[t, j] * act[t, j]) . w2[slot_j]
                                     in one float32 accumulator (multiply-adds, both loops
                                     unrolled), rounded once: the combine is folded into the down
                                     projection
 larger: 3 launches
 down       grid (T*k, H / BLOCK_N)  as gate_up (a slot's first pair runs all its pairs), each row
                                     times its combine weight
 sum over k                          grouped_gemm.sum_over_k
```

With a fill (``SlotFill``: the experts an expert-cache lookup just admitted, still in host memory)
the gate_up launch also moves them: a program whose slot is in the lookup's plan first copies its
own gate and up rows from the mapped host bank into the slot, then computes from the slot as any
other; copy programs after the pairs' (grid rows ``T*k`` on) move the planned experts' w2. So the
hits compute while the misses cross PCIe, in one launch, and the downs read every slot from HBM.

The per-token down reads a slot's w2 once per token that uses it, so it pays for slots that
several tokens share; DECODE_MAX_TOKENS keeps it to batches where few do. Slots outside ``[0, N)``
contribute zero, as on the general path. gpt-oss's experts add bias rows by expert id and take the
clamped activation (the epilogue pieces of ``grouped_gemm_w4_tiles``). Callers go through
``moe_offload.grouped.grouped_swiglu``, which checks the arguments and keeps the eager twin (``grouped_swiglu_eager``).
"""
from __future__ import annotations

import functools
import os
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from moe_offload.slot_fill import SlotFill
from moe_offload.kernels.decode_tiles import (column_tile, fill_w13_tile, pdl_wait, round_pairs, routed_pair,
                                              row_step, slot_program, store_weighted, store_weighted_row, tile_step,
                                              w2_copy_program, weighted_pair)
from moe_offload.kernels.grouped_gemm import BiasArgs, bias_args_of, down_rows, gate_up_rows, sum_over_k
from moe_offload.kernels.grouped_gemm_w4_banks import activation_consts
from moe_offload.kernels.grouped_gemm_w4_tiles import bias_rows, biased_activation
from moe_offload.kernels.triton_support import pdl_args, reg_cap

# Batches of up to this many pairs take this path: every program scans all pairs' slots, and
# compacts its slot's pairs with a [16, T*k] selection.
DECODE_MAX_PAIRS = 64
# Up to this many tokens the down projection also sums over k. A duplicate (two tokens on one
# slot) costs one more read of w2 (a third of an expert); uniform routing of 4 tokens x top-8 over
# 128 experts expects about 3.7 of them (~12 MB at qwen3-30b's shapes), about what a launch costs.
DECODE_MAX_TOKENS = 4


class DecodeConfig(NamedTuple):
    """Tile sizes: gate_up columns (each of gate and up) and reduction step, the per-token down's
    columns and reduction step, warps and stages (gate_up and the per-slot down), the per-slot
    down's columns and step, the per-token down's warps, one token's gate_up (columns, step,
    warps), and a fill's copy step (columns) and w2 rows per copy program; one token's gate_up and
    the per-token down may cap their registers (``pair_regs``, ``down_regs``: ptxas' maxnreg; 0:
    the compiler's choice), which decides how many of their programs an SM holds at once. The defaults are bf16's; the fp8 and 4-bit decode
    paths run the same plan from their own (``FP8_DECODE_TILES``, ``W4_DECODE_TILES``). The fp8 and
    4-bit per-token downs read their weights before their PDL wait unless ``down_early`` is 0 (a
    step without a fill; ``grouped_gemm_decode_fp8._down_fp8_kernel``)."""

    gate_up_n: int = 32
    gate_up_k: int = 128
    down_n: int = 16
    down_k: int = 256
    num_warps: int = 4
    num_stages: int = 3
    slot_down_n: int = 128
    slot_down_k: int = 128
    down_warps: int = 16
    pair_n: int = 16
    pair_k: int = 64
    pair_warps: int = 4
    fill_k: int = 256
    fill_rows: int = 16
    pair_regs: int = 0
    down_early: int = 1
    down_regs: int = 0


def tiles_from_env(base: DecodeConfig, env: str) -> DecodeConfig:
    """``base`` with the fields that variable ``env`` sets ("field=N,...", e.g. "pair_n=32,pair_warps=4"):
    how a whole decode step (``bench_decode.py``) times other tiles; unset in serving."""
    return _tiles_from(base, env, os.environ.get(env, ""))


@functools.cache
def _tiles_from(base: DecodeConfig, env: str, text: str) -> DecodeConfig:
    changes = {}
    for item in filter(None, text.replace(" ", "").split(",")):
        field, _, value = item.partition("=")
        if field not in DecodeConfig._fields or not value.isdigit():
            raise ValueError(f"{env}: {item!r} is not FIELD=N with FIELD one of {', '.join(DecodeConfig._fields)}")
        changes[field] = int(value)
    return base._replace(**changes)


# the pair count, the fill plan's length and the routing's pointers not specialised (see grouped_gemm._align_kernel)
@triton.jit(do_not_specialize=["num_pairs", "plan_len"],
            do_not_specialize_on_alignment=["slots_ptr", "ids_ptr"])
def _decode_gate_up_kernel(x_ptr, w13_ptr, act_ptr, slots_ptr, num_pairs, top_k, num_slots, hidden, inter,
                           stride_xt, stride_xh, stride_ws, stride_wn, stride_wh,
                           host13_ptr, host2_ptr, w2_ptr, plan_src_ptr, plan_dst_ptr, count_ptr, plan_len, stride_h13,
                           stride_h2, stride_w2s, b13_ptr, ids_ptr, num_bias,
                           BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                           PRECISION: tl.constexpr, FILL: tl.constexpr, PLAN: tl.constexpr, FILL_ROWS: tl.constexpr,
                           FILL_K: tl.constexpr, BIAS: tl.constexpr, GPT_OSS: tl.constexpr, LIMIT: tl.constexpr,
                           ALPHA: tl.constexpr, PDL: tl.constexpr):
    """act[p, n] = silu(x[p // k] . w13[s, n]) * (x[p // k] . w13[s, I + n]) for every pair p on slot s
    (gpt-oss: each dot plus its bias row at the pair's expert id, the clamped activation).

    FILL: the lookup's planned experts are copied in as they are read (``SlotFill``)."""
    pdl_wait(PDL)
    if w2_copy_program(num_pairs, host2_ptr, w2_ptr, plan_src_ptr, plan_dst_ptr, count_ptr, hidden, inter, stride_h2,
                       stride_w2s, FILL, FILL_ROWS, FILL_K):
        return
    slot, on_slot, rank, count, cols, col_ok = slot_program(slots_ptr, num_pairs, num_slots, inter, BLOCK_P, BLOCK_N)
    if count == 0:
        return
    if FILL:
        fill_w13_tile(host13_ptr, w13_ptr, plan_src_ptr, plan_dst_ptr, plan_len, slot, tl.program_id(1) * BLOCK_N,
                      inter, hidden, stride_h13, stride_ws, stride_wn, PLAN, BLOCK_N, FILL_K)
    g_ptrs = w13_ptr + slot * stride_ws + cols[None, :].to(tl.int64) * stride_wn
    for r0 in range(0, count, 16):
        pairs, live = round_pairs(on_slot, rank, count, r0, BLOCK_P)
        acc_g, acc_u = gate_up_rows(x_ptr + (pairs // top_k)[:, None] * stride_xt, live, g_ptrs,
                                    g_ptrs + inter * stride_wn, col_ok, hidden, stride_xh, stride_wh, 16, BLOCK_N,
                                    BLOCK_K, PRECISION)
        act = biased_activation(acc_g, acc_u, b13_ptr, ids_ptr, pairs[:, None], live[:, None], cols[None, :],
                                col_ok[None, :], num_bias, inter, BIAS, GPT_OSS, LIMIT, ALPHA)
        tl.store(act_ptr + pairs[:, None] * inter + cols[None, :], act.to(act_ptr.dtype.element_ty),
                 mask=live[:, None] & col_ok[None, :])


@triton.jit(do_not_specialize_on_alignment=["slots_ptr", "ids_ptr"])
def _decode_gate_up_pair_kernel(x_ptr, w13_ptr, act_ptr, slots_ptr, weights_ptr, num_slots, inter, stride_ws,
                                stride_wn, stride_wh, host13_ptr, host2_ptr, w2_ptr, plan_src_ptr, plan_dst_ptr,
                                count_ptr, plan_len, stride_h13, stride_h2, stride_w2s, b13_ptr, ids_ptr, num_bias,
                                TOP_K: tl.constexpr, HIDDEN: tl.constexpr,
                                BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN: tl.constexpr,
                                FILL: tl.constexpr, PLAN: tl.constexpr, FILL_ROWS: tl.constexpr,
                                FILL_K: tl.constexpr, BIAS: tl.constexpr, GPT_OSS: tl.constexpr, LIMIT: tl.constexpr,
                                ALPHA: tl.constexpr, PDL: tl.constexpr):
    """One token's gate_up: program (j, n) computes act[j, n] for its own slot, as the per-token
    down does (the reduction over ``HIDDEN`` unrolled at compile time, float32 multiply-adds, no
    tl.dot), and stores it in float32 times the pair's routing weight, zeros for a slot outside
    ``[0, N)``, so that the down reads the row as it is (``_decode_down_kernel``, WEIGHTED). EVEN:
    the tiles divide ``HIDDEN`` and ``inter``. FILL: the lookup's planned experts are copied in as
    they are read (``SlotFill``)."""
    pdl_wait(PDL)
    if w2_copy_program(TOP_K, host2_ptr, w2_ptr, plan_src_ptr, plan_dst_ptr, count_ptr, HIDDEN, inter, stride_h2,
                       stride_w2s, FILL, FILL_ROWS, FILL_K):
        return
    pair, slot, skip, cols, col_ok = weighted_pair(slots_ptr, num_slots, act_ptr, inter, BLOCK_N)
    if skip:
        return
    if FILL:  # the row length as a runtime value (w13 is contiguous: stride_wn == HIDDEN), as measured
        fill_w13_tile(host13_ptr, w13_ptr, plan_src_ptr, plan_dst_ptr, plan_len, slot, tl.program_id(1) * BLOCK_N,
                      inter, stride_wn, stride_h13, stride_ws, stride_wn, PLAN, BLOCK_N, FILL_K)
    g_rows = w13_ptr + slot * stride_ws + cols[None, :].to(tl.int64) * stride_wn
    u_rows = g_rows + inter * stride_wn
    x_row = x_ptr + (pair // TOP_K) * HIDDEN
    acc_g = tl.zeros((BLOCK_K, BLOCK_N), tl.float32)
    acc_u = tl.zeros((BLOCK_K, BLOCK_N), tl.float32)
    for step in tl.static_range((HIDDEN + BLOCK_K - 1) // BLOCK_K):
        ks = step * BLOCK_K + tl.arange(0, BLOCK_K)
        x = row_step(x_row, ks, HIDDEN, EVEN).to(tl.float32)[:, None]
        acc_g += x * tile_step(g_rows, ks, col_ok, HIDDEN, stride_wh, EVEN).to(tl.float32)
        acc_u += x * tile_step(u_rows, ks, col_ok, HIDDEN, stride_wh, EVEN).to(tl.float32)
    # the pair as a vector: bias_rows broadcasts ids against the columns
    act = biased_activation(tl.sum(acc_g, 0), tl.sum(acc_u, 0), b13_ptr, ids_ptr, pair + 0 * cols, col_ok, cols,
                            col_ok, num_bias, inter, BIAS, GPT_OSS, LIMIT, ALPHA)
    store_weighted_row(act_ptr, weights_ptr, pair, inter, cols, col_ok, act)


@triton.jit(do_not_specialize_on_alignment=["weights_ptr", "slots_ptr", "ids_ptr"])
def _decode_down_kernel(act_ptr, w2_ptr, weights_ptr, slots_ptr, out_ptr, num_slots, hidden,
                        stride_ws, stride_wh, stride_wi, b2_ptr, ids_ptr, num_bias, TOP_K: tl.constexpr,
                        INTER: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN: tl.constexpr,
                        BIAS: tl.constexpr, WEIGHTED: tl.constexpr, PDL: tl.constexpr):
    """out[t, h] = sum_j (weight[t, j] * act[t*k + j]) . w2[slot_j, h], one float32 accumulator.

    Both loops (the k slots, the reduction over ``INTER``) are unrolled at compile time, so no
    load's address waits on another load and the compiler issues the weight loads of many steps
    ahead of their multiply-adds: at batch 1 the kernel is bound by how many bytes are in flight,
    not by arithmetic (a runtime loop, one step's load at a time, ran at about half the speed).
    The products are float32 multiply-adds into a ``[BLOCK_K, BLOCK_N]`` accumulator summed once
    at the end (a 16-row tl.dot with 15 dead rows was no faster). A slot outside ``[0, N)`` reads
    slot 0 and weighs 0 (its act row, never written, is replaced, not multiplied); WEIGHTED: one
    token's rows, in float32, weighted and zeros where unrouted by ``_decode_gate_up_pair_kernel``,
    are read as they are (a thread converts, weighs and masks its own copy of each act value it
    multiplies, as many as its weights: compiled for sm90 1,472 instructions a thread weighing them
    here, 776 not; ``scripts/kernel_sass.py --ops``); EVEN: the tiles divide ``INTER`` and
    ``hidden``, so no load is masked and every load is vectorised."""
    pdl_wait(PDL)
    token = tl.program_id(0).to(tl.int64)
    cols, col_ok = column_tile(hidden, BLOCK_N)
    acc = tl.zeros((BLOCK_K, BLOCK_N), tl.float32)
    biased = tl.zeros((BLOCK_N,), tl.float32)  # gpt-oss: sum_j weight_j b2[id_j]
    for j in tl.static_range(TOP_K):
        pair, slot, ok, weight = routed_pair(slots_ptr, weights_ptr, token, j, num_slots, TOP_K)
        if BIAS:
            biased += weight * bias_rows(b2_ptr, ids_ptr, pair + 0 * cols, col_ok, cols, col_ok, num_bias, hidden,
                                         BIAS)
        w_row = w2_ptr + slot * stride_ws + cols[None, :].to(tl.int64) * stride_wh
        a_row = act_ptr + pair * INTER
        for step in tl.static_range((INTER + BLOCK_K - 1) // BLOCK_K):
            ks = step * BLOCK_K + tl.arange(0, BLOCK_K)
            a = row_step(a_row, ks, INTER, EVEN).to(tl.float32)
            if not WEIGHTED:
                a = tl.where(ok, a * weight, 0.0)
            acc += a[:, None] * tile_step(w_row, ks, col_ok, INTER, stride_wi, EVEN).to(tl.float32)
    tl.store(out_ptr + token * hidden + cols, (tl.sum(acc, 0) + biased).to(out_ptr.dtype.element_ty), mask=col_ok)


@triton.jit(do_not_specialize=["num_pairs"],
            do_not_specialize_on_alignment=["weights_ptr", "slots_ptr", "ids_ptr"])
def _decode_slot_down_kernel(act_ptr, w2_ptr, weights_ptr, slots_ptr, pair_out_ptr, num_pairs, num_slots, hidden,
                             inter, stride_ws, stride_wh, stride_wi, b2_ptr, ids_ptr, num_bias, BLOCK_P: tl.constexpr,
                             BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr,
                             BIAS: tl.constexpr, PDL: tl.constexpr):
    """pair_out[p, h] = weight[p] * (act[p] . w2[s, h]) for every pair p on slot s."""
    pdl_wait(PDL)
    slot, on_slot, rank, count, cols, col_ok = slot_program(slots_ptr, num_pairs, num_slots, hidden, BLOCK_P, BLOCK_N)
    w_ptrs = w2_ptr + slot * stride_ws + cols[None, :].to(tl.int64) * stride_wh
    for r0 in range(0, count, 16):  # none unless this program runs its slot
        pairs, live = round_pairs(on_slot, rank, count, r0, BLOCK_P)
        acc = down_rows(act_ptr + pairs[:, None] * inter, live[:, None], w_ptrs, col_ok, inter, stride_wi,
                        16, BLOCK_N, BLOCK_K, PRECISION)
        if BIAS:
            acc += bias_rows(b2_ptr, ids_ptr, pairs[:, None], live[:, None], cols[None, :], col_ok[None, :],
                             num_bias, hidden, BIAS)
        store_weighted(pair_out_ptr, acc, weights_ptr, pairs, live, cols, col_ok, hidden)


def decode_grouped_swiglu(hidden: torch.Tensor, weights: torch.Tensor, slots: torch.Tensor, w13: torch.Tensor,
                          w2: torch.Tensor, config: DecodeConfig | None = None,
                          out_dtype: torch.dtype | None = None, fill: SlotFill | None = None,
                          w13_bias: torch.Tensor | None = None, w2_bias: torch.Tensor | None = None,
                          bias_ids: torch.Tensor | None = None, activation: str = "silu") -> torch.Tensor:
    """The decode path of ``grouped_swiglu`` (float banks, at most DECODE_MAX_PAIRS pairs), the
    output in ``out_dtype`` (default hidden's; the per-slot path's k rows stay in hidden's dtype
    until their sum, as on the align path); arguments are already checked, ``fill``'s here.

    ``fill``: the gate_up launch copies the planned experts into their slots as it runs (module
    docstring); the pools must be contiguous. gpt-oss's biases (by ``bias_ids``) and activation as
    in ``grouped_swiglu``."""
    num_tokens, top_k = slots.shape
    if num_tokens * top_k > DECODE_MAX_PAIRS:
        raise ValueError(f"the decode path takes at most {DECODE_MAX_PAIRS} (token, slot) pairs; "
                         f"got {num_tokens} x {top_k}")
    if fill is not None:
        _check_fill(fill, w13, w2)
    cfg = config or DecodeConfig()
    out = torch.empty(num_tokens, hidden.shape[1], dtype=out_dtype or hidden.dtype, device=hidden.device)
    if num_tokens == 0:  # nothing routed: a lookup planned nothing
        return out
    slots, weights = slots.contiguous(), weights.contiguous()
    bias = bias_args_of(w13, w2, slots, w13_bias, w2_bias, bias_ids)
    act, weighted = _gate_up(hidden, weights, slots, w13, w2, cfg, fill, bias, activation)
    if num_tokens <= DECODE_MAX_TOKENS:
        _down_per_token(act, weights, slots, w2, out, cfg, bias, weighted)
    else:
        _down_per_slot(act, weights, slots, w2, out, cfg, bias)
    return out


def _check_fill(fill: SlotFill, w13: torch.Tensor, w2: torch.Tensor) -> None:
    plan = fill.plan
    if fill.host_scales is not None:
        raise ValueError("the decode path fills float banks; fp8 banks are gathered (gather_missing)")
    if plan.src_id.shape != plan.dst_slot.shape or plan.src_id.dim() != 1 or plan.count.numel() != 1:
        raise ValueError("a fill's plan must be src_id and dst_slot [P] and count [1]")
    for host, pool in ((fill.host_w13, w13), (fill.host_w2, w2)):
        if host.dim() != 3 or host.shape[1:] != pool.shape[1:] or host.dtype != pool.dtype:
            raise ValueError(f"host bank {tuple(host.shape)} {host.dtype} does not match the slots "
                             f"{tuple(pool.shape)} {pool.dtype}")
        if not (host[0].is_contiguous() and pool[0].is_contiguous()):
            raise ValueError("a fill copies rows by offset: an expert's rows must be contiguous in the host banks "
                             "and slot pools")


def _precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"


def _block_p(num_pairs: int) -> int:
    return max(16, triton.next_power_of_2(num_pairs))


def fill_args(fill: SlotFill | None, w13: torch.Tensor, w2: torch.Tensor, cfg: DecodeConfig, grid_n: int,
              view=lambda bank: bank) -> tuple[tuple, dict, int]:
    """The gate_up kernels' fill arguments (placeholders without a fill: FILL is then off), their
    constexprs, and how many rows of copy programs the grid gets beside the pairs' (enough for
    ``fill_rows`` w2 rows each). ``view``: the banks as the kernel copies them (4-bit: int32 words)."""
    if fill is None:
        return (w13, w2, w2, w13, w13, w13, 0, 0, 0, 0), dict(FILL=False, PLAN=1, FILL_ROWS=1, FILL_K=1), 0
    src, dst, count = fill.plan
    host13, host2, w2 = view(fill.host_w13), view(fill.host_w2), view(w2)
    args = (host13, host2, w2, src, dst, count, src.numel(), host13.stride(0), host2.stride(0), w2.stride(0))
    consts = dict(FILL=True, PLAN=triton.next_power_of_2(max(src.numel(), 1)), FILL_ROWS=cfg.fill_rows,
                  FILL_K=cfg.fill_k)
    return args, consts, triton.cdiv(triton.cdiv(w2.shape[1], cfg.fill_rows), grid_n)


def _gate_up(hidden: torch.Tensor, weights: torch.Tensor, slots: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
             cfg: DecodeConfig, fill: SlotFill | None, bias: BiasArgs, activation: str) -> tuple[torch.Tensor, bool]:
    """``act [T*k, I]`` and whether its rows are weighted: one (contiguous) token's are, in float32,
    zeros for out-of-range slots; more tokens' are in hidden's dtype, rows of out-of-range slots left
    unwritten (the downs never read them)."""
    num_tokens, top_k = slots.shape
    num_slots, dim, inter = w13.shape[0], hidden.shape[1], w13.shape[1] // 2
    one_row = num_tokens == 1 and hidden.is_contiguous()
    act = torch.empty(num_tokens * top_k, inter, dtype=torch.float32 if one_row else hidden.dtype,
                      device=hidden.device)
    if one_row:
        grid_n = triton.cdiv(inter, cfg.pair_n)
        copy_args, fill_consts, copy_rows = fill_args(fill, w13, w2, cfg, grid_n)
        _decode_gate_up_pair_kernel[(top_k + copy_rows, grid_n)](
            hidden, w13, act, slots, weights, num_slots, inter, w13.stride(0), w13.stride(1), w13.stride(2),
            *copy_args, bias.b13, bias.ids, bias.num, TOP_K=top_k, HIDDEN=dim, BLOCK_N=cfg.pair_n, BLOCK_K=cfg.pair_k,
            EVEN=dim % cfg.pair_k == 0 and inter % cfg.pair_n == 0, **fill_consts, BIAS=bias.on,
            **activation_consts(activation), num_warps=cfg.pair_warps, **reg_cap(cfg.pair_regs), **pdl_args(hidden))
        return act, True
    grid_n = triton.cdiv(inter, cfg.gate_up_n)
    copy_args, fill_consts, copy_rows = fill_args(fill, w13, w2, cfg, grid_n)
    _decode_gate_up_kernel[(num_tokens * top_k + copy_rows, grid_n)](
        hidden, w13, act, slots, num_tokens * top_k, top_k, num_slots, dim, inter,
        hidden.stride(0), hidden.stride(1), w13.stride(0), w13.stride(1), w13.stride(2), *copy_args,
        bias.b13, bias.ids, bias.num, BLOCK_P=_block_p(num_tokens * top_k), BLOCK_N=cfg.gate_up_n,
        BLOCK_K=cfg.gate_up_k, PRECISION=_precision(hidden.dtype), **fill_consts, BIAS=bias.on,
        **activation_consts(activation), num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pdl_args(hidden))
    return act, False


def _down_per_token(act: torch.Tensor, weights: torch.Tensor, slots: torch.Tensor, w2: torch.Tensor,
                    out: torch.Tensor, cfg: DecodeConfig, bias: BiasArgs, weighted: bool) -> None:
    num_tokens, top_k = slots.shape
    num_slots, dim, inter = w2.shape
    _decode_down_kernel[(num_tokens, triton.cdiv(dim, cfg.down_n))](
        act, w2, weights, slots, out, num_slots, dim, w2.stride(0), w2.stride(1), w2.stride(2), bias.b2, bias.ids,
        bias.num, TOP_K=top_k, INTER=inter, BLOCK_N=cfg.down_n, BLOCK_K=cfg.down_k,
        EVEN=inter % cfg.down_k == 0 and dim % cfg.down_n == 0, BIAS=bias.on, WEIGHTED=weighted,
        num_warps=cfg.down_warps, **pdl_args(act))


def _down_per_slot(act: torch.Tensor, weights: torch.Tensor, slots: torch.Tensor, w2: torch.Tensor,
                   out: torch.Tensor, cfg: DecodeConfig, bias: BiasArgs) -> None:
    num_tokens, top_k = slots.shape
    num_slots, dim, inter = w2.shape
    num_pairs = num_tokens * top_k
    pair_out = torch.empty(num_pairs, dim, dtype=act.dtype, device=out.device)
    _decode_slot_down_kernel[(num_pairs, triton.cdiv(dim, cfg.slot_down_n))](
        act, w2, weights, slots, pair_out, num_pairs, num_slots, dim, inter, w2.stride(0), w2.stride(1),
        w2.stride(2), bias.b2, bias.ids, bias.num, BLOCK_P=_block_p(num_pairs), BLOCK_N=cfg.slot_down_n,
        BLOCK_K=cfg.slot_down_k, PRECISION=_precision(act.dtype), BIAS=bias.on, num_warps=cfg.num_warps,
        num_stages=cfg.num_stages, **pdl_args(act))
    sum_over_k(pair_out, slots.reshape(-1), out, num_slots, top_k)
