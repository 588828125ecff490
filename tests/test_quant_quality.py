"""scripts/quant_quality.py's fp8-KV row: the torch attention reads the pool as if stored in e4m3."""
from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
from quant_quality import kv_rounded  # noqa: E402
from worker.attention.torch_backend import TorchAttention  # noqa: E402


def test_kv_rounded_reads_the_pool_through_e4m3():
    pool = SimpleNamespace(k=torch.randn(1, 3, 4, 2, 8) * 200, v=None)  # [L, pages, page, kv_heads, D], some past 448
    runner = SimpleNamespace(model=SimpleNamespace(attention=TorchAttention(pool, 1.0)))
    batch = SimpleNamespace(page_table=torch.tensor([[2, 1]]))
    read = kv_rounded(runner, torch.float8_e4m3fn).model.attention._gather(pool.k[0], batch, 4)
    exact = TorchAttention._gather(pool.k[0], batch, 4)
    want = TorchAttention._gather(pool.k[0].to(torch.float8_e4m3fn).float(), batch, 4)
    assert torch.equal(read, want) and not torch.equal(read, exact)
    assert read.abs().max() <= 448  # torch's cast saturates
