"""The synthetic router's hash in one launch (moe_offload/kernels/mix32.py) against its eager twin,
bit for bit: interpreted on the CPU and compiled, sync-free, on a GPU."""
from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from moe_offload.kernels.mix32 import BLOCK, mix32, mix32_eager  # noqa: E402

SIZES = [1, 37, BLOCK, 3 * BLOCK + 5]


def values(n: int, seed: int) -> torch.Tensor:
    """32-bit values, the extremes, and wider ones (the twin's first xorshift sees their high bits)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randint(0, 1 << 32, (n,), generator=gen)
    wide = torch.randint(-(1 << 62), 1 << 62, (n,), generator=gen)
    x = torch.where(torch.arange(n) % 3 == 2, wide, x)
    x[0] = (1 << 32) - 1
    return x


def check(n: int, device: str, seed: int) -> None:
    x = values(n, seed).to(device)
    if device == "cuda":
        torch.cuda.set_sync_debug_mode("error")
    try:
        out = mix32(x, backend="triton")
    finally:
        if device == "cuda":
            torch.cuda.set_sync_debug_mode("default")
    assert torch.equal(out.cpu(), mix32_eager(x.cpu()))


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs TRITON_INTERPRET=1")
@pytest.mark.parametrize("n", SIZES)
def test_kernel_matches_twin_interpreted(n):
    for seed in range(5):
        check(n, "cpu", seed)


@pytest.mark.cuda
@pytest.mark.parametrize("n", SIZES)
def test_kernel_matches_twin_on_gpu_without_syncs(n):
    for seed in range(20):
        check(n, "cuda", seed)


def test_other_dtypes_are_refused():
    with pytest.raises(ValueError, match="int64"):
        mix32(torch.zeros(4, dtype=torch.int32, device="cuda" if torch.cuda.is_available() else "cpu"),
              backend="triton")
