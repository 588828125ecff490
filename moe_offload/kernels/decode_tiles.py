"""Triton pieces shared by the decode kernels (bf16 ``grouped_gemm_decode``, fp8
``grouped_gemm_decode_fp8``, 4-bit ``grouped_gemm_w4_decode``): the PDL wait, which pair or which
slot's pairs a program serves, a reduction step's loads, the stores of rows times their routing
weights (the prefill kernels' too), and a fill's copies of the experts an expert-cache lookup
just admitted (``SlotFill``) into their slots.

May import: triton only.
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def pdl_wait(PDL: tl.constexpr):
    """Under PDL, wait for the kernel before (its writes visible), then let the next one launch
    (``triton_support.pdl_args``): a kernel calls this before any access another kernel writes."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()


# ==== which pairs a program serves ====

@triton.jit
def pair_slot(slots_ptr, num_slots):
    """A one-pair program's pair (``program_id(0)``), its slot, and whether it skips (the slot is
    outside ``[0, N)``)."""
    pair = tl.program_id(0).to(tl.int64)
    slot = tl.load(slots_ptr + pair).to(tl.int64)
    return pair, slot, (slot < 0) | (slot >= num_slots)


@triton.jit
def weighted_pair(slots_ptr, num_slots, act_ptr, inter, BLOCK_N: tl.constexpr):
    """``pair_slot`` and ``column_tile`` for one token's gate_up, whose act rows are float32 and
    weighted (the per-token downs read every row as it is, WEIGHTED): a pair that skips gets its
    columns of zeros here, one that runs stores them by ``store_weighted_row``."""
    pair, slot, skip = pair_slot(slots_ptr, num_slots)
    cols, col_ok = column_tile(inter, BLOCK_N)
    if skip:
        tl.store(act_ptr + pair * inter + cols, tl.zeros((BLOCK_N,), tl.float32), mask=col_ok)
    return pair, slot, skip, cols, col_ok


@triton.jit
def store_weighted_row(act_ptr, weights_ptr, pair, inter, cols, col_ok, act):
    """A ``weighted_pair`` program's act columns, times the pair's routing weight, in float32."""
    tl.store(act_ptr + pair * inter + cols, act * tl.load(weights_ptr + pair).to(tl.float32), mask=col_ok)


@triton.jit
def store_weighted(out_ptr, acc, weights_ptr, pairs, pair_ok, cols, col_ok, hidden):
    """``out[pair, cols] = acc * weight[pair]``, one output row a pair (``pairs [M]``, ``acc [M, N]``)."""
    weight = tl.load(weights_ptr + pairs, mask=pair_ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + pairs[:, None].to(tl.int64) * hidden + cols[None, :],
             (acc * weight[:, None]).to(out_ptr.dtype.element_ty), mask=pair_ok[:, None] & col_ok[None, :])


@triton.jit
def routed_pair(slots_ptr, weights_ptr, token, j, num_slots, TOP_K: tl.constexpr):
    """Token ``token``'s ``j``-th (token, slot) pair for a per-token down: its index, its slot (0
    when outside ``[0, N)``, so its reads stay in bounds), whether the slot is in range, and its
    combine weight (0 when not)."""
    pair = token * TOP_K + j
    slot = tl.load(slots_ptr + pair).to(tl.int64)
    ok = (slot >= 0) & (slot < num_slots)
    weight = tl.where(ok, tl.load(weights_ptr + pair).to(tl.float32), 0.0)
    return pair, tl.where(ok, slot, 0), ok, weight


@triton.jit
def slot_program(slots_ptr, num_pairs, num_slots, width, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr):
    """A slot-grouped program (p, n): the slot of pair p, which pairs are on it, their ranks among
    them, how many this program runs (all of them if p is its slot's first pair and the slot is in
    range, else none: one program a slot), and its ``BLOCK_N`` columns of ``width`` with which are
    in range."""
    slot = tl.load(slots_ptr + tl.program_id(0)).to(tl.int64)
    ps = tl.arange(0, BLOCK_P)
    on_slot = tl.load(slots_ptr + ps, mask=ps < num_pairs, other=-1).to(tl.int64) == slot
    first = tl.min(tl.where(on_slot, ps, BLOCK_P), 0)
    skip = (slot < 0) | (slot >= num_slots) | (first != tl.program_id(0))
    ones = on_slot.to(tl.int32)
    cols, col_ok = column_tile(width, BLOCK_N)
    return slot, on_slot, tl.cumsum(ones, 0) - 1, tl.where(skip, 0, tl.sum(ones, 0)), cols, col_ok


@triton.jit
def round_pairs(on_slot, rank, count, r0, BLOCK_P: tl.constexpr):
    """The pairs of ranks ``[r0, r0 + 16)`` on the slot (compacted into the 16 rows a tl.dot needs
    at least) and which rows are live; a slot with more pairs takes several rounds."""
    ps = tl.arange(0, BLOCK_P)
    rs = r0 + tl.arange(0, 16)
    pick = on_slot[None, :] & (rank[None, :] == rs[:, None])
    return tl.sum(tl.where(pick, ps[None, :], 0), 1).to(tl.int64), rs < count


@triton.jit
def column_tile(width, BLOCK_N: tl.constexpr):
    """This program's ``BLOCK_N`` columns (``program_id(1)``) of ``width``, and which are in range."""
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    return cols, cols < width


# ==== one step of an unrolled reduction (EVEN: the tiles divide the shapes, no load is masked) ====

@triton.jit
def row_step(row_ptr, ks, k_len, EVEN: tl.constexpr):
    """``row[ks]`` of a contiguous row, zero past ``k_len``."""
    if EVEN:
        x = tl.load(row_ptr + ks)
    else:
        x = tl.load(row_ptr + ks, mask=ks < k_len, other=0.0)
    return x


@triton.jit
def tile_step(w_rows, ks, col_ok, k_len, stride_k, EVEN: tl.constexpr):
    """``w[ks, cols]`` as ``[BLOCK_K, BLOCK_N]`` (``w_rows [1, N]`` each column's start), zero past
    ``k_len`` and in columns not ``col_ok``."""
    if EVEN:
        w = tl.load(w_rows + ks[:, None] * stride_k)
    else:
        w = tl.load(w_rows + ks[:, None] * stride_k, mask=(ks < k_len)[:, None] & col_ok[None, :], other=0.0)
    return w


# ==== a fill: the lookup's planned experts copied in as the gate_up launch runs ====

@triton.jit
def copy_rows(src_rows, dst_rows, row_ok, row_len, BLOCK_C: tl.constexpr, ALIGN: tl.constexpr = 1):
    """Copy rows ``src_rows [R, 1] -> dst_rows [R, 1]`` (pointers to each row's start, ``row_len``
    contiguous items), ``BLOCK_C`` columns a step: a step's loads are all in flight before its
    stores, so a read over PCIe costs one round trip a step. ALIGN: the caller knows that
    ``row_len`` and each row's start are multiples of ALIGN items, which the compiler cannot see
    in a row length that is not a multiple of 16 (gpt-oss' 2880 codes are 360 words: without it
    a word a load, with it four)."""
    for c0 in range(0, row_len, BLOCK_C):
        cs = c0 + tl.arange(0, BLOCK_C)
        ok = row_ok[:, None] & (cs // ALIGN < row_len // ALIGN)[None, :]
        tl.store(dst_rows + cs[None, :], tl.load(src_rows + cs[None, :], mask=ok), mask=ok)


@triton.jit
def planned_source(slot, plan_src_ptr, plan_dst_ptr, plan_len, PLAN: tl.constexpr):
    """The host expert the lookup's plan (``plan_len`` rows) copies into ``slot``, or -1 (a hit: the
    slot is current). Rows past the plan's count are -1 (``lookup_admit``), so no count is read."""
    rows = tl.arange(0, PLAN)
    dst = tl.load(plan_dst_ptr + rows, mask=rows < plan_len, other=-1).to(tl.int64)
    src = tl.load(plan_src_ptr + rows, mask=rows < plan_len, other=-1).to(tl.int64)
    return tl.max(tl.where((dst == slot) & (dst >= 0), src, -1), 0)


@triton.jit
def fill_w13_tile(host13_ptr, w13_ptr, plan_src_ptr, plan_dst_ptr, plan_len, slot, col0, inter, hidden, stride_hs,
                  stride_ws, stride_wn, PLAN: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr,
                  ALIGN: tl.constexpr = 1):
    """If the lookup's plan fills ``slot``, copy gate and up rows ``[col0, col0 + BLOCK_N)`` (this
    program's columns) of its host expert into the slot, then a barrier: the program's reads of the
    slot come after every one of its threads' stores. A hit's program only reads the plan. ALIGN as
    ``copy_rows`` (the row stride a multiple of it)."""
    src = planned_source(slot, plan_src_ptr, plan_dst_ptr, plan_len, PLAN)
    if src >= 0:
        r = tl.arange(0, 2 * BLOCK_N)
        col = col0 + r % BLOCK_N
        offs = (col + (r // BLOCK_N) * inter).to(tl.int64) * stride_wn  # gate rows, then up rows
        if ALIGN > 1:  # (a hint replaces what the compiler knew, so none where there is nothing to add)
            offs = tl.multiple_of(offs, ALIGN)
        copy_rows(host13_ptr + src * stride_hs + offs[:, None], w13_ptr + slot * stride_ws + offs[:, None],
                  col < inter, hidden, BLOCK_C, ALIGN)
        tl.debug_barrier()


@triton.jit
def fill_w2_rows(host2_ptr, w2_ptr, plan_src_ptr, plan_dst_ptr, count_ptr, first, hidden, inter, stride_hs,
                 stride_ws, ROWS: tl.constexpr, BLOCK_C: tl.constexpr, ALIGN: tl.constexpr = 1):
    """A copy program (``program_id(0) >= first``): rows ``[c * ROWS, (c + 1) * ROWS)`` of every
    planned expert's w2 (``[hidden, inter]``, contiguous), ``c`` its rank among the copy programs;
    ALIGN as ``copy_rows`` (``inter`` a multiple of it)."""
    c = (tl.program_id(0) - first) * tl.num_programs(1) + tl.program_id(1)
    rows = c * ROWS + tl.arange(0, ROWS)
    offs = rows.to(tl.int64) * inter
    if ALIGN > 1:
        offs = tl.multiple_of(offs, ALIGN)
    offs = offs[:, None]
    for j in range(0, tl.load(count_ptr)):
        src = tl.load(plan_src_ptr + j).to(tl.int64)
        dst = tl.load(plan_dst_ptr + j).to(tl.int64)
        copy_rows(host2_ptr + src * stride_hs + offs, w2_ptr + dst * stride_ws + offs, rows < hidden, inter, BLOCK_C,
                  ALIGN)


@triton.jit
def w2_copy_program(first, host2_ptr, w2_ptr, plan_src_ptr, plan_dst_ptr, count_ptr, hidden, inter, stride_hs,
                    stride_ws, FILL: tl.constexpr, ROWS: tl.constexpr, BLOCK_C: tl.constexpr, ALIGN: tl.constexpr = 1):
    """Whether this is one of a fill's copy programs (the grid's rows from ``first`` on), which then
    has copied its rows of the planned experts' w2 (``fill_w2_rows``) and returns."""
    copying = False
    if FILL:
        copying = tl.program_id(0) >= first
        if copying:
            fill_w2_rows(host2_ptr, w2_ptr, plan_src_ptr, plan_dst_ptr, count_ptr, first, hidden, inter, stride_hs,
                         stride_ws, ROWS, BLOCK_C, ALIGN)
    return copying
