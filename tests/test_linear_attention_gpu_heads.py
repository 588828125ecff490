"""fla's chunked gated delta rule and our step kernel against the twins on a GPU, config "equal-heads"
(equal query, key and value heads of 64, beta in float32): in a file of its own so that the GPU
suite autotunes it beside the other configs (tests/test_linear_attention.py,
fla_chunk_and_step_kernel_match_twins)."""
from __future__ import annotations

import pytest

from tests.test_linear_attention import fla_chunk_and_step_kernel_match_twins


@pytest.mark.cuda
@pytest.mark.parametrize("name", ["equal-heads"])
def test_fla_chunk_and_step_kernel_match_twins_on_cuda(name):
    fla_chunk_and_step_kernel_match_twins(name)
