"""fla's chunked gated delta rule and our step kernel against the twins on a GPU, config
"gva4-dv-differs" (four value heads a key head, a value dim other than the key's): in a file of its
own so that the GPU suite autotunes it beside the other configs (tests/test_linear_attention.py,
fla_chunk_and_step_kernel_match_twins)."""
from __future__ import annotations

import pytest

from tests.test_linear_attention import fla_chunk_and_step_kernel_match_twins


@pytest.mark.cuda
@pytest.mark.parametrize("name", ["gva4-dv-differs"])
def test_fla_chunk_and_step_kernel_match_twins_on_cuda(name):
    fla_chunk_and_step_kernel_match_twins(name)
