"""A decode split whose pages are one ascending run of the pool reads them without its page table
(``triton_decode.PAGE_RUNS``), interpreted on the CPU: ``_one_run`` finds runs and only runs, and
the output equals the table's reading bit for bit, over float8 pools read as tiles (float32 queries)
and as words (float16 queries), for rows that are runs, runs broken by another row's page, and runs that
would pass the pool's end (which the table's reading clamps)."""
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
def _one_run_kernel(table_ptr, spans_ptr, out_ptr, table_stride_b, num_pages, PAGE: tl.constexpr):
    b = tl.program_id(0)
    first, end = tl.load(spans_ptr + 2 * b), tl.load(spans_ptr + 2 * b + 1)
    run, run_page = decode_kernel._one_run(table_ptr, b, first, end, table_stride_b, num_pages, PAGE, 4)
    tl.store(out_ptr + 2 * b, run.to(tl.int32))
    tl.store(out_ptr + 2 * b + 1, run_page)


def runs_table(lens: torch.Tensor, width: int, start: int = 1) -> torch.Tensor:
    """Each row's pages one run, the rows' runs one after another from page ``start``."""
    table = torch.zeros(len(lens), width, dtype=torch.int32)
    for row, n in enumerate(lens.tolist()):
        pages = -(-n // PAGE)
        table[row, :pages] = torch.arange(start, start + pages, dtype=torch.int32)
        start += pages
    return table


@interpreted
def test_one_run_finds_runs_and_only_runs():
    table = torch.tensor([[5, 6, 7, 8, 9, 0], [5, 6, 8, 7, 9, 0], [3, 4, 5, 6, 7, 8], [0, 0, 0, 0, 0, 0]],
                         dtype=torch.int32)
    # (row, first token, end, pages in the pool): a whole run; a span inside a broken row before the
    # break and one across it; a run past the pool's last page (8 of a pool of 8); one in it; no tokens
    spans = [(0, 0, 80, 10), (1, 0, 32, 10), (1, 16, 48, 10), (2, 0, 96, 8), (2, 0, 80, 8), (3, 5, 5, 8)]
    out = []
    for row, first, end, num_pages in spans:
        got = torch.empty(2, dtype=torch.int32)
        _one_run_kernel[(1,)](table[row:row + 1], torch.tensor([first, end], dtype=torch.int32), got,
                              table.stride(0), num_pages, PAGE=PAGE)
        out.append(got.tolist())
    assert [run for run, _ in out] == [1, 1, 0, 0, 1, 0], out
    assert out[0][1] == 5 and out[2][1] == 6 and out[4][1] == 3, out


@interpreted
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["tiles", "words"])
@pytest.mark.parametrize("tables", ["runs", "broken", "past the pool"])
def test_page_runs_read_what_the_table_reads(dtype, tables, monkeypatch):
    gen = torch.Generator().manual_seed(7)
    q, k8, _, _, _, _, lens, sinks = decode_fp8_case(gen, CONFIG, LENGTHS, dtype=dtype)
    # keys of no dominant score (the case's few keys past 448 would each hide a row's other pages)
    k8, v8 = (to_kv(torch.randn(k8.shape, generator=gen) * 0.3, k8.dtype) for _ in range(2))
    num_pages = k8.shape[0]
    width = -(-max(LENGTHS) // PAGE)
    table = runs_table(lens, width)
    assert table.max() < num_pages
    if tables == "broken":  # the longest row's fourth page is the first row's first
        longest = int(lens.argmax())
        table[longest, 3] = table[0, 0]
    elif tables == "past the pool":  # the longest row's run goes on past the last page
        longest = int(lens.argmax())
        n = -(-int(lens[longest]) // PAGE)
        table[longest, :n] = torch.arange(num_pages - n + 2, num_pages + 2, dtype=torch.int32)
    for splits in (None, 1, 3):
        monkeypatch.setattr(triton_decode, "PAGE_RUNS", False)
        want = decode(q, k8, v8, table, lens, CONFIG, sinks, splits)
        monkeypatch.setattr(triton_decode, "PAGE_RUNS", True)
        got = decode(q, k8, v8, table, lens, CONFIG, sinks, splits)
        assert torch.isfinite(got).all() and torch.equal(got, want), (splits, rel_err(got, want))
    if tables != "past the pool":  # the twin reads the table as it is
        twin = decode(q, k8, v8, table, lens, CONFIG, sinks, backend="eager")
        assert rel_err(got, twin) < (1e-5 if dtype == torch.float32 else 2e-2)
