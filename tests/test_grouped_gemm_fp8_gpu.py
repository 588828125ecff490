"""The fp8 grouped SwiGLU GEMM's weight-only parity on a GPU (``test_grouped_gemm_fp8.py`` has the
rest: its file alone was the GPU suite's longest under ``--dist loadfile``, which gives a file to one
worker)."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from moe_offload.fp8 import BLOCK_128, PER_CHANNEL  # noqa: E402
from tests.test_grouped_gemm_fp8 import DECODE_AND_PREFILL, GPU_SHAPES, check_trials, make_fp8_banks  # noqa: E402


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("block", [BLOCK_128, PER_CHANNEL], ids=["b128", "channel"])
@pytest.mark.parametrize("shape", GPU_SHAPES, ids=lambda s: "N{}H{}I{}".format(*s))
def test_cuda_parity_sync_free(shape, block, dtype):
    """3 shapes x 20 trials (ragged, empty experts, duplicates), default tiles, decode and prefill
    sizes, every op call under sync-debug "error" once its tiles are compiled."""
    banks = make_fp8_banks(*shape, block, "cuda")
    check_trials(banks, dtype, len(DECODE_AND_PREFILL), DECODE_AND_PREFILL, seed=99)  # compiles
    check_trials(banks, dtype, 20, DECODE_AND_PREFILL, sync_free=True)
