"""gpt-oss's attention in the paged Triton kernels: per-head sink logits in each softmax's
denominator and sliding windows, decode (split and unsplit rows) and prefill (split-KV on and off),
against the eager twins (interpreted on the CPU, compiled on a GPU under sync debug mode), and the
twins against the torch backend's plain softmax (``attend_eager``), the one the model parity runs."""
from __future__ import annotations

import contextlib
import os

import pytest
import torch

# The interpreter is chosen when a kernel is first built; on a GPU the kernels compile instead.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from tests.test_prefill_attention import PrefillTile, prefill_case, rel_err  # noqa: E402
from worker.attention.torch_backend import attend_eager  # noqa: E402
from worker.attention.triton_decode import (BLOCK_N, REDUCE_CHUNK, paged_decode_attention,  # noqa: E402
                                            paged_decode_attention_eager, row_splits, split_plan)
from worker.attention.triton_prefill import (paged_prefill_attention, paged_prefill_attention_eager,  # noqa: E402
                                             prefill_block_table, tile_for)

interpreted = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs TRITON_INTERPRET=1")
SMALL_TILE = PrefillTile(32, 16, 4, 1)  # few programs: the interpreter is slow
# (heads, kv_heads, head dim, page, window)
CONFIGS = [(4, 2, 16, 4, 8), (8, 2, 32, 16, 5), (4, 4, 16, 8, 0), (2, 1, 64, 4, 32)]


def sinks_for(heads: int, gen: torch.Generator, device="cpu") -> torch.Tensor:
    return (torch.randn(heads, generator=gen) * 2 + 1).float().to(device)


def reference(q, k_cache, v_cache, table, lens, q_lens, scale, sinks, window):
    """Per row: gather, build the causal window mask, ``attend_eager``."""
    out, start = [], 0
    heads, kv_heads, D = q.shape[1], k_cache.shape[2], q.shape[2]
    for b, n in enumerate(q_lens):
        seq = int(lens[b])
        keys = k_cache[table[b]].reshape(-1, kv_heads, D)[:seq].repeat_interleave(heads // kv_heads, 1)
        values = v_cache[table[b]].reshape(-1, kv_heads, D)[:seq].repeat_interleave(heads // kv_heads, 1)
        pos = torch.arange(seq - n, seq)[:, None]
        t = torch.arange(seq)[None, :]
        mask = (t <= pos) & ((t > pos - window) if window else True)
        o = attend_eager(q[start:start + n].transpose(0, 1), keys.transpose(0, 1), values.transpose(0, 1), mask,
                         scale, sinks)
        out.append(o.transpose(0, 1))
        start += n
    return torch.cat(out)


@pytest.mark.parametrize("config", CONFIGS)
def test_twins_match_the_plain_softmax(config):
    heads, kv_heads, D, page, window = config
    gen = torch.Generator().manual_seed(sum(config))
    rows = [(0, 9), (13, 1), (40, 17), (3, 1)]
    q, k, v, table, lens, q_lens = prefill_case(gen, heads, kv_heads, D, page, rows)
    sinks = sinks_for(heads, gen)
    want = reference(q, k, v, table, lens, q_lens, D ** -0.5, sinks, window)
    got = paged_prefill_attention_eager(q, k, v, table, lens, q_lens, D ** -0.5, sinks, window)
    assert rel_err(got, want) < 1e-5
    decode_rows = [i for i, (_, n) in enumerate(rows) if n == 1]
    starts = torch.tensor([0] + q_lens).cumsum(0)
    qd = q[[int(starts[i]) for i in decode_rows]]
    got = paged_decode_attention_eager(qd, k, v, table[decode_rows], lens[decode_rows], D ** -0.5, sinks, window)
    assert rel_err(got, want[[int(starts[i]) for i in decode_rows]]) < 1e-5


def decode_case(gen, config, lengths, dtype, device):
    heads, kv_heads, D, page, window = config
    q, k, v, table, lens, _ = prefill_case(gen, heads, kv_heads, D, page, [(n - 1, 1) for n in lengths],
                                           dtype=dtype, device=device)
    return q, k, v, table, lens, sinks_for(heads, gen, device), window


def check_decode(config, dtype, device, splits, lengths):
    gen = torch.Generator().manual_seed(len(lengths) + sum(config))
    q, k, v, table, lens, sinks, window = decode_case(gen, config, lengths, dtype, device)
    scale = config[2] ** -0.5
    want = paged_decode_attention_eager(q, k, v, table, lens, scale, sinks, window)
    with sync_debug(device):
        got = paged_decode_attention(q, k, v, table, lens, scale, sinks=sinks, window=window, num_splits=splits,
                                     backend="triton")
    assert rel_err(got, want) < (1e-5 if dtype == torch.float32 else 1e-2)


@contextlib.contextmanager
def sync_debug(device: str):
    """On a GPU, any hidden sync inside the block raises."""
    if device == "cpu":
        yield
        return
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(0)


def check_prefill(config, dtype, device, splits, rows, unseen_value=None):
    """``unseen_value``: the values of the keys before each row's first window (no query sees them)."""
    heads, kv_heads, D, page, window = config
    gen = torch.Generator().manual_seed(len(rows) + sum(config))
    q, k, v, table, lens, q_lens = prefill_case(gen, heads, kv_heads, D, page, rows, dtype=dtype, device=device)
    if unseen_value is not None:
        for b, (prefix, _) in enumerate(rows):
            t = torch.arange(max(prefix - window + 1, 0), device=device)
            v[table[b, t // page], t % page] = unseen_value
    sinks = sinks_for(heads, gen, device)
    tile = SMALL_TILE if device == "cpu" else tile_for(dtype, D)
    blocks = prefill_block_table(q_lens, heads // kv_heads, q.device, tile, [p for p, _ in rows], splits)
    want = paged_prefill_attention_eager(q, k, v, table, lens, q_lens, D ** -0.5, sinks, window)
    with sync_debug(device):
        got = paged_prefill_attention(q, k, v, table, lens, q_lens, D ** -0.5, blocks=blocks, sinks=sinks,
                                      window=window, backend="triton")
    assert rel_err(got, want) < (1e-5 if dtype == torch.float32 else 1e-2)


@interpreted
@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("splits", [1, 3])
def test_decode_kernel_matches_twin(config, splits):
    """Rows shorter than, at, and past the window; with 3 splits, rows past it split over it alone."""
    check_decode(config, torch.float32, "cpu", splits, [1, 5, 8, 9, 70, 200])


@interpreted
def test_decode_of_hundreds_of_splits_keeps_the_sink():
    """The merge takes several steps of REDUCE_CHUNK splits; the sink joins the denominator once,
    after the last step."""
    long = 2 * REDUCE_CHUNK * BLOCK_N + 1  # splits are BLOCK_N tokens at least: 2 steps and a split
    check_decode(CONFIGS[1], torch.float32, "cpu", 2 * REDUCE_CHUNK + 3, [1, long, 700])
    check_decode((4, 2, 16, 16, 0), torch.float32, "cpu", 2 * REDUCE_CHUNK + 3, [300, long + 2 * BLOCK_N])


@interpreted
def test_decode_windows_of_several_splits():
    """A window longer than a split: each row past it cuts the window alone into splits (of
    BLOCK_N tokens or more, at most 3), from the window's first key on; shorter rows their own length."""
    splits, min_split = split_plan(2, 2, 704, num_splits=3)
    lens = [1, 150, 200, 201, 700]
    assert [row_splits(n, splits, min_split, 200)[::2] for n in lens] == [(0, 1), (0, 3), (0, 2), (1, 2), (500, 2)]
    check_decode((4, 2, 16, 16, 200), torch.float32, "cpu", 3, lens)


@interpreted
@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("splits", [1, 2])
def test_prefill_kernel_matches_twin(config, splits):
    """A fresh prompt longer than the window, a chunk over a prefix, decode-like rows."""
    check_prefill(config, torch.float32, "cpu", splits, [(0, 21), (30, 9), (50, 1), (7, 3)])


@interpreted
@pytest.mark.parametrize("splits", [1, 3])
def test_prefill_keys_before_every_window_weigh_nothing(splits):
    """Tiles longer than the window: the first key tile of a block lies wholly before the window of
    its later queries. Those keys must weigh exactly 0; a masked score that merely cancelled to about
    0 gave them weight (on a GPU, where the scale is fused into exp2's argument, inf, then NaN).
    Their values are huge, so any weight on them overflows."""
    check_prefill(CONFIGS[0], torch.float32, "cpu", splits, [(22, 16), (40, 1), (3, 20)], unseen_value=3e38)


@pytest.mark.cuda
@pytest.mark.parametrize("config", CONFIGS + [(64, 8, 64, 16, 128)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_kernels_match_twins_on_gpu(config, dtype):
    """gpt-oss-120b's heads (64 / 8 of 64, window 128) among them, long rows, under sync debug."""
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    for splits in (None, 1, 4):
        check_decode(config, dtype, "cuda", splits, [1, 100, 129, 700, 3000])
    for splits in (None, 1, 3):
        check_prefill(config, dtype, "cuda", splits, [(0, 300), (2000, 200), (129, 1), (5, 40)])
