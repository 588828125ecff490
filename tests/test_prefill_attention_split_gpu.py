"""Split-KV prefill attention compiled on a GPU over long prefixes (to 100k keys), chosen by the
launch, forced off and forced to 4, against the eager twin and SDPA under sync debug mode."""
from __future__ import annotations

import pytest
import torch

from tests.test_prefill_attention import prefill_case, rel_err, sdpa_reference
from worker.attention.split_kv import multiprocessors, split_count
from worker.attention.triton_prefill import (paged_prefill_attention, paged_prefill_attention_eager,
                                             prefill_block_table, tile_for)

pytestmark = pytest.mark.cuda


GPU_SPLIT_CASES = [  # heads, kv_heads, D, page, rows: GQA 1/4/8, few blocks over long prefixes, ragged
    (8, 8, 128, 16, [(20003, 7), (3001, 1)]),
    (32, 8, 128, 16, [(40000, 300), (17, 5)]),
    (32, 4, 128, 16, [(100003, 64), (5000, 1), (0, 33)]),  # Qwen3-30B-A3B's geometry, a 100k prefix
]


@pytest.mark.parametrize("splits", [None, 1, 4], ids=["split-auto", "split1", "split4"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("case", GPU_SPLIT_CASES, ids=lambda c: f"gqa{c[0] // c[1]}")
def test_split_kernel_matches_twin_on_gpu(case, dtype, splits):
    """Split-KV chosen by the launch (these batches fill a few SMs unsplit), forced off and forced
    to 4, against the twin and SDPA, with no sync inside the call."""
    heads, kv_heads, D, page, rows = case
    gen = torch.Generator().manual_seed(heads + D)
    q, k, v, table, lens, q_lens = prefill_case(gen, heads, kv_heads, D, page, rows, dtype, "cuda")
    blocks = prefill_block_table(q_lens, heads // kv_heads, q.device, tile_for(dtype, D), [p for p, _ in rows], splits)
    if splits is None:
        assert split_count(blocks.table.shape[0] * kv_heads, blocks.max_tiles, multiprocessors(q.device)) > 1
    paged_prefill_attention(q, k, v, table, lens, q_lens, D ** -0.5, blocks=blocks)  # compiles
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = paged_prefill_attention(q, k, v, table, lens, q_lens, D ** -0.5, blocks=blocks)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    want = paged_prefill_attention_eager(q, k, v, table, lens, q_lens, D ** -0.5)
    sdpa = sdpa_reference(q, k, v, table, [p + n for p, n in rows], q_lens, D ** -0.5)
    assert torch.isfinite(out).all()
    if dtype == torch.float32:
        torch.testing.assert_close(out, want, rtol=1e-4, atol=2e-5)
        torch.testing.assert_close(out, sdpa, rtol=1e-4, atol=2e-5)
    else:
        assert rel_err(out, want) < 2e-2 and rel_err(out, sdpa) < 2e-2
