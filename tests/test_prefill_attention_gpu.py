"""The paged Triton prefill attention compiled on a GPU against its eager twin, under sync debug
mode: mixed batches at Qwen3's geometry, the tiles ``bench_prefill_attention.py --sweep`` may pick,
and head dim 256. (Split-KV over long prefixes: ``test_prefill_attention_split_gpu.py``; the CPU
tests, interpreted: ``test_prefill_attention.py``. Apart, so that the GPU suite's workers share
them, ``--dist loadfile`` giving a file to one worker.)"""
from __future__ import annotations

import pytest
import torch

from tests.test_prefill_attention import prefill_case, rel_err
from worker.attention.triton_prefill import (PrefillTile, paged_prefill_attention, paged_prefill_attention_eager,
                                             prefill_block_table)

pytestmark = pytest.mark.cuda


GPU_CASES = [  # heads, kv_heads, D, page, rows of (prefix, q_len)
    (32, 4, 128, 16, [(3000, 2048)]),  # Qwen3-30B-A3B's geometry, a long chunk over a long prefix
    (16, 2, 64, 16, [(0, 300), (700, 1), (129, 1000), (5, 1), (64, 64), (0, 1)]),  # mixed decode + prefill
]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("case", GPU_CASES, ids=lambda c: "-".join(map(str, c[:4])))
def test_kernel_matches_twin_on_gpu(case, dtype):
    heads, kv_heads, D, page, rows = case
    gen = torch.Generator().manual_seed(heads)
    for trial in range(3):
        q, k, v, table, lens, q_lens = prefill_case(gen, heads, kv_heads, D, page, rows, dtype, "cuda")
        torch.cuda.set_sync_debug_mode("error" if trial else "default")  # trial 0 compiles
        try:
            out = paged_prefill_attention(q, k, v, table, lens, q_lens, D ** -0.5)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        want = paged_prefill_attention_eager(q, k, v, table, lens, q_lens, D ** -0.5)
        assert torch.isfinite(out).all()
        if dtype == torch.float32:
            torch.testing.assert_close(out, want, rtol=1e-4, atol=2e-5)
        else:
            assert rel_err(out, want) < 2e-2


KNOB_TILES = [PrefillTile(256, 64, 16, 2, qk_ahead=True), PrefillTile(128, 128, 8, 2, qk_ahead=True),
              PrefillTile(256, 128, 8, 2), PrefillTile(256, 64, 16, 2, warp_specialize=True),
              PrefillTile(128, 128, 8, 2, warp_specialize=True)]


@pytest.mark.parametrize("splits", [1, 3], ids=lambda s: f"split{s}")
@pytest.mark.parametrize("tile", KNOB_TILES, ids=lambda t: "-".join(map(str, map(int, t))))
def test_split_kernel_matches_twin_on_gpu_tiles(tile, splits):
    """The settings ``bench_prefill_attention.py --sweep`` may pick, bf16 at Qwen3's geometry. A
    Triton that cannot build warp specialisation here skips (the sweep reports it the same way)."""
    gen = torch.Generator().manual_seed(5)
    rows = [(3001, 700), (40, 1), (0, 95)]
    q, k, v, table, lens, q_lens = prefill_case(gen, 32, 4, 128, 16, rows, torch.bfloat16, "cuda")
    blocks = prefill_block_table(q_lens, 8, q.device, tile, [p for p, _ in rows], splits)
    try:
        paged_prefill_attention(q, k, v, table, lens, q_lens, 128 ** -0.5, blocks=blocks)
    except Exception as e:  # noqa: BLE001 (the compiler's errors have no common base)
        if not tile.warp_specialize:
            raise
        pytest.skip(f"warp specialisation: {type(e).__name__}: {str(e)[:100]}")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = paged_prefill_attention(q, k, v, table, lens, q_lens, 128 ** -0.5, blocks=blocks)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert rel_err(out, paged_prefill_attention_eager(q, k, v, table, lens, q_lens, 128 ** -0.5)) < 2e-2


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_kernel_matches_twin_on_gpu_head_dim_256(dtype):
    """The table's head-dim-256 tiles compile within shared memory and match the twin."""
    gen = torch.Generator().manual_seed(256)
    q, k, v, table, lens, q_lens = prefill_case(gen, 8, 2, 256, 16, [(3000, 200), (77, 1)], dtype, "cuda")
    out = paged_prefill_attention(q, k, v, table, lens, q_lens, 256 ** -0.5)
    want = paged_prefill_attention_eager(q, k, v, table, lens, q_lens, 256 ** -0.5)
    assert rel_err(out, want) < (1e-5 if dtype == torch.float32 else 2e-2)
