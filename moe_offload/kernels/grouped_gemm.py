"""Triton grouped SwiGLU expert GEMM with fixed shapes and no host reads of the routing.

The T*k (token, slot) pairs are sorted by slot on the device and every slot's group is padded to a
multiple of BLOCK_M, so a BLOCK_M row block of the GEMMs reads one slot's weights:

```
 sorted_pairs  | s3 s3 s3 -- | s7 -- -- -- | s9 s9 s9 s9 | s9 -- -- -- | unused ...     (BLOCK_M = 4)
               |   block 0   |   block 1   |   block 2   |   block 3   | blocks >= total/BLOCK_M exit
```

``--`` is the padding id ``T*k``. The grid is sized from shapes for the worst case (every group
one row short of a full block); the padded total stays on the device and surplus blocks return
at once. Launches: align (which sorts in registers up to IN_KERNEL_SORT_MAX pairs; larger inputs
are sorted by torch.sort first), gate_up+SiLU, down (times the combine weight), sum over k.

Callers go through ``moe_offload.grouped.grouped_swiglu``, which checks the arguments. Fp8 banks
take ``grouped_gemm_fp8``, which shares this file's alignment and sum over k. gpt-oss's experts add
a bias row (by the pair's expert id) to each dot and take the clamped activation; the epilogue
pieces (``bias_rows``, ``activate``) are the 4-bit kernels' (``grouped_gemm_w4_tiles``).
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from moe_offload.kernels.decode_tiles import store_weighted
from moe_offload.kernels.grouped_gemm_w4_banks import activation_consts
from moe_offload.kernels.grouped_gemm_w4_tiles import bias_rows, biased_activation
from moe_offload.kernels.triton_support import pdl_args


class BlockConfig(NamedTuple):
    """Tile sizes. ``block_m`` is also the padding unit of the alignment; the fused gate/up GEMM
    keeps two accumulators, so it uses ``block_n // 2`` columns of each."""

    block_m: int
    block_n: int
    block_k: int
    group_m: int
    num_warps: int
    num_stages: int


def default_config(num_tokens: int, dtype: torch.dtype) -> BlockConfig:
    """Bf16/fp16 tiles for H200 after vLLM's tuned table for E=128, N=768 (keyed on tokens, as
    there): small row blocks while the weights dominate, big tiles once compute does."""
    return pick_config(num_tokens, dtype, _BF16_CONFIGS)


FP32_CONFIG = BlockConfig(32, 64, 32, 8, 4, 2)  # fp32 activations (tests, CPU) in every table
# (up to this many tokens, tiles), the last entry for any count
_BF16_CONFIGS = ((32, BlockConfig(16, 64, 128, 1, 4, 3)), (128, BlockConfig(16, 128, 128, 1, 4, 2)),
                 (512, BlockConfig(64, 128, 64, 8, 4, 3)), (None, BlockConfig(128, 256, 64, 8, 8, 3)))


def pick_config(num_tokens: int, dtype: torch.dtype,
                table: tuple[tuple[int | None, BlockConfig], ...]) -> BlockConfig:
    """The first tiles of ``table`` whose token bound holds ``num_tokens``; fp32 takes its own."""
    if dtype == torch.float32:
        return FP32_CONFIG
    return next(config for limit, config in table if limit is None or num_tokens <= limit)


class Alignment(NamedTuple):
    sorted_pairs: torch.Tensor  # [num_blocks * block_m] int32 pair ids grouped by slot, T*k = padding
    total: torch.Tensor  # [1] int32 padded row count, read only by kernels
    num_blocks: int  # grid bound from shapes


def max_blocks(num_pairs: int, num_slots: int, block_m: int, groups: int | None = None) -> int:
    """Worst-case row blocks: ``G = min(N, T*k)`` groups need at most ``G + (T*k - G) // block_m``
    blocks (sum of ceil(c/B) <= G + floor((sum c - G) / B)); small decode batches stay small even
    with thousands of cache slots. ``groups``: the most distinct slots the pairs name, where the
    caller knows fewer than ``N`` (a layer's routing names at most its experts, one slot each)."""
    groups = min(num_slots, num_pairs, num_slots if groups is None else groups)
    return groups + (num_pairs - groups) // block_m


@triton.jit
def _max_fn(a, b):
    return tl.maximum(a, b)


# Pairs sort by ``slot * T*k + pair``: unique keys, so the order is deterministic without a stable
# sort, and one int64 carries both the slot and the pair id. Out-of-range slots become N, last.
# Up to this many pairs (decode batches) the align kernel sorts in registers: one launch in all.
IN_KERNEL_SORT_MAX = 1024


# Triton compiles a kernel once per combination of its int arguments' == 1 and % 16 and its pointers'
# 16-byte alignment. Pair and block counts follow the batch, and the routing's weights, ids and slots
# may be views of every layer's routing (synthetic routing) at offsets that follow it: none of them is
# specialised, so a token count the warm-up did not meet compiles nothing.
@triton.jit(do_not_specialize=["num_pairs", "capacity"],
            do_not_specialize_on_alignment=["slots_ptr"])
def _align_kernel(slots_ptr, sorted_ptr, sorted_pairs_ptr, total_ptr, num_pairs, num_slots, capacity,
                  SORT_BLOCK: tl.constexpr, BLOCK_M: tl.constexpr, CHUNK: tl.constexpr):
    if SORT_BLOCK > 0:
        spos = tl.arange(0, SORT_BLOCK)
        sslot = tl.load(slots_ptr + spos, mask=spos < num_pairs, other=num_slots).to(tl.int64)
        skey = tl.where((sslot >= 0) & (sslot < num_slots), sslot, num_slots)
        skey = tl.where(spos < num_pairs, skey * num_pairs + spos, 9223372036854775807)
        tl.store(sorted_ptr + spos, tl.sort(skey, 0), mask=spos < num_pairs)
    for start in range(0, capacity, CHUNK):
        offs = start + tl.arange(0, CHUNK)
        tl.store(sorted_pairs_ptr + offs, tl.full((CHUNK,), num_pairs, tl.int32), mask=offs < capacity)
    # The stores above and the loads and scatter below touch the same addresses from other threads.
    tl.debug_barrier()
    # Walk the sorted pairs in chunks, carrying the open group's first position and the padding
    # inserted so far; a pair lands at its sorted position plus that padding.
    carry_first = tl.zeros((), tl.int32)
    carry_pad = tl.zeros((), tl.int32)
    num_valid = tl.zeros((), tl.int32)
    for start in range(0, num_pairs, CHUNK):
        pos = start + tl.arange(0, CHUNK)
        live = pos < num_pairs
        comp = tl.load(sorted_ptr + pos, mask=live, other=0)
        key = tl.where(live, comp // num_pairs, num_slots)
        # -1 differs from every slot: the first and last pair always bound a group.
        has_prev = live & (pos > 0)
        prev = tl.where(has_prev, tl.load(sorted_ptr + pos - 1, mask=has_prev, other=0) // num_pairs, -1)
        has_next = pos + 1 < num_pairs
        nxt = tl.where(has_next, tl.load(sorted_ptr + pos + 1, mask=has_next, other=0) // num_pairs, -1)
        valid = live & (key < num_slots)
        first = tl.associative_scan(tl.where(key != prev, pos, 0), 0, _max_fn)
        first = tl.maximum(first, carry_first)
        count = pos - first + 1
        pad = tl.where(valid & (key != nxt), (BLOCK_M - count % BLOCK_M) % BLOCK_M, 0)
        dest = pos + carry_pad + tl.cumsum(pad, 0) - pad
        # within the rows sized for the distinct slots the caller promised (align_by_slot's groups)
        tl.store(sorted_pairs_ptr + dest, (comp % num_pairs).to(tl.int32), mask=valid & (dest < capacity))
        carry_first = tl.max(first, 0)
        carry_pad += tl.sum(pad, 0)
        num_valid += tl.sum(valid.to(tl.int32), 0)
    tl.store(total_ptr, num_valid + carry_pad)


def align_by_slot(slots: torch.Tensor, num_slots: int, block_m: int, sort_in_kernel: bool | None = None,
                  groups: int | None = None) -> Alignment:
    """Group the flat pairs by slot and pad each group to ``block_m`` rows, on the device.

    Out-of-range slot ids are never placed, so they contribute nothing. Small inputs sort inside
    the align kernel; larger ones sort with ``torch.sort`` first (same keys, same result).
    ``groups`` bounds the distinct slots (``max_blocks``): the rows and the grids of the GEMMs after
    are sized by it, not by a cache's thousands of slots; a pair past that size is never stored.
    """
    flat = slots.reshape(-1)
    num_pairs = flat.numel()
    num_blocks = max_blocks(num_pairs, num_slots, block_m, groups)
    if sort_in_kernel is None:
        sort_in_kernel = num_pairs <= IN_KERNEL_SORT_MAX
    if sort_in_kernel:
        sorted_keys = torch.empty(num_pairs, dtype=torch.int64, device=flat.device)
    else:
        key = torch.where((flat >= 0) & (flat < num_slots), flat, num_slots).to(torch.int64)
        positions = torch.arange(num_pairs, device=flat.device)
        sorted_keys = torch.sort(key * num_pairs + positions).values
    sorted_pairs = torch.empty(num_blocks * block_m, dtype=torch.int32, device=flat.device)
    total = torch.empty(1, dtype=torch.int32, device=flat.device)
    sort_block = triton.next_power_of_2(num_pairs) if sort_in_kernel else 0
    _align_kernel[(1,)](flat, sorted_keys, sorted_pairs, total, num_pairs, num_slots, sorted_pairs.numel(),
                        SORT_BLOCK=sort_block, BLOCK_M=block_m, CHUNK=1024, num_warps=8)
    return Alignment(sorted_pairs, total, num_blocks)


@triton.jit
def _tile(pid, num_m, num_n, GROUP_M: tl.constexpr):
    # Neighbouring programs take row blocks of one group first so weight tiles are reused in L2.
    width = GROUP_M * num_n
    first_m = (pid // width) * GROUP_M
    rows = tl.minimum(num_m - first_m, GROUP_M)
    return first_m + (pid % width) % rows, (pid % width) // rows


@triton.jit
def _pair_tile(num_blocks, num_cols, total_ptr, sorted_pairs_ptr, slots_ptr, BLOCK_M: tl.constexpr,
               BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """This program's tile: its row block's rows, their pair ids and the block's slot, its
    ``BLOCK_N`` columns of ``num_cols`` and which are in range, and ``done``, whether the block lies
    past the aligned pairs (the caller returns). A live block's first row is a real pair; a dead
    block's may be the padding id ``T*k``, one past the end of ``slots``, so the slot load is masked
    to live blocks. The pair loads need no mask: rows stay below ``num_blocks * BLOCK_M``, the
    length of ``sorted_pairs``, which the align kernel fills in full."""
    pid_m, pid_n = _tile(tl.program_id(0), num_blocks, tl.cdiv(num_cols, BLOCK_N), GROUP_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    total = tl.load(total_ptr)
    live = pid_m * BLOCK_M < total
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pairs = tl.load(sorted_pairs_ptr + rows)
    slot = tl.load(slots_ptr + tl.load(sorted_pairs_ptr + pid_m * BLOCK_M), mask=live, other=0).to(tl.int64)
    return rows, pairs, slot, cols, cols < num_cols, pid_m * BLOCK_M >= total


@triton.jit
def token_rows(pairs, num_pairs, top_k):
    """Which of a tile's rows are pairs (the rest pad the block), and each row's token (0 for padding)."""
    row_ok = pairs < num_pairs
    return row_ok, tl.where(row_ok, pairs // top_k, 0).to(tl.int64)


@triton.jit
def swiglu_rows(a_ptrs, row_ok, g_ptrs, u_ptrs, col_ok, hidden, stride_xh, stride_wh,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr):
    """silu(a . g) * (a . u) of ``BLOCK_M`` rows (``a_ptrs [M, 1]``, rows not ``row_ok`` read as 0)
    and ``BLOCK_N`` columns of one slot's gate and up weights (``g_ptrs``, ``u_ptrs`` ``[1, N]``)."""
    acc_g, acc_u = gate_up_rows(a_ptrs, row_ok, g_ptrs, u_ptrs, col_ok, hidden, stride_xh, stride_wh,
                                BLOCK_M, BLOCK_N, BLOCK_K, PRECISION)
    return acc_g * tl.sigmoid(acc_g) * acc_u


@triton.jit
def gate_up_rows(a_ptrs, row_ok, g_ptrs, u_ptrs, col_ok, hidden, stride_xh, stride_wh,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr):
    """``(a . g, a . u)`` in float32, before the activation (``swiglu_rows``' arguments)."""
    acc_g = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for k0 in range(0, hidden, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < hidden
        a = tl.load(a_ptrs + ks[None, :] * stride_xh, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w_mask = k_ok[:, None] & col_ok[None, :]
        g = tl.load(g_ptrs + ks[:, None] * stride_wh, mask=w_mask, other=0.0)
        u = tl.load(u_ptrs + ks[:, None] * stride_wh, mask=w_mask, other=0.0)
        acc_g = tl.dot(a, g, acc_g, input_precision=PRECISION)
        acc_u = tl.dot(a, u, acc_u, input_precision=PRECISION)
    return acc_g, acc_u


@triton.jit
def down_rows(a_ptrs, a_mask, w_ptrs, col_ok, inter, stride_wi,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr):
    """``act . w2`` of ``BLOCK_M`` activation rows (``a_ptrs [M, 1]``, contiguous over ``inter``;
    ``a_mask [M, 1]`` rows to read) and ``BLOCK_N`` columns of one slot's down weights."""
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for k0 in range(0, inter, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < inter
        a = tl.load(a_ptrs + ks[None, :], mask=a_mask & k_ok[None, :], other=0.0)
        w = tl.load(w_ptrs + ks[:, None] * stride_wi, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        acc = tl.dot(a, w, acc, input_precision=PRECISION)
    return acc


@triton.jit(do_not_specialize=["num_pairs", "num_blocks"],
            do_not_specialize_on_alignment=["ids_ptr", "slots_ptr"])
def _gate_up_kernel(x_ptr, w13_ptr, b13_ptr, ids_ptr, act_ptr, sorted_pairs_ptr, total_ptr, slots_ptr,
                    num_pairs, top_k, hidden, inter, num_blocks, num_bias,
                    stride_xt, stride_xh, stride_ws, stride_wn, stride_wh,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    GROUP_M: tl.constexpr, PRECISION: tl.constexpr, BIAS: tl.constexpr, GPT_OSS: tl.constexpr,
                    LIMIT: tl.constexpr, ALPHA: tl.constexpr):
    """act[row, n] = silu(x[token] . w13[slot, n]) * (x[token] . w13[slot, I + n]); gpt-oss: each
    dot plus its bias row (``b13 [E, 2I]`` at the pair's expert id), the clamped activation."""
    rows, pairs, slot, cols, col_ok, done = _pair_tile(num_blocks, inter, total_ptr, sorted_pairs_ptr, slots_ptr,
                                                       BLOCK_M, BLOCK_N, GROUP_M)
    if done:
        return
    row_ok, tokens = token_rows(pairs, num_pairs, top_k)
    g_ptrs = w13_ptr + slot * stride_ws + cols[None, :].to(tl.int64) * stride_wn
    acc_g, acc_u = gate_up_rows(x_ptr + tokens[:, None] * stride_xt, row_ok, g_ptrs, g_ptrs + inter * stride_wn,
                                col_ok, hidden, stride_xh, stride_wh, BLOCK_M, BLOCK_N, BLOCK_K, PRECISION)
    act = biased_activation(acc_g, acc_u, b13_ptr, ids_ptr, pairs[:, None], row_ok[:, None], cols[None, :],
                            col_ok[None, :], num_bias, inter, BIAS, GPT_OSS, LIMIT, ALPHA)
    # Padding rows are stored too (as zeros) so the down GEMM reads no uninitialised memory.
    out_ptrs = act_ptr + rows[:, None].to(tl.int64) * inter + cols[None, :]
    tl.store(out_ptrs, act.to(act_ptr.dtype.element_ty), mask=col_ok[None, :])


@triton.jit(do_not_specialize=["num_pairs", "num_blocks"],
            do_not_specialize_on_alignment=["ids_ptr", "slots_ptr", "weights_ptr"])
def _down_kernel(act_ptr, w2_ptr, b2_ptr, ids_ptr, out_ptr, sorted_pairs_ptr, total_ptr, slots_ptr, weights_ptr,
                 num_pairs, hidden, inter, num_blocks, num_bias,
                 stride_ws, stride_wh, stride_wi,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 GROUP_M: tl.constexpr, PRECISION: tl.constexpr, BIAS: tl.constexpr):
    """out[pair, h] = weight[pair] * (act[row] . w2[slot, h] (+ b2[id, h])), one row per (token, k)
    pair; ``sum_over_k`` adds up a token's k rows afterwards."""
    rows, pairs, slot, cols, col_ok, done = _pair_tile(num_blocks, hidden, total_ptr, sorted_pairs_ptr, slots_ptr,
                                                       BLOCK_M, BLOCK_N, GROUP_M)
    if done:
        return
    row_ok = pairs < num_pairs
    w_ptrs = w2_ptr + slot * stride_ws + cols[None, :].to(tl.int64) * stride_wh
    acc = down_rows(act_ptr + rows[:, None].to(tl.int64) * inter, row_ok[:, None], w_ptrs, col_ok, inter,
                    stride_wi, BLOCK_M, BLOCK_N, BLOCK_K, PRECISION)
    if BIAS:
        acc += bias_rows(b2_ptr, ids_ptr, pairs[:, None], row_ok[:, None], cols[None, :], col_ok[None, :],
                         num_bias, hidden, BIAS)
    store_weighted(out_ptr, acc, weights_ptr, pairs, row_ok, cols, col_ok, hidden)


@triton.jit(do_not_specialize_on_alignment=["slots_ptr"])
def _sum_k_kernel(pair_out_ptr, slots_ptr, out_ptr, num_slots, hidden, top_k,
                  TOP_K: tl.constexpr, BLOCK_H: tl.constexpr, PDL: tl.constexpr):
    """out[t] = sum_j pair_out[t*k + j] in fp32, in a fixed order; out-of-range slots were never
    computed (their rows are uninitialised) and are skipped here."""
    if PDL:  # see triton_support.pdl_args
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    js = tl.arange(0, TOP_K)
    j_ok = js < top_k
    slot = tl.load(slots_ptr + token * top_k + js, mask=j_ok, other=-1)
    use = j_ok & (slot >= 0) & (slot < num_slots)
    rows = token * top_k + js
    vals = tl.load(pair_out_ptr + rows[:, None] * hidden + cols[None, :],
                   mask=use[:, None] & (cols < hidden)[None, :], other=0.0)
    tl.store(out_ptr + token * hidden + cols, tl.sum(vals.to(tl.float32), 0).to(out_ptr.dtype.element_ty),
             mask=cols < hidden)


def fused_grouped_swiglu(hidden: torch.Tensor, weights: torch.Tensor, slots: torch.Tensor,
                         w13: torch.Tensor, w2: torch.Tensor, config: BlockConfig | None = None,
                         out_dtype: torch.dtype | None = None, w13_bias: torch.Tensor | None = None,
                         w2_bias: torch.Tensor | None = None, bias_ids: torch.Tensor | None = None,
                         activation: str = "silu", groups: int | None = None) -> torch.Tensor:
    """The Triton path of ``grouped_swiglu``; arguments are already checked (gpt-oss's biases,
    indexed by ``bias_ids``, activation and ``groups`` as there)."""
    num_tokens, top_k = slots.shape
    num_slots, inter, dim = w2.shape[0], w2.shape[2], hidden.shape[1]
    num_pairs = num_tokens * top_k
    out = torch.empty(num_tokens, dim, dtype=out_dtype or hidden.dtype, device=hidden.device)
    if num_pairs == 0:
        return out
    cfg = config or default_config(num_tokens, hidden.dtype)
    slots = slots.reshape(-1).contiguous()
    weights = weights.reshape(-1).contiguous()
    align = align_by_slot(slots, num_slots, cfg.block_m, groups=groups)
    bias = bias_args_of(w13, w2, slots, w13_bias, w2_bias, bias_ids)
    precision = "ieee" if hidden.dtype == torch.float32 else "tf32"
    act = torch.empty(align.sorted_pairs.numel(), inter, dtype=hidden.dtype, device=hidden.device)
    n1 = cfg.block_n // 2
    grid1 = (align.num_blocks * triton.cdiv(inter, n1),)
    _gate_up_kernel[grid1](hidden, w13, bias.b13, bias.ids, act, align.sorted_pairs, align.total, slots,
                           num_pairs, top_k, dim, inter, align.num_blocks, bias.num,
                           hidden.stride(0), hidden.stride(1), w13.stride(0), w13.stride(1), w13.stride(2),
                           BLOCK_M=cfg.block_m, BLOCK_N=n1, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m,
                           PRECISION=precision, BIAS=bias.on, **activation_consts(activation),
                           num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    pair_out = torch.empty(num_pairs, dim, dtype=hidden.dtype, device=hidden.device)
    grid2 = (align.num_blocks * triton.cdiv(dim, cfg.block_n),)
    _down_kernel[grid2](act, w2, bias.b2, bias.ids, pair_out, align.sorted_pairs, align.total, slots, weights,
                        num_pairs, dim, inter, align.num_blocks, bias.num,
                        w2.stride(0), w2.stride(1), w2.stride(2),
                        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m,
                        PRECISION=precision, BIAS=bias.on, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    sum_over_k(pair_out, slots, out, num_slots, top_k)
    return out


class BiasArgs(NamedTuple):
    """The kernels' bias arguments: ``b13 [E, 2I]``, ``b2 [E, H]``, the flat ``ids`` they are
    indexed by and ``E``; without biases, stand-in pointers the kernels never read (``on`` False)."""

    b13: torch.Tensor
    b2: torch.Tensor
    ids: torch.Tensor
    num: int
    on: bool


def bias_args_of(w13: torch.Tensor, w2: torch.Tensor, slots: torch.Tensor, w13_bias: torch.Tensor | None,
               w2_bias: torch.Tensor | None, bias_ids: torch.Tensor | None) -> BiasArgs:
    if w13_bias is None:
        return BiasArgs(w13, w2, slots, 0, False)
    ids = (slots if bias_ids is None else bias_ids).reshape(-1).contiguous()
    return BiasArgs(w13_bias.contiguous(), w2_bias.contiguous(), ids, w13_bias.shape[0], True)


def sum_over_k(pair_out: torch.Tensor, slots: torch.Tensor, out: torch.Tensor, num_slots: int, top_k: int) -> None:
    """``out [T, H] = sum_j pair_out[t*k + j]`` over the in-range slots (flat ``slots [T*k]``)."""
    num_tokens, dim = out.shape
    block_h = min(1024, triton.next_power_of_2(dim))
    _sum_k_kernel[(num_tokens, triton.cdiv(dim, block_h))](pair_out, slots, out, num_slots, dim, top_k,
                                                           TOP_K=triton.next_power_of_2(top_k), BLOCK_H=block_h,
                                                           **pdl_args(out))
