"""The paged Triton prefill attention against its eager twin (interpreted on the CPU, compiled on a
GPU), split-KV on and off, the merge by log-sum-exp and the split count, the twin against SDPA with a
bottom-right causal mask, the clamps of device data, the host checks, the block list, the tile table,
and the "triton" backend's prefill against the torch backend on a tiny model."""
from __future__ import annotations

import itertools
import math
import os

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

# The interpreter is chosen when a kernel is decorated, i.e. when the kernel is first built, which
# happens lazily inside the tests; on a GPU the kernels must compile instead.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from tests.tiny_models import write_tiny  # noqa: E402
from worker.attention import triton_prefill  # noqa: E402
from worker.attention.split_kv import (MIN_TILES_PER_SPLIT, merge_splits, merge_splits_eager,  # noqa: E402
                                       multiprocessors, split_count)
from worker.attention.triton_prefill import (TILE, TILES, PrefillTile, block_tokens,  # noqa: E402
                                             paged_prefill_attention, paged_prefill_attention_eager,
                                             prefill_block_table, prefill_blocks, tile_for)
from worker.batch import SequenceChunk  # noqa: E402
from worker.runner import ModelRunner, RunnerConfig  # noqa: E402
from scheduler.messages.to_scheduler import SamplingParams  # noqa: E402

interpreted = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs TRITON_INTERPRET=1")


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12)).item()


def prefill_case(gen, heads, kv_heads, D, page, rows, dtype=torch.float32, device="cpu", spare_pages=1):
    """Random q and caches for ``rows`` of ``(prefix, q_len)``. Each row's pages come from one random
    permutation of pages 1.. (page 0 is the pool's scratch page), so they are out of order and
    disjoint; tables are padded with page 0 up to ``spare_pages`` past the longest row."""
    need = [-(-(p + n) // page) for p, n in rows]
    num_pages = sum(need) + 1
    perm = (torch.randperm(num_pages - 1, generator=gen) + 1).tolist()
    table = torch.zeros(len(rows), max(need) + spare_pages, dtype=torch.int64)
    for b, n in enumerate(need):
        table[b, :n] = torch.tensor(perm[:n])
        perm = perm[n:]
    q = torch.randn(sum(n for _, n in rows), heads, D, generator=gen)
    k, v = torch.randn(2, num_pages, page, kv_heads, D, generator=gen)
    lens = torch.tensor([p + n for p, n in rows])
    dev = [t.to(dtype).to(device) for t in (q, k, v)] + [table.to(device), lens.to(device)]
    return (*dev, [n for _, n in rows])


def random_rows(gen, tile=TILE, max_q=150, max_prefix=300):
    """A mixed batch: a fresh prompt (prefix 0), a decode row past several key tiles, and up to
    three more rows whose q_len is 1 a third of the time, in random order."""
    def draw(lo, hi):
        return int(torch.randint(lo, hi + 1, (1,), generator=gen))

    rows = [(0, draw(1, max_q)), (draw(3 * tile.block_n, max_prefix), 1)]
    rows += [(draw(0, max_prefix), 1 if draw(0, 2) == 0 else draw(1, max_q)) for _ in range(draw(0, 3))]
    return [rows[i] for i in torch.randperm(len(rows), generator=gen).tolist()]


def sdpa_reference(q, k_cache, v_cache, table, seq_lens: list[int], q_lens: list[int], scale):
    """Per row: gather its keys, repeat them for each query head, SDPA with the causal mask aligned
    bottom-right (query i of n sees keys up to seq_len - n + i)."""
    group = q.shape[1] // k_cache.shape[2]
    out, start = [], 0
    for b, (n, seq_len) in enumerate(zip(q_lens, seq_lens)):
        keys, values = (c[table[b]].flatten(0, 1)[:seq_len].repeat_interleave(group, 1).transpose(0, 1)
                        for c in (k_cache, v_cache))
        o = F.scaled_dot_product_attention(q[start:start + n].transpose(0, 1), keys, values,
                                           attn_mask=causal_lower_right(n, seq_len), scale=scale)
        out.append(o.transpose(0, 1))
        start += n
    return torch.cat(out)


# ==== the kernel against its twin (CPU, interpreted) ====

KERNEL_CONFIGS = [  # heads, kv_heads, D, page
    (2, 2, 16, 4),  # no GQA
    (4, 2, 32, 8),  # GQA 2
    (8, 1, 64, 16),  # GQA 8 (qwen3's ratio), page 16
    (7, 1, 24, 4),  # odd group (padded to 8), head dim not a power of two
    (6, 2, 16, 8),  # group 3
]
SMALL_TILE = PrefillTile(rows=32, block_n=16)  # more blocks and key tiles per row, more edges


@interpreted
@pytest.mark.parametrize("tile,trials,max_q,max_prefix", [(TILE, 20, 150, 300), (SMALL_TILE, 4, 40, 80)],
                         ids=["default-tile", "small-tile"])
@pytest.mark.parametrize("config", KERNEL_CONFIGS, ids=lambda c: "-".join(map(str, c)))
def test_kernel_matches_twin(config, tile, trials, max_q, max_prefix):
    heads, kv_heads, D, page = config
    gen = torch.Generator().manual_seed(sum(config) + tile.rows)
    for trial in range(trials):  # the interpreter runs a small tile's many programs slowly: fewer, shorter rows
        rows = random_rows(gen, tile, max_q, max_prefix)
        q, k, v, table, lens, q_lens = prefill_case(gen, heads, kv_heads, D, page, rows, spare_pages=trial % 3)
        if trial % 4 == 3:  # int32 tables and lens
            table, lens = table.int(), lens.int()
        out = paged_prefill_attention(q, k, v, table, lens, q_lens, D ** -0.5, tile=tile, backend="triton")
        want = paged_prefill_attention_eager(q, k, v, table, lens, q_lens, D ** -0.5)
        assert torch.isfinite(out).all()
        torch.testing.assert_close(out, want, rtol=1e-4, atol=1e-5, msg=lambda m: f"rows {rows}: {m}")


# ==== split-KV (CPU, interpreted) ====

SPLIT_CONFIGS = [  # heads, kv_heads, D, page: GQA 1, 4 and 8
    (2, 2, 16, 4),
    (8, 2, 32, 8),
    (8, 1, 16, 16),
]
SPLIT_ROWS = [(37, 5), (0, 19), (130, 1), (61, 40), (16, 3)]  # prefixes off the page, chunks off the block


@interpreted
@pytest.mark.parametrize("splits", [1, 2, 5], ids=lambda s: f"split{s}")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("config", SPLIT_CONFIGS, ids=lambda c: f"gqa{c[0] // c[1]}")
def test_split_kernel_matches_twin(config, dtype, splits):
    """Ragged rows through 16-key tiles, so that a row's keys span several splits (5 splits leave
    some rows' splits empty); split-KV on and off give the twin's output."""
    heads, kv_heads, D, page = config
    gen = torch.Generator().manual_seed(splits + heads + D)
    for trial in range(2):
        rows = SPLIT_ROWS if trial == 0 else random_rows(gen, SMALL_TILE, 30, 100)
        q, k, v, table, lens, q_lens = prefill_case(gen, heads, kv_heads, D, page, rows, dtype, spare_pages=trial + 1)
        out = paged_prefill_attention(q, k, v, table, lens, q_lens, D ** -0.5, tile=SMALL_TILE, splits=splits,
                                      backend="triton")
        want = paged_prefill_attention_eager(q, k, v, table, lens, q_lens, D ** -0.5)
        assert torch.isfinite(out).all() and out.dtype == dtype
        if dtype == torch.float32:
            torch.testing.assert_close(out, want, rtol=1e-4, atol=1e-5, msg=lambda m: f"rows {rows}: {m}")
        else:  # the kernel rounds probabilities to bf16 before the PV product, the twin does not
            assert rel_err(out, want) < 1e-2, f"rows {rows}"


@interpreted
@pytest.mark.parametrize("splits", [1, 3], ids=lambda s: f"split{s}")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("config", [SPLIT_CONFIGS[0], SPLIT_CONFIGS[2]], ids=lambda c: f"gqa{c[0] // c[1]}")
def test_split_kernel_matches_twin_qk_ahead(config, dtype, splits):
    """The mask-free loop that scores the next tile first: ranges of one tile and of several, split
    or not (its extra last score is discarded)."""
    heads, kv_heads, D, page = config
    gen = torch.Generator().manual_seed(splits + heads + D + 1)
    q, k, v, table, lens, q_lens = prefill_case(gen, heads, kv_heads, D, page, SPLIT_ROWS, dtype, spare_pages=1)
    tile = SMALL_TILE._replace(qk_ahead=True)
    out = paged_prefill_attention(q, k, v, table, lens, q_lens, D ** -0.5, tile=tile, splits=splits, backend="triton")
    want = paged_prefill_attention_eager(q, k, v, table, lens, q_lens, D ** -0.5)
    if dtype == torch.float32:
        torch.testing.assert_close(out, want, rtol=1e-4, atol=1e-5)
    else:
        assert rel_err(out, want) < 1e-2


@interpreted
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_split_merge_kernel_matches_twin(dtype):
    """Empty splits (lse -1e30) weigh nothing; the output may be a strided view, written only there."""
    gen = torch.Generator().manual_seed(11)
    splits, T, heads, D = 3, 7, 5, 24  # 35 rows: not a multiple of the merge block; D not a power of two
    part_o = torch.randn(splits, T, heads, D, generator=gen)
    part_lse = torch.randn(splits, T, heads, generator=gen) * 20
    part_lse[1, 2:4] = -1e30
    part_lse[:2, 5, 1] = -1e30  # only split 2 saw keys
    full = torch.zeros(T, heads + 3, D, dtype=dtype)
    out = merge_splits(part_o, part_lse, full[:, 1:heads + 1], backend="triton")
    want = merge_splits_eager(part_o, part_lse)
    torch.testing.assert_close(out, want.to(dtype))
    torch.testing.assert_close(out[5, 1], part_o[2, 5, 1].to(dtype))
    assert not full[:, 0].any() and not full[:, heads + 1:].any()


def test_split_merge_twin_is_attention_over_the_union():
    """Partials of disjoint key sets (normalised output, base-2 log-sum-exp of the scaled scores)
    merge into attention over all the keys: the convention the kernel writes them in."""
    gen = torch.Generator().manual_seed(12)
    q = torch.randn(6, 4, 16, generator=gen)
    keys, values = torch.randn(2, 50, 4, 16, generator=gen)
    scores = torch.einsum("nhd,shd->hns", q, keys) * 0.3
    parts = [(0, 7), (7, 31), (31, 50)]
    part_o = torch.stack([torch.einsum("hns,shd->nhd", scores[..., a:b].softmax(-1), values[a:b]) for a, b in parts])
    part_lse = torch.stack([scores[..., a:b].logsumexp(-1).T / math.log(2) for a, b in parts])
    want = torch.einsum("hns,shd->nhd", scores.softmax(-1), values)
    torch.testing.assert_close(merge_splits_eager(part_o, part_lse), want, rtol=1e-5, atol=1e-6)


def test_split_count_fills_the_gpu():
    assert split_count(106, 1000, 132) == 1  # 0.8 of a wave or more: left alone
    assert split_count(64, 2048, 132) == 2  # half a wave doubles to 128 of 132 SMs
    assert split_count(4, 1562, 132) == 29  # 4 programs over 100k keys: the fewest splits within 85 % of the
    # best fill (4 x 33 = 132 SMs): 116 SMs
    assert split_count(4, 2 * MIN_TILES_PER_SPLIT, 132) == 2  # no split shorter than MIN_TILES_PER_SPLIT
    assert split_count(4, MIN_TILES_PER_SPLIT - 1, 132) == 1
    assert 0.85 * 16 <= split_count(1, 10**6, 132, max_splits=16) <= 16
    assert multiprocessors(torch.device("cpu")) == 1  # a CPU batch never splits by itself


def test_split_block_table_sizes_the_longest_block():
    q_lens, prefixes, cpu = [5, 40, 1], [100, 0, 37], torch.device("cpu")
    blocks = prefill_block_table(q_lens, 2, cpu, SMALL_TILE, prefixes)  # group 2: 16-token blocks
    longest = max(prefixes[b] + m0 + 1 for b, _, _, m0 in prefill_blocks(q_lens, blocks.block_m))
    assert (blocks.max_tiles, blocks.splits, blocks.tile) == (longest // SMALL_TILE.block_n, None, SMALL_TILE)
    assert prefill_block_table(q_lens, 2, cpu).max_tiles == 0  # no prefixes: unknown, never split
    assert prefill_block_table(q_lens, 2, cpu, splits=3).splits == 3
    for bad in (0, 129):
        with pytest.raises(ValueError, match="splits must be"):
            prefill_block_table(q_lens, 2, cpu, splits=bad)
    gen = torch.Generator().manual_seed(2)
    q, k, v, table, lens, q_lens = prefill_case(gen, 4, 2, 16, 4, [(3, 5)])
    with pytest.raises(ValueError, match="pass splits"):
        paged_prefill_attention(q, k, v, table, lens, q_lens, 0.25, splits=2,
                                blocks=prefill_block_table(q_lens, 2, q.device), backend="triton")


# ==== the twin against SDPA ====

@pytest.mark.parametrize("config", KERNEL_CONFIGS + [(4, 4, 8, 1), (12, 4, 32, 16)],
                         ids=lambda c: "-".join(map(str, c)))
def test_twin_matches_sdpa(config):
    heads, kv_heads, D, page = config
    gen = torch.Generator().manual_seed(100 + sum(config))
    for trial in range(20):
        rows = random_rows(gen)
        q, k, v, table, lens, q_lens = prefill_case(gen, heads, kv_heads, D, page, rows, spare_pages=trial % 3)
        want = sdpa_reference(q, k, v, table, [p + n for p, n in rows], q_lens, 0.3)
        got = paged_prefill_attention_eager(q, k, v, table, lens, q_lens, 0.3)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5, msg=lambda m: f"rows {rows}: {m}")


# ==== clamps of device data ====

@interpreted
@pytest.mark.parametrize("splits", [1, 3], ids=lambda s: f"split{s}")
@pytest.mark.parametrize("table_dtype,huge", [(torch.int64, 2**40), (torch.int32, 2**31 - 1)])
def test_kernel_clamps_device_data(table_dtype, huge, splits):
    """seq_lens past the table or below q_len, and page ids outside the pool (in padding and inside
    a row), are clamped alike in kernel and twin: the same output as the clamped values give."""
    gen = torch.Generator().manual_seed(7)
    q, k, v, table, lens, q_lens = prefill_case(gen, 4, 2, 16, 4, [(6, 5), (20, 3), (0, 9), (3, 2)], spare_pages=2)
    num_pages, max_tokens = k.shape[0], table.shape[1] * 4
    bad_lens = torch.tensor([2**32 + 3, 1, -7, 5])  # rows 0-2 clamp to max_tokens, q_len, q_len (clamped
    # before narrowing to int32: 2**32 + 3 must not wrap to 3)
    bad_table = table.clone()
    bad_table[3, 2:] = torch.tensor([huge, -huge, -1, num_pages, huge, 0])  # padding past seq_len
    bad_table[0, -2:] = torch.tensor([-huge, huge])  # row 0's seq_len clamps to the whole table: these are read
    bad_table, bad_lens = bad_table.to(table_dtype), bad_lens.to(lens.dtype)
    tile = SMALL_TILE if splits > 1 else None  # 16-key tiles: rows long enough to split
    out = paged_prefill_attention(q, k, v, bad_table, bad_lens, q_lens, 0.25, tile=tile, splits=splits,
                                  backend="triton")
    assert torch.isfinite(out).all()
    want = paged_prefill_attention_eager(q, k, v, bad_table, bad_lens, q_lens, 0.25)
    torch.testing.assert_close(out, want, rtol=1e-4, atol=1e-5)
    clamped = torch.tensor([max_tokens, 3, 9, 5])
    torch.testing.assert_close(out, paged_prefill_attention_eager(q, k, v, bad_table.long().clamp(0, num_pages - 1),
                                                                  clamped, q_lens, 0.25), rtol=1e-4, atol=1e-5)
    ref = sdpa_reference(q, k, v, bad_table.long().clamp(0, num_pages - 1), clamped.tolist(), q_lens, 0.25)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)


# ==== host checks ====

def test_host_checks_raise():
    gen = torch.Generator().manual_seed(0)
    q, k, v, table, lens, q_lens = prefill_case(gen, 4, 2, 16, 4, [(3, 5), (0, 4)])  # 3 pages: 12 tokens a row
    cases = [  # (q, k, v, table, lens, q_lens), message
        ((q, k, v, table, lens, [5, 3]), "add up"),
        ((q, k, v, table, lens, [9]), "q_lens"),
        ((q, k, v, table[:1], lens[:1], [5, 4]), "q_lens"),
        ((q, k, v, table, lens[:1], q_lens), "seq_lens"),
        ((q, k, v, table, lens, [0, 9]), "every q_len"),
        ((torch.randn(13, 4, 16), k, v, table[:1], lens[:1], [13]), "every q_len"),
        ((q[:, :3], k, v, table, lens, q_lens), "multiple"),
        ((q, k, v[..., :8], table, lens, q_lens), "do not match"),
        ((q, k, v[:-1], table, lens, q_lens), "do not match"),
        ((q, k, v[:, :2], table, lens, q_lens), "do not match"),
        ((q.bfloat16(), k, v, table, lens, q_lens), "share"),
        ((q.double(), k.double(), v.double(), table, lens, q_lens), "share"),
        ((q, k, v, table.float(), lens, q_lens), "int32/int64"),
        ((q, k, v, table.t().contiguous().t(), lens, q_lens), "contiguous"),
    ]
    for args, message in cases:  # checked before the backend is chosen: the twin raises too
        with pytest.raises(ValueError, match=message):
            paged_prefill_attention(*args, 0.25)


@interpreted
def test_block_table_of_another_batch_raises():
    """The kernel addresses q and out from the table's entries: a table built for other lengths or
    another tile must be refused on the host."""
    gen = torch.Generator().manual_seed(1)
    q, k, v, table, lens, q_lens = prefill_case(gen, 4, 2, 16, 4, [(3, 70), (0, 4)])  # group 2: 64-token blocks
    good = prefill_block_table(q_lens, 2, q.device)
    for blocks, tile in ((prefill_block_table([q_lens[0] + q_lens[1] - 1, 1], 2, q.device), None),  # other rows
                         (prefill_block_table(q_lens, 1, q.device), None),
                         (prefill_block_table(q_lens, 2, q.device, SMALL_TILE), TILE),  # a call with another tile
                         (good._replace(q_lens=good.q_lens[::-1]), None)):
        with pytest.raises(ValueError, match="blocks built for"):
            paged_prefill_attention(q, k, v, table, lens, q_lens, 0.25, blocks=blocks, tile=tile, backend="triton")


# ==== the block list ====

@pytest.mark.parametrize("q_lens", [[1], [128], [129], [300, 1, 1, 64, 65, 7], [1] * 9, [16, 17, 33, 2]],
                         ids=lambda q: f"{len(q)}rows-{sum(q)}tokens")
@pytest.mark.parametrize("block_m", [1, 16, 32, 128])
def test_blocks_cover_every_token_once(q_lens, block_m):
    starts = [0, *itertools.accumulate(q_lens)]
    blocks = prefill_blocks(q_lens, block_m)
    covered = []
    for b, start, n, m0 in blocks:
        assert (start, n) == (starts[b], q_lens[b]) and m0 % block_m == 0 and 0 <= m0 < n
        covered += [(b, t) for t in range(m0, min(m0 + block_m, n))]
    assert sorted(covered) == [(b, t) for b, n in enumerate(q_lens) for t in range(n)]
    m0s = [m0 for *_, m0 in blocks]
    assert m0s == sorted(m0s, reverse=True)  # the blocks with most keys of their row first


def test_blocks_with_most_keys_come_first():
    blocks = prefill_blocks([40, 1, 30], 16, prefixes=[0, 3000, 100])
    assert [(b, m0) for b, _, _, m0 in blocks] == [(1, 0), (2, 16), (2, 0), (0, 32), (0, 16), (0, 0)]


def test_float32_takes_the_tile_that_fits_in_shared_memory():
    """256 rows of float32 at head dim 128 asked 263 KB of shared memory on an H200 (227 KB there)."""
    assert tile_for(torch.float32).rows == 128 and tile_for(torch.bfloat16) == TILE


def test_tile_table_covers_dtypes_and_head_dims():
    """Every float dtype up to head dim 256 finds a line of the table; wider elements or head dims
    never take more rows (shared memory grows with both); past the table the call is refused."""
    assert tile_for(torch.bfloat16, 128) == TILE and tile_for(torch.float16, 64) == TILE
    tiles = [tile for *_, tile in TILES]
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        for D in (32, 128, 129, 256):
            assert tile_for(dtype, D) in tiles
            assert tile_for(dtype, D).rows <= tile_for(dtype, min(D, 128)).rows
            assert tile_for(torch.float32, D).rows <= tile_for(dtype, D).rows
    assert tile_for(torch.float32, 256).rows < tile_for(torch.float32, 128).rows < TILE.rows
    with pytest.raises(ValueError, match="no prefill tile"):
        tile_for(torch.float32, 512)


def test_block_table_matches_block_list():
    for group, tokens in ((1, 256), (2, 128), (3, 64), (7, 32), (8, 32), (128, 2), (256, 1), (512, 1)):
        assert block_tokens(group) == tokens
        blocks = prefill_block_table([5, 200, 1], group, torch.device("cpu"))
        assert blocks.table.dtype == torch.int32 and (blocks.q_lens, blocks.block_m) == ((5, 200, 1), tokens)
        assert blocks.table.tolist() == prefill_blocks([5, 200, 1], tokens)
    assert block_tokens(3, SMALL_TILE) == 8
    assert prefill_block_table([5, 20], 3, torch.device("cpu"), SMALL_TILE).table.tolist() == prefill_blocks([5, 20], 8)


@interpreted
def test_given_blocks_give_the_same_output():
    """A table built once (per step, shared by the layers) in any order gives the same bits: the
    blocks are independent programs."""
    gen = torch.Generator().manual_seed(3)
    rows = [(0, 40), (100, 1), (30, 75), (250, 17)]
    q, k, v, table, lens, q_lens = prefill_case(gen, 8, 4, 16, 8, rows)  # group 2: 64-token blocks
    built = paged_prefill_attention(q, k, v, table, lens, q_lens, 0.25, backend="triton")
    blocks = prefill_block_table(q_lens, 2, q.device, tile_for(q.dtype))
    shuffled = blocks.table[torch.randperm(blocks.table.shape[0], generator=gen)]
    for order in (blocks, blocks._replace(table=shuffled)):
        given = paged_prefill_attention(q, k, v, table, lens, q_lens, 0.25, blocks=order, backend="triton")
        assert torch.equal(given, built)


# ==== the "triton" backend in a model ====

def forward_logits(runner, steps):
    """Run ``steps`` of ``(seq, new tokens)`` in one runner; sequences get their pages on first use."""
    pool, pages, lens, logits = runner.kv_pool, {}, {}, []
    for step in steps:
        for s, _ in step:
            if s not in pages:
                pages[s] = pool.allocate(pool.pages_for(100))
        chunks = [SequenceChunk(ids, lens.get(s, 0), pages[s]) for s, ids in step]
        logits.append(runner.forward(chunks, [SamplingParams()] * len(step), [0] * len(step)).logits)
        for s, ids in step:
            lens[s] = lens.get(s, 0) + len(ids)
    return logits


def assert_backends_agree(tmp_path) -> None:
    """The "triton" backend gives the torch backend's logits on a tiny model over a fresh prefill,
    a decode step, and two mixed batches with cached prefixes (rows 1, 0, 2: prefixes 10, 71, 0,
    then rows 0, 2, 1: 72, 3, 50)."""
    write_tiny(tmp_path, "qwen3_moe", seed=5, layers=2, heads=6, kv_heads=2, head_dim=16, experts=4, top_k=2)
    gen = torch.Generator().manual_seed(4)

    def ids(n):
        return torch.randint(0, 127, (n,), generator=gen).tolist()

    steps = [[(0, ids(70)), (1, ids(9))],  # fresh prompts
             [(0, ids(1)), (1, ids(1))],  # a decode step
             [(1, ids(40)), (0, ids(1)), (2, ids(3))],  # a chunk over a prefix, a decode row, a new prompt
             [(0, ids(1)), (2, ids(66)), (1, ids(1))]]
    runs = {}
    for backend in ("torch", "triton"):
        runner = ModelRunner(RunnerConfig(str(tmp_path), device="cpu", dtype="float32", page_size=4, kv_tokens=1024,
                                          attention=backend))
        runs[backend] = forward_logits(runner, steps)
    for step, (got, want) in enumerate(zip(runs["triton"], runs["torch"])):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=lambda m: f"step {step}: {m}")


@interpreted
def test_triton_backend_prefill_matches_torch(tmp_path, monkeypatch):
    """Through the interpreted kernels (prefill and decode); every layer of a batch with a cached
    prefix launches the prefill kernel (fresh prompts alone take SDPA's causal path)."""
    monkeypatch.setenv("SLUICE_KERNELS", "triton")
    launches, kernel = [], triton_prefill._kernel
    monkeypatch.setattr(triton_prefill, "_kernel", lambda: launches.append(1) or kernel())
    assert_backends_agree(tmp_path)
    assert len(launches) == 2 * 2  # layers x the steps 2 and 3
