"""A per-token decode down asks L2 for its weight rows before its PDL wait
(``decode_tiles.prefetch_down_rows``, ``triton_support.l2_prefetch_args``): where its pieces lie
(interpreted on the CPU: every row of the token's slots covered once, in 16-byte pieces, inside
the bank, whatever the slots hold), when it is on, and on a GPU that the downs give the same bits
with it and without it, under sync-debug mode, with slots out of range."""
from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402

from moe_offload.kernels import triton_support  # noqa: E402
from moe_offload.kernels.decode_tiles import down_row_pieces  # noqa: E402
from tests.launch_count import sync_errors  # noqa: E402

interpreted = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs TRITON_INTERPRET=1")


@triton.jit
def _pieces_kernel(slots_ptr, rows_ptr, within_ptr, size_ptr, num_slots, width, stride_ws, stride_wn,
                   TOP_K: tl.constexpr, PREFETCH_K: tl.constexpr, ROW_BYTES: tl.constexpr, CHUNKS: tl.constexpr,
                   BLOCK_N: tl.constexpr):
    token = tl.program_id(0)
    rows, within, size = down_row_pieces(slots_ptr, token, num_slots, width, stride_ws, stride_wn, TOP_K, PREFETCH_K,
                                         ROW_BYTES, CHUNKS, BLOCK_N)
    n: tl.constexpr = PREFETCH_K * BLOCK_N * CHUNKS
    at = (token * tl.num_programs(1) + tl.program_id(1)) * n + tl.arange(0, n)
    tl.store(rows_ptr + at, rows)
    tl.store(within_ptr + at, within)
    tl.store(size_ptr + at, size)


def pieces(slots: torch.Tensor, bank: torch.Tensor, block_n: int, warps: int):
    """Each program's pieces as (row start in items, byte offset, bytes), one list a program."""
    tokens, top_k = slots.shape
    num_slots, width, _ = bank.shape
    consts = triton_support.l2_prefetch_args(bank, top_k, block_n, warps)
    consts["PREFETCH_K"] = triton.next_power_of_2(top_k)  # on, as on an sm90 GPU
    grid = (tokens, triton.cdiv(width, block_n))
    n = consts["PREFETCH_K"] * block_n * consts["CHUNKS"]
    rows = torch.empty(grid[0] * grid[1] * n, dtype=torch.int64)
    within, size = torch.empty_like(rows), torch.empty(rows.shape, dtype=torch.int32)
    _pieces_kernel[grid](slots, rows, within, size, num_slots, width, bank.stride(0), bank.stride(1), TOP_K=top_k,
                         BLOCK_N=block_n, **consts)
    triples = list(zip(rows.tolist(), within.tolist(), size.tolist()))
    return [triples[i:i + n] for i in range(0, len(triples), n)], consts


@interpreted
@pytest.mark.parametrize("case", [
    # slots, width, row items, item bytes, top_k, block_n, warps: fp8 at qwen3-30b's down tile, bf16, a 4-bit row of
    # words (gpt-oss: 1,440 bytes), a top-k of no power of two, a width the tile does not divide
    (10, 24, 768, 1, 8, 8, 16), (6, 16, 96, 2, 4, 8, 4), (5, 20, 360, 4, 3, 8, 8), (7, 13, 48, 1, 2, 4, 1)], ids=str)
def test_the_pieces_cover_each_row_of_the_tokens_slots_in_16_byte_pieces(case):
    num_slots, width, row, item, top_k, block_n, warps = case
    dtype = {1: torch.uint8, 2: torch.bfloat16, 4: torch.int32}[item]
    bank = torch.zeros(num_slots, width, row, dtype=dtype)
    gen = torch.Generator().manual_seed(num_slots)
    slots = torch.stack([torch.randperm(num_slots, generator=gen)[:top_k] for _ in range(3)]).int()
    slots[1, 0], slots[2, -1] = -1, num_slots + 5  # out of range: clamped, never past the bank
    programs, consts = pieces(slots, bank, block_n, warps)
    row_bytes = row * item
    assert consts["CHUNKS"] >= 1 and row_bytes // consts["CHUNKS"] >= 16
    total = bank.numel() * item
    for p, got in enumerate(programs):
        token, block = divmod(p, triton.cdiv(width, block_n))
        spans = {(start * item + off, size) for start, off, size in got}
        assert all(off % 16 == 0 and size % 16 == 0 and size > 0 and off + size <= total for off, size in spans)
        cols = range(block * block_n, min(width, (block + 1) * block_n))
        for slot in slots[token].clamp(0, num_slots - 1).tolist():
            for col in cols:  # the row's pieces, in order, tile it exactly
                first = (slot * width + col) * row_bytes
                mine = sorted((off, size) for off, size in spans if first <= off < first + row_bytes)
                assert mine[0][0] == first and sum(size for _, size in mine) == row_bytes, (slot, col, mine)
                assert all(a + s == b for (a, s), (b, _) in zip(mine, mine[1:]))
        # the padding (slots past top_k: slot 0; columns past the width: column 0) asks for rows of the bank only
        token_slots = set(slots[token].clamp(0, num_slots - 1).tolist()) | {0}
        allowed = {(s * width + c) * row_bytes for s in token_slots for c in [*cols, 0]}
        assert {off - off % row_bytes for off, _ in spans} <= allowed


def test_it_is_on_only_for_aligned_contiguous_rows_under_pdl_and_not_when_switched_off(monkeypatch):
    monkeypatch.setattr(triton_support, "pdl_args", lambda t: {"PDL": True, "launch_pdl": True})
    monkeypatch.delenv(triton_support.PREFETCH_ENV, raising=False)
    args = triton_support.l2_prefetch_args
    fp8 = torch.zeros(4, 64, 768, dtype=torch.uint8)
    # qwen3-30b's fp8 down: 8 slots x 8 columns = 64 rows for 512 threads, 8 pieces of 96 bytes
    assert args(fp8, 8, 8, 16) == {"PREFETCH_K": 8, "ROW_BYTES": 768, "CHUNKS": 8}
    assert args(fp8, 6, 8, 4)["PREFETCH_K"] == 8 and args(fp8, 6, 8, 4)["CHUNKS"] == 2
    assert args(torch.zeros(4, 64, 32, dtype=torch.uint8), 8, 8, 16)["CHUNKS"] == 2  # pieces of at least 16 bytes
    assert args(torch.zeros(4, 64, 40, dtype=torch.uint8), 8, 8, 16)["PREFETCH_K"] == 0  # 40 bytes: not whole 16s
    assert args(torch.zeros(4, 768, 64, dtype=torch.uint8).transpose(1, 2), 8, 8, 16)["PREFETCH_K"] == 0  # strided
    assert args(torch.zeros(4 * 64 * 768 + 1, dtype=torch.uint8)[1:].view(4, 64, 768), 8, 8, 16)["PREFETCH_K"] == 0
    monkeypatch.setenv(triton_support.PREFETCH_ENV, "0")
    assert args(fp8, 8, 8, 16)["PREFETCH_K"] == 0
    monkeypatch.undo()
    assert triton_support.l2_prefetch_args(fp8, 8, 8, 16)["PREFETCH_K"] == 0  # a CPU bank: no PDL, no prefetch


@pytest.mark.cuda
@pytest.mark.parametrize("fmt", ["bf16", "fp8", "mxfp4"])
def test_the_downs_give_the_same_bits_with_and_without_it_on_gpu(fmt, monkeypatch):
    """One token and two at qwen3-30b's shapes (128 slots, hidden 2048, inter 768, top-8: the per-token
    downs), a slot out of range each, sync-free."""
    from moe_offload.fp8 import BLOCK_128
    from moe_offload.grouped import grouped_swiglu
    from tests.test_grouped_gemm_fp8 import make_fp8_banks
    from tests.test_grouped_gemm_w4 import Extras, random_banks, run_op

    gen = torch.Generator().manual_seed(0)
    if fmt == "mxfp4":
        banks = random_banks(128, 2048, 768, fmt, "cuda")
        op = lambda h, w, s: run_op("public", h, w, s, banks, fmt, Extras())  # noqa: E731
    else:
        *banks, scales = make_fp8_banks(128, 2048, 768, BLOCK_128, "cuda", seed=0)
        if fmt == "bf16":
            banks, scales = [b.to(torch.bfloat16) for b in banks], None  # e4m3 values: exact in bf16
        op = lambda h, w, s: grouped_swiglu(h, w, s, *banks, scales=scales)  # noqa: E731
    for tokens in (1, 2):
        slots = torch.stack([torch.randperm(128, generator=gen)[:8] for _ in range(tokens)]).cuda()
        slots[-1, 0] = -1
        weights = torch.rand(tokens, 8, generator=gen).cuda()
        hidden = torch.randn(tokens, 2048, generator=gen).to("cuda", torch.bfloat16)
        outs = []
        for switch in ("1", "0", "1"):
            monkeypatch.setenv(triton_support.PREFETCH_ENV, switch)
            op(hidden, weights, slots)  # compiles
            with sync_errors():
                outs.append(op(hidden, weights, slots))
        torch.cuda.synchronize()
        assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2]), (fmt, tokens)
