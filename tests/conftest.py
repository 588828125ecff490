import os

import pytest
import torch

if not torch.cuda.is_available():
    # Triton kernels run in its interpreter on CPU-only machines. Set before anything imports
    # triton: the interpreter must be chosen when triton's own jit helpers are first defined.
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)
