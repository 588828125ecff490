"""scripts/quant_quality.py's runners: experts expanded to float32, and the fp8-KV row's pool in
float8 e4m3 (``--kv-cache-dtype fp8``; its numbers are ``tests/test_kv_fp8.py``'s)."""
from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
from quant_quality import runner_for  # noqa: E402
from tests.tiny_models import write_tiny  # noqa: E402


def test_the_fp8_kv_row_runs_a_float8_pool(tmp_path):
    write_tiny(tmp_path, "qwen3_moe", seed=1)
    plain, fp8 = runner_for(str(tmp_path), "bf16"), runner_for(str(tmp_path), "bf16", kv_cache_dtype="fp8")
    assert plain.kv_pool.k.dtype == torch.float32 and fp8.kv_pool.k.dtype == torch.float8_e4m3fn
    assert fp8.experts.banks.w13.dtype == torch.float32  # expanded, as every row's experts
