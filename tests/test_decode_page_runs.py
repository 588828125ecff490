"""A decode split reads its runs of ascending pages without its page table (``triton_decode.PAGE_RUNS``),
interpreted on the CPU: ``_run_at`` finds where each run ends; a row whose pages are one run reads
bit for bit what the table's reading reads (a run past the pool's end clamped alike), and rows
broken by another row's page, or fragmented past ``MAX_RUNS`` runs, match it and the eager twin,
over float8 pools read as tiles (float32 queries) and as words (float16 queries)."""
from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from tests.test_kv_fp8_attention import LENGTHS, decode, decode_fp8_case  # noqa: E402
from tests.test_prefill_attention import rel_err  # noqa: E402
from worker.attention import decode_kernel, triton_decode  # noqa: E402
from worker.kv.gpu_pool import to_kv  # noqa: E402

interpreted = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs TRITON_INTERPRET=1")
CONFIG = (8, 2, 32, 16, 0, False)  # (heads, kv_heads, head dim, page, window, sinks): 32 dims read as words too
PAGE = CONFIG[3]


@triton.jit
def _run_at_kernel(table_ptr, spans_ptr, out_ptr, table_stride_b, PAGE: tl.constexpr):
    seg, end = tl.load(spans_ptr), tl.load(spans_ptr + 1)
    run_page, stop = decode_kernel._run_at(table_ptr, 0, seg, end, table_stride_b, PAGE, 4)
    tl.store(out_ptr, run_page)
    tl.store(out_ptr + 1, stop)


def runs_table(lens: torch.Tensor, width: int, start: int = 1) -> torch.Tensor:
    """Each row's pages one run, the rows' runs one after another from page ``start``."""
    table = torch.zeros(len(lens), width, dtype=torch.int32)
    for row, n in enumerate(lens.tolist()):
        pages = -(-n // PAGE)
        table[row, :pages] = torch.arange(start, start + pages, dtype=torch.int32)
        start += pages
    return table


@interpreted
def test_run_at_finds_where_each_run_ends():
    table = torch.tensor([[5, 6, 7, 8, 9, 0, 0], [5, 6, 8, 7, 9, 0, 0], [3, 4, 5, 6, 7, 8, 9]], dtype=torch.int32)
    # (row, first token, end) -> (the run's first page, the token it ends at): a whole row; a row
    # broken three times, from each of its runs; a run from inside a page; one page; a run past 4 ids (one
    # scan step of the test's kernel)
    cases = {(0, 0, 80): (5, 80), (1, 0, 80): (5, 32), (1, 32, 80): (8, 48), (1, 48, 80): (7, 64), (1, 64, 80): (9, 80),
             (0, 5, 75): (5, 75), (0, 70, 75): (9, 75), (2, 20, 112): (4, 112), (1, 17, 40): (6, 32)}
    got = {}
    for row, first, end in cases:
        out = torch.empty(2, dtype=torch.int32)
        _run_at_kernel[(1,)](table[row:row + 1], torch.tensor([first, end], dtype=torch.int32), out,
                             table.stride(0), PAGE=PAGE)
        got[row, first, end] = tuple(out.tolist())
    assert got == cases


@interpreted
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["tiles", "words"])
@pytest.mark.parametrize("tables", ["runs", "broken", "past the pool", "fragmented"])
def test_page_runs_read_what_the_table_reads(dtype, tables, monkeypatch):
    gen = torch.Generator().manual_seed(7)
    q, k8, _, _, _, _, lens, sinks = decode_fp8_case(gen, CONFIG, LENGTHS, dtype=dtype)
    # keys of no dominant score (the case's few keys past 448 would each hide a row's other pages)
    k8, v8 = (to_kv(torch.randn(k8.shape, generator=gen) * 0.3, k8.dtype) for _ in range(2))
    num_pages = k8.shape[0]
    width = -(-max(LENGTHS) // PAGE)
    table = runs_table(lens, width)
    assert table.max() < num_pages
    longest = int(lens.argmax())
    n = -(-int(lens[longest]) // PAGE)
    if tables == "broken":  # the longest row's fourth page is the first row's first
        table[longest, 3] = table[0, 0]
    elif tables == "past the pool":  # the longest row's run goes on past the last page
        table[longest, :n] = torch.arange(num_pages - n + 2, num_pages + 2, dtype=torch.int32)
    elif tables == "fragmented":  # the longest row's pages in reverse: a run a page, past MAX_RUNS
        assert n > decode_kernel.MAX_RUNS + 2
        table[longest, :n] = table[longest, :n].flip(0)
    whole_runs = tables in ("runs", "past the pool")
    for splits in (None, 1, 3):
        monkeypatch.setattr(triton_decode, "PAGE_RUNS", False)
        want = decode(q, k8, v8, table, lens, CONFIG, sinks, splits)
        monkeypatch.setattr(triton_decode, "PAGE_RUNS", True)
        got = decode(q, k8, v8, table, lens, CONFIG, sinks, splits)
        assert torch.isfinite(got).all(), splits
        if whole_runs:  # the same blocks in the same order
            assert torch.equal(got, want), (splits, rel_err(got, want))
        else:  # blocks start where runs do: the sums round apart
            assert rel_err(got, want) < (1e-6 if dtype == torch.float32 else 2e-3), (splits, rel_err(got, want))
    if tables != "past the pool":  # the twin reads the table as it is
        twin = decode(q, k8, v8, table, lens, CONFIG, sinks, backend="eager")
        assert rel_err(got, twin) < (1e-5 if dtype == torch.float32 else 2e-2)
