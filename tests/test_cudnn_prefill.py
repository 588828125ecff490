"""The cuDNN prefill path (``worker.attention.cudnn_prefill``): the composition (gather the prefix's
pages, dense attentions over its pieces and a causal part, each with its log-sum-exp, merge) against
the paged twin, on the CPU with the eager softmax in cuDNN's place and on a GPU with cuDNN itself;
the merge kernel against its twin; the host checks; that warm-up plans every shape a later prefix
launches; which batches take the path; and the "triton" backend through it on a tiny model."""
from __future__ import annotations

import os
import weakref

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from tests.test_prefill_attention import assert_backends_agree, prefill_case, rel_err  # noqa: E402
from worker.attention import cudnn_prefill  # noqa: E402
from worker.attention.cudnn_prefill import (cached_prefix_attention, dense_attention, merge_pair,  # noqa: E402
                                            merge_pair_eager, usable)
from worker.attention.triton_prefill import paged_prefill_attention_eager  # noqa: E402

interpreted = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs TRITON_INTERPRET=1")


def composed_case(gen, heads, kv_heads, D, page, rows, dtype, device):
    """``prefill_case`` plus the chunk's own K/V as the model hands them over (read from the pages)."""
    q, k_cache, v_cache, table, lens, q_lens = prefill_case(gen, heads, kv_heads, D, page, rows, dtype, device)
    prefixes = [p for p, _ in rows]
    new = [torch.cat([c[table[b]].flatten(0, 1)[p:p + n] for b, (p, n) in enumerate(rows)]) for c in (k_cache, v_cache)]
    return q, *new, k_cache, v_cache, table, lens, q_lens, prefixes


def as_runs(k_cache, v_cache, table, rows, page):
    """The same keys and values with each row's pages moved into one ascending run (row 0's from
    page 1 on, then row 1's, ...), as the pool hands a single session its pages: the caches, the
    table and each row's ``prefix_run``."""
    k_runs, v_runs, runs_table = k_cache.clone(), v_cache.clone(), table.clone()
    first = 1
    for b, (prefix, n) in enumerate(rows):
        need = -(-(prefix + n) // page)
        moved = torch.arange(first, first + need, device=table.device)
        k_runs[moved], v_runs[moved] = k_cache[table[b, :need]], v_cache[table[b, :need]]
        runs_table[b, :need] = moved
        first += need
    runs = [cudnn_prefill.prefix_run(row.tolist(), p, k_cache.shape[0], page) for row, (p, _) in zip(runs_table, rows)]
    return k_runs, v_runs, runs_table, runs


CPU_CASES = [  # heads, kv_heads, D, page, rows (prefix, q_len): GQA 1/4/8, prefixes off the page, ragged
    (4, 4, 16, 4, [(9, 5), (0, 3), (30, 1)]),
    (8, 2, 32, 4, [(13, 17), (1, 2)]),
    (16, 2, 16, 8, [(70, 33), (0, 9), (8, 8)]),
    (4, 2, 16, 4, [(21, 16), (3, 32)]),  # rows that fill their query bucket: nothing padded
]


@pytest.mark.parametrize("block", [4096, 4, 8], ids=lambda b: f"block{b}")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", CPU_CASES, ids=lambda c: f"gqa{c[0] // c[1]}")
def test_composition_matches_paged_twin_on_cpu(case, dtype, block, monkeypatch):
    """Prefix blocks of 4096 (no pieces: one causal part), 4 and 8 keys (one to four pieces and a
    remainder, merged in pairs or stacked)."""
    monkeypatch.setattr(cudnn_prefill, "PREFIX_BLOCK", block)
    heads, kv_heads, D, page, rows = case
    assert_composition_matches_paged_twin(torch.Generator().manual_seed(heads * D), heads, kv_heads, D, page, rows,
                                          dtype)


def assert_composition_matches_paged_twin(gen, heads, kv_heads, D, page, rows, dtype):
    """On the CPU: within 1e-5 in float32, 1e-2 relative in bf16."""
    q, k, v, k_cache, v_cache, table, lens, q_lens, prefixes = composed_case(gen, heads, kv_heads, D, page, rows,
                                                                             dtype, "cpu")
    out = cached_prefix_attention(q, k, v, k_cache, v_cache, table, q_lens, prefixes, D ** -0.5)
    want = paged_prefill_attention_eager(q, k_cache, v_cache, table, lens, q_lens, D ** -0.5)
    if dtype == torch.float32:
        torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
    else:
        assert rel_err(out, want) < 1e-2


@interpreted
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_composition_through_the_merge_kernels_interpreted(dtype, monkeypatch):
    """The merges as Triton runs them (interpreted): rows of one part, two (``merge_pair``) and up
    to four stacked in the prefix's dtype (``merge_splits``), against the paged twin."""
    from moe_offload.kernels.triton_support import BACKEND_ENV

    monkeypatch.setenv(BACKEND_ENV, "triton")
    monkeypatch.setattr(cudnn_prefill, "PREFIX_BLOCK", 4)
    rows = [(30, 5), (2, 3), (4, 6), (13, 4)]  # 4, 1, 2 and 3 parts
    assert_composition_matches_paged_twin(torch.Generator().manual_seed(11), 8, 2, 16, 4, rows, dtype)


def test_the_stacked_merge_frees_each_part_before_the_next_is_computed():
    """Beside the stack, one part's output at a time (what the memory plan counts)."""
    refs, alive = [], []

    def part():
        o = torch.randn(3, 2, 4)
        refs.append(weakref.ref(o))
        return o, torch.randn(3, 2)

    def parts():
        for _ in range(4):
            alive.append(sum(r() is not None for r in refs))
            yield part()

    out = torch.empty(3, 2, 4)
    cudnn_prefill._merge(parts(), 4, out)
    assert alive == [0, 0, 0, 0] and torch.isfinite(out).all()


def test_dense_attention_twin_returns_the_log_sum_exp():
    """The CPU twin's lse is log sum_j exp(s_ij) of the visible keys (top-left causal)."""
    gen = torch.Generator().manual_seed(2)
    q, k, v = torch.randn(1, 4, 5, 8, generator=gen), torch.randn(1, 2, 5, 8, generator=gen), torch.randn(1, 2, 5, 8,
                                                                                                           generator=gen)
    o, lse = dense_attention(q, k, v, True, 0.5)
    scores = q @ k.repeat_interleave(2, 1).transpose(-1, -2) * 0.5
    torch.testing.assert_close(lse[0, 1, 2, 0], torch.logsumexp(scores[0, 1, 2, :3], 0))
    torch.testing.assert_close(o[0, 3, 0], v[0, 1, 0])  # query 0 sees key 0 only


@pytest.mark.parametrize("backend", ["eager", pytest.param("triton", marks=interpreted)])
def test_merge_pair_weighs_the_parts_by_their_lse(backend):
    """Strided parts (as cuDNN returns them), 35 rows (not a multiple of the merge block), D not a
    power of two, written into a strided view only; a part with lse far below the other weighs nothing."""
    gen = torch.Generator().manual_seed(5)
    n, heads, D = 7, 5, 24
    o1, o2 = (torch.randn(heads, n, D, generator=gen).transpose(0, 1) for _ in range(2))
    lse1, lse2 = (torch.randn(heads, n, generator=gen).t() * 10 for _ in range(2))
    lse1[3, 2] = -1e4
    full = torch.zeros(n, heads + 2, D)
    out = merge_pair(o1, lse1, o2, lse2, full[:, 1:heads + 1], backend=backend)
    w1 = 1 / (1 + torch.exp(lse2 - lse1))
    torch.testing.assert_close(out, w1[..., None] * o1 + (1 - w1[..., None]) * o2, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out[3, 2], o2[3, 2])
    torch.testing.assert_close(out, merge_pair_eager(o1, lse1, o2, lse2), rtol=1e-5, atol=1e-5)
    assert not full[:, 0].any() and not full[:, heads + 1].any()


def test_query_buckets_are_few_and_pad_at_most_an_eighth():
    """Every length maps to a bucket at least as long and, from 128 rows on, at most 1/8 longer;
    buckets are fixed points; a 2k-token turn and a 4,000-token prompt take their own buckets; a
    prefill of up to 8k rows within 256k tokens reaches 41 buckets."""
    from worker.attention.cudnn_prefill import query_bucket, query_buckets

    for n in range(1, 9000):
        b = query_bucket(n)
        assert b >= n and b % 16 == 0 and query_bucket(b) == b
        assert n < 128 or b * 8 <= n * 9
    assert [query_bucket(n) for n in (2048, 2064, 4000)] == [2048, 2304, 4096]
    buckets = query_buckets(8192, 1 << 18)
    assert buckets[0] == 256 and buckets[-1] == 8192 and len(buckets) == 41
    assert all(query_bucket(n) in buckets for n in range(256, 8193))  # every length the path takes
    assert query_buckets(2048, 1 << 15) == [2048]  # 2k x 32k is the least work the path takes


def test_prefix_pieces_are_the_binary_digits_of_its_blocks():
    from worker.attention.cudnn_prefill import piece_lengths, prefix_pieces

    assert prefix_pieces(131072) == [(0, 131072)]
    assert prefix_pieces(100003) == [(0, 65536), (65536, 32768)]  # and 1,699 keys for the causal part
    assert prefix_pieces(4095) == [] and prefix_pieces(12288) == [(0, 8192), (8192, 4096)]
    assert piece_lengths(140000) == [4096, 8192, 16384, 32768, 65536, 131072] and piece_lengths(4095) == []
    for prefix in range(0, 300000, 997):
        pieces = prefix_pieces(prefix)
        assert all(length in piece_lengths(prefix) for _, length in pieces)
        assert [first for first, _ in pieces] == [sum(x for _, x in pieces[:i]) for i in range(len(pieces))]
        assert 0 <= prefix - sum(length for _, length in pieces) < cudnn_prefill.PREFIX_BLOCK


def _recording(monkeypatch) -> list[tuple]:
    """Every dense attention's shapes and strides from now on (what cuDNN keys its plans by)."""
    seen = []
    real = cudnn_prefill.dense_attention

    def record(q, k, v, causal, scale):
        seen.append((tuple(q.shape), q.stride(), tuple(k.shape), k.stride(), v.stride(), causal))
        return real(q, k, v, causal, scale)

    monkeypatch.setattr(cudnn_prefill, "dense_attention", record)
    return seen


def test_warm_plans_runs_every_piece_and_causal_bucket_over_the_pool(monkeypatch):
    """Warm-up runs each query bucket over each piece length and each causal bucket once, reading
    the pool's pages only (the pool is unchanged)."""
    monkeypatch.setattr(cudnn_prefill, "MIN_PREFIX_WORK", 1 << 10)
    monkeypatch.setattr(cudnn_prefill, "PREFIX_BLOCK", 8)
    seen = _recording(monkeypatch)
    k_cache, v_cache = torch.randn(2, 40, 4, 2, 16).unbind(0)  # 40 pages of 4 tokens, page 0 the scratch
    before = (k_cache.clone(), v_cache.clone())
    ran = cudnn_prefill.warm_plans(8, k_cache, v_cache, 64, 10_000, 0.25)
    assert cudnn_prefill.query_buckets(64, 39 * 4) == [16, 32, 48, 64]
    assert ran == 4 * 5 + 5 == len(seen)
    assert [(q[2], k[2]) for q, _, k, _, _, causal in seen if not causal] == [
        (n, keys) for n in (16, 32, 48, 64) for keys in (8, 16, 32, 64, 128)]
    assert [q[2] for q, _, k, _, _, causal in seen if causal] == [16, 32, 48, 64, 80]  # up to 64 rows after 7 keys
    assert torch.equal(k_cache, before[0]) and torch.equal(v_cache, before[1])


def test_warm_plans_compiles_both_merges(monkeypatch):
    """A prefix of two pieces and a remainder merges three parts (``merge_splits``), of one piece
    two (``merge_pair``): warm-up runs both kernels once, so serving compiles neither."""
    monkeypatch.setattr(cudnn_prefill, "MIN_PREFIX_WORK", 1 << 10)
    monkeypatch.setattr(cudnn_prefill, "PREFIX_BLOCK", 8)
    merged = []
    monkeypatch.setattr(cudnn_prefill, "merge_pair", lambda *a: merged.append(2))
    monkeypatch.setattr(cudnn_prefill, "merge_splits", lambda o, lse, out: merged.append(o.shape[0]))
    k_cache, v_cache = torch.randn(2, 40, 4, 2, 16).unbind(0)
    cudnn_prefill.warm_plans(8, k_cache, v_cache, 64, 10_000, 0.25)
    assert merged == [2, 3]


@pytest.mark.parametrize("block", [8, 16])
def test_every_shape_a_prefill_launches_was_planned_by_the_warm_up(monkeypatch, block):
    """After warm-up, chunks of any length over any prefix the path takes (within the pool and
    ``max_q``) launch only shapes and strides that warm-up ran: no plan is built while serving."""
    monkeypatch.setattr(cudnn_prefill, "MIN_PREFIX_WORK", 1 << 9)
    monkeypatch.setattr(cudnn_prefill, "PREFIX_BLOCK", block)
    seen = _recording(monkeypatch)
    heads, kv_heads, D, page, max_q = 4, 2, 8, 4, 40
    gen = torch.Generator().manual_seed(5)
    k_cache, v_cache = torch.randn(2, 64, page, kv_heads, D, generator=gen).unbind(0)
    cudnn_prefill.warm_plans(heads, k_cache, v_cache, max_q, 10_000, 0.5)
    planned = set(seen)
    for prefix, n in [(13, 40), (100, 7), (127, 33), (64, 9), (201, 3), (222, 30)]:
        assert n * prefix >= cudnn_prefill.MIN_PREFIX_WORK
        table = torch.randperm(63, generator=gen)[None, :-(-(prefix + n) // page)].int() + 1
        q = torch.randn(n, heads, D, generator=gen)
        k, v = torch.randn(2, n, kv_heads, D, generator=gen).unbind(0)
        seen.clear()
        cudnn_prefill.cached_prefix_attention(q, k, v, k_cache, v_cache, table, [n], [prefix], 0.5)
        assert seen and set(seen) <= planned, (prefix, n, set(seen) - planned)


def test_host_checks_raise():
    gen = torch.Generator().manual_seed(0)
    q, k, v, k_cache, v_cache, table, _, q_lens, prefixes = composed_case(gen, 4, 2, 8, 4, [(5, 3), (2, 2)],
                                                                          torch.float32, "cpu")
    with pytest.raises(ValueError, match="q_lens"):
        cached_prefix_attention(q, k, v, k_cache, v_cache, table, [3, 1], prefixes, 1.0)
    with pytest.raises(ValueError, match="prefix \\+ q_len"):
        cached_prefix_attention(q, k, v, k_cache, v_cache, table, q_lens, [5, table.shape[1] * 4], 1.0)
    with pytest.raises(ValueError, match="do not match"):
        cached_prefix_attention(q, k[:, :1], v[:, :1], k_cache, v_cache, table, q_lens, prefixes, 1.0)
    with pytest.raises(ValueError, match="share a dtype"):
        cached_prefix_attention(q, k.double(), v, k_cache, v_cache, table, q_lens, prefixes, 1.0)
    with pytest.raises(ValueError, match="do not match out"):
        merge_pair(q, q[..., 0], q, q[..., 0], q[:, :1])


def test_a_prefix_run_is_its_first_page_when_its_pages_ascend_inside_the_pool():
    assert cudnn_prefill.prefix_run([5, 6, 7, 2], 9, 10, 4) == 5  # 3 pages hold 9 tokens; the 4th is the chunk's
    assert cudnn_prefill.prefix_run([5, 6, 7], 12, 10, 4) == 5 and cudnn_prefill.prefix_run([7, 8, 9], 12, 10, 4) == 7
    assert cudnn_prefill.prefix_run([5, 7, 8], 9, 10, 4) == -1  # a gap
    assert cudnn_prefill.prefix_run([5, 4, 7], 9, 10, 4) == -1  # the ends agree, the middle does not
    assert cudnn_prefill.prefix_run([0, 1, 2], 9, 10, 4) == -1  # the scratch page
    assert cudnn_prefill.prefix_run([8, 9, 10], 9, 10, 4) == -1  # past the pool
    assert cudnn_prefill.prefix_run([3, 4], 9, 10, 4) == -1  # a table shorter than the prefix
    assert cudnn_prefill.prefix_run([3, 4], 0, 10, 4) == -1  # no prefix


@pytest.mark.parametrize("block", [4096, 4], ids=lambda b: f"block{b}")
def test_a_prefix_in_one_run_of_pages_is_read_where_it_lies(block, monkeypatch):
    """Rows whose pages are one run take no gather and give the gathered rows' output exactly (the
    same keys at the same strides); a row without a run (-1) is gathered beside them."""
    monkeypatch.setattr(cudnn_prefill, "PREFIX_BLOCK", block)
    gen = torch.Generator().manual_seed(11)
    rows = [(70, 33), (0, 9), (13, 17)]
    q, k, v, k_cache, v_cache, table, lens, q_lens, prefixes = composed_case(gen, 8, 2, 16, 4, rows,
                                                                             torch.float32, "cpu")
    k_runs, v_runs, runs_table, runs = as_runs(k_cache, v_cache, table, rows, 4)
    assert runs == [1, -1, 30]  # rows 0 and 1 hold pages 1..26 and 27..29 (103 and 9 tokens); row 1 no prefix
    gathered = cached_prefix_attention(q, k, v, k_runs, v_runs, runs_table, q_lens, prefixes, 0.25)
    gathers, real = [], cudnn_prefill._gathered
    monkeypatch.setattr(cudnn_prefill, "_gathered", lambda *a: gathers.append(a[2]) or real(*a))
    in_place = cached_prefix_attention(q, k, v, k_runs, v_runs, runs_table, q_lens, prefixes, 0.25,
                                       runs=[1, -1, -1])
    assert gathers == [0, 0, 13, 13]  # row 0 read in place; rows 1 and 2 through the gather (K, V; row 1's empty)
    assert torch.equal(in_place, gathered)
    want = paged_prefill_attention_eager(q, k_runs, v_runs, runs_table, lens, q_lens, 0.25)
    assert rel_err(cached_prefix_attention(q, k, v, k_runs, v_runs, runs_table, q_lens, prefixes, 0.25, runs=runs),
                   want) < 1e-5


def test_runs_are_checked_against_the_pool_on_the_host():
    gen = torch.Generator().manual_seed(0)
    q, k, v, k_cache, v_cache, table, _, q_lens, prefixes = composed_case(gen, 4, 2, 8, 4, [(5, 3), (2, 2)],
                                                                          torch.float32, "cpu")
    with pytest.raises(ValueError, match="runs"):  # past the pool's last page
        cached_prefix_attention(q, k, v, k_cache, v_cache, table, q_lens, prefixes, 1.0, runs=[k_cache.shape[0], -1])
    with pytest.raises(ValueError, match="runs"):  # one a row
        cached_prefix_attention(q, k, v, k_cache, v_cache, table, q_lens, prefixes, 1.0, runs=[1])
    with pytest.raises(ValueError, match="runs"):  # a pool that is not contiguous
        cached_prefix_attention(q, k, v, k_cache, v_cache.transpose(2, 3).contiguous().transpose(2, 3), table,
                                q_lens, prefixes, 1.0, runs=[1, -1])


def test_page_ids_past_the_pool_are_clamped_not_read():
    """A garbage page id in the table (device data) reads a page of the pool, never outside it."""
    gen = torch.Generator().manual_seed(1)
    q, k, v, k_cache, v_cache, table, _, q_lens, prefixes = composed_case(gen, 4, 2, 8, 4, [(6, 2)],
                                                                          torch.float32, "cpu")
    table[0, 0] = 10**6
    out = cached_prefix_attention(q, k, v, k_cache, v_cache, table, q_lens, prefixes, 1.0)
    assert torch.isfinite(out).all()


def test_only_large_prefix_work_on_a_gpu_takes_the_path():
    q = torch.zeros(8, 4, 128, dtype=torch.bfloat16)
    assert not usable(q, [8], [1 << 20])  # a CPU tensor
    if torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9:
        q = q.cuda()
        assert usable(q, [8], [cudnn_prefill.MIN_PREFIX_WORK // 8])
        assert not usable(q, [8], [cudnn_prefill.MIN_PREFIX_WORK // 8 - 1])
        assert not usable(q.float(), [8], [1 << 20])  # float32 stays on the paged kernel
        assert not usable(q[..., :96], [8], [1 << 20])


def test_triton_backend_through_the_composition_matches_torch(tmp_path, monkeypatch):
    """Every prefill batch with a cached prefix forced through the composition (on the CPU: the
    eager softmax in cuDNN's place) gives the torch backend's logits."""
    monkeypatch.setenv("SLUICE_KERNELS", "eager")
    calls = []
    monkeypatch.setattr(cudnn_prefill, "usable", lambda q, q_lens, prefixes: calls.append(prefixes) or True)
    assert_backends_agree(tmp_path)
    assert calls == [[10, 71, 0], [72, 3, 50]]  # decided once per batch with a cached prefix, not per layer


@pytest.mark.parametrize("kernels", ["eager", pytest.param("triton", marks=interpreted)])
def test_rows_below_the_warmed_buckets_take_the_paged_kernel_beside_the_composition(tmp_path, monkeypatch, kernels):
    """After a warm-up whose least query bucket is 32, a row of fewer queries in a batch on the cuDNN
    path goes to the paged kernel (as a batch of its own rows) and the rest to the composition;
    the logits are the torch backend's."""
    from worker.attention import triton_backend

    monkeypatch.setenv("SLUICE_KERNELS", kernels)
    monkeypatch.setattr(triton_backend.TritonAttention, "min_rows", 32)
    monkeypatch.setattr(cudnn_prefill, "usable", lambda q, q_lens, prefixes: True)
    skipped, paged, ran = [], [], []
    real_cudnn, real_paged = cudnn_prefill.cached_prefix_attention, triton_backend.paged_prefill_attention

    def cudnn(*args, skip=(), runs=()):
        skipped.append(list(skip))
        ran.append(list(runs))
        return real_cudnn(*args, skip=skip, runs=runs)

    def paged_kernel(q, k_cache, v_cache, table, seq_lens, q_lens, scale, **kw):
        paged.append(list(q_lens))
        return real_paged(q, k_cache, v_cache, table, seq_lens, q_lens, scale, **kw)

    monkeypatch.setattr(cudnn_prefill, "cached_prefix_attention", cudnn)
    monkeypatch.setattr(triton_backend, "paged_prefill_attention", paged_kernel)
    assert_backends_agree(tmp_path)
    # rows (40, 1, 3) over prefixes (10, 71, 0), then (1, 66, 1) over (72, 3, 50); two layers each
    assert skipped == [[1, 2]] * 2 + [[0, 2]] * 2
    assert paged == [[1, 3]] * 2 + [[1, 1]] * 2
    # each sequence's 25 pages are one run (1.., 26.., 51..): every prefix is read in place
    assert ran == [[26, 1, -1]] * 2 + [[1, 51, 26]] * 2


def test_the_backends_warm_up_sets_the_least_rows_it_planned(monkeypatch):
    from types import SimpleNamespace

    from worker.attention.triton_backend import TritonAttention

    monkeypatch.setattr(cudnn_prefill, "MIN_PREFIX_WORK", 1 << 10)
    monkeypatch.setattr(cudnn_prefill, "PREFIX_BLOCK", 8)
    monkeypatch.setattr(cudnn_prefill, "supported", lambda device, dtype, head_dim: True)
    k_cache, v_cache = torch.randn(2, 40, 4, 2, 16).unbind(0)
    backend = TritonAttention(SimpleNamespace(k=[k_cache], v=[v_cache], dtype=k_cache.dtype), 0.25)
    assert backend.min_rows == 0  # before: every row of a batch on the path takes it
    assert backend.warm_plans(8, 64, 10_000) == 4 * 5 + 5
    assert backend.min_rows == 16 == cudnn_prefill.warm_buckets(k_cache, 64, 10_000)[0]
    monkeypatch.setattr(cudnn_prefill, "MIN_PREFIX_WORK", 1 << 12)  # 4096 / 156 keys: 27 rows at least
    assert backend.warm_plans(8, 64, 10_000) == 3 * 5 + 4 and backend.min_rows == 32


def test_a_refusal_by_cudnn_falls_back_to_the_paged_kernel_for_good(tmp_path, monkeypatch, caplog):
    """cuDNN refusing a call (as it does on the host when it cannot build a plan) is logged once;
    that batch and every later one take the paged kernel, with the same logits."""
    monkeypatch.setenv("SLUICE_KERNELS", "eager")
    calls = []
    monkeypatch.setattr(cudnn_prefill, "usable", lambda q, q_lens, prefixes: True)

    def refuse(q, k, v, causal, scale):
        calls.append(causal)
        raise cudnn_prefill.CudnnRefused("cuDNN attention refused (test)")

    monkeypatch.setattr(cudnn_prefill, "dense_attention", refuse)
    assert_backends_agree(tmp_path)
    assert calls == [True]  # the first row of the first batch with a prefix, then never again
    assert caplog.text.count("the paged kernel takes every prefill from now on") == 1


GPU_CASES = [  # heads, kv_heads, D, page, rows: GQA 1/4/8, ragged, prefixes and chunks off the tile and page
    (8, 8, 128, 16, [(20003, 77), (3001, 1)]),
    (32, 4, 128, 16, [(3000, 2048), (0, 33), (130, 500)]),  # Qwen3-30B-A3B's geometry
    (32, 4, 64, 16, [(40001, 300)]),
    (16, 2, 128, 16, [(100003, 64), (5000, 1)]),
]


@pytest.mark.cuda
@pytest.mark.parametrize("pages", ["permuted", "runs"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("case", GPU_CASES, ids=lambda c: f"gqa{c[0] // c[1]}-d{c[2]}")
def test_composition_matches_paged_twin_on_gpu(case, dtype, pages):
    """cuDNN's kernels and the merge kernel against the paged twin, with no sync inside the call
    (trial 0 builds cuDNN's plans and compiles the merge): prefixes gathered from permuted pages,
    and read in place from runs of pages (views into the pool at a page's offset)."""
    heads, kv_heads, D, page, rows = case
    gen = torch.Generator().manual_seed(heads + D)
    for trial in range(2):
        q, k, v, k_cache, v_cache, table, lens, q_lens, prefixes = composed_case(gen, heads, kv_heads, D, page, rows,
                                                                                 dtype, "cuda")
        runs = []
        if pages == "runs":
            k_cache, v_cache, table, runs = as_runs(k_cache, v_cache, table, rows, page)
        torch.cuda.set_sync_debug_mode("error" if trial else "default")
        try:
            out = cached_prefix_attention(q, k, v, k_cache, v_cache, table, q_lens, prefixes, D ** -0.5, runs=runs)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        want = paged_prefill_attention_eager(q, k_cache, v_cache, table, lens, q_lens, D ** -0.5)
        assert torch.isfinite(out).all()
        assert rel_err(out, want) < 1e-2


@pytest.mark.cuda
def test_merge_pair_kernel_matches_twin_on_gpu():
    gen = torch.Generator(device="cuda").manual_seed(3)
    n, heads, D = 300, 32, 128
    o1, o2 = (torch.randn(heads, n, D, device="cuda", generator=gen).bfloat16().transpose(0, 1) for _ in range(2))
    lse1, lse2 = (torch.randn(heads, n, device="cuda", generator=gen).t() * 5 for _ in range(2))
    out = torch.empty(n, heads, D, dtype=torch.bfloat16, device="cuda")
    torch.cuda.set_sync_debug_mode("error")
    try:
        merge_pair(o1, lse1, o2, lse2, out)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.testing.assert_close(out.float(), merge_pair_eager(o1, lse1, o2, lse2), rtol=1e-2, atol=1e-2)


def twin_windows(q, k_cache, v_cache, table, lens, q_lens, scale, width=256):
    """The paged twin over each row's first and last ``width`` queries (a window of queries is a row
    of its own whose prefix reaches the window), as ``(row, start in the packed q, window, output)``:
    the whole twin of a 2k-query row over a 40k prefix would hold 10 GB of scores."""
    out, start = [], 0
    for b, n in enumerate(q_lens):
        for lo in sorted({0, max(n - width, 0)}):
            hi = min(lo + width, n)
            seq = torch.tensor([int(lens[b]) - n + hi], device=q.device)
            out.append((b, start + lo, hi - lo, paged_prefill_attention_eager(
                q[start + lo:start + hi], k_cache, v_cache, table[b:b + 1], seq, [hi - lo], scale)))
        start += n
    return out


@pytest.mark.cuda
@pytest.mark.parametrize("pages", ["permuted", "runs"])
def test_rows_below_the_warmed_buckets_beside_the_composition_on_gpu(pages):
    """The "triton" backend's cuDNN path with rows below its least planned bucket (``SmallRows``:
    one query, seven) beside rows it takes (2,048 and 300 queries): both parts land in one output,
    equal to the paged twin (over each row's first and last queries), with no sync from the batch's
    plan to the output (trial 0 builds cuDNN's plans and compiles the kernels)."""
    from types import SimpleNamespace

    from worker.attention.triton_backend import TritonAttention
    from worker.batch import ForwardBatch

    heads, kv_heads, D, page = 32, 4, 128, 16
    rows = [(40001, 2048), (5000, 1), (130, 7), (20003, 300)]
    gen = torch.Generator().manual_seed(11)
    for trial in range(2):
        q, k, v, k_cache, v_cache, table, lens, q_lens, prefixes = composed_case(gen, heads, kv_heads, D, page, rows,
                                                                                 torch.bfloat16, "cuda")
        if pages == "runs":
            k_cache, v_cache, table, _ = as_runs(k_cache, v_cache, table, rows, page)
        backend = TritonAttention(SimpleNamespace(k=[k_cache], v=[v_cache]), D ** -0.5)
        backend.min_rows = 32
        unused = torch.zeros(len(q), dtype=torch.int64, device="cuda")
        batch = ForwardBatch(unused, unused, unused, unused, table, lens, len(q), False, q_lens=q_lens,
                             seq_lens_host=lens.tolist(), page_table_host=table.tolist())
        torch.cuda.set_sync_debug_mode("error" if trial else "default")
        try:
            out = backend.forward(0, q, k, v, batch)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        assert backend._plan.blocks is None and backend._plan.small.rows == [1, 2]
        if pages == "runs":  # read in place
            assert min(backend._plan.runs) > 0
        assert torch.isfinite(out).all()
        for b, start, n, want in twin_windows(q, k_cache, v_cache, table, lens, q_lens, D ** -0.5):
            assert rel_err(out[start:start + n], want) < 1e-2, f"row {b}, queries from {start}"
