"""The synthetic router's 32-bit integer hash (xorshift-multiply) over int64 tensors in one launch.

Eagerly the hash is ten elementwise launches (three shifts, three xors, two products, two masks);
the synthetic router (``moe_offload.synthetic_routing``) hashes nine times a decode step, so about
ninety launches of a captured step were this. The kernel computes the same bits in uint32
arithmetic, which wraps exactly where the twin's masks cut (the first xorshift stays in int64,
as the twin's, so inputs wider than 32 bits hash alike too).
"""
from __future__ import annotations

import functools

import torch

from moe_offload.kernels.triton_support import use_triton

M32 = 0xFFFFFFFF
BLOCK = 1024


def mix32(x, *, backend: str | None = None):
    """The hash of Python ints or int64 tensors (elementwise); CUDA tensors run the kernel."""
    if not isinstance(x, torch.Tensor) or not use_triton(x, backend) or x.numel() == 0:
        return mix32_eager(x)
    if x.dtype != torch.int64:
        raise ValueError(f"mix32 hashes int64 tensors, got {x.dtype}")
    x = x.contiguous()
    out = torch.empty_like(x)
    _kernel()[(-(-x.numel() // BLOCK),)](x, out, x.numel(), BLOCK=BLOCK)
    return out


def mix32_eager(x):
    """The twin; Python ints and int64 tensors alike. Multipliers are below 2^31, so no int64 product
    overflows."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & M32
    x = x ^ (x >> 15)
    x = (x * 0x68E31DA5) & M32
    return x ^ (x >> 16)


@functools.cache
def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def mix32_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        live = offs < n
        x = tl.load(x_ptr + offs, mask=live, other=0)
        h = (x ^ (x >> 16)).to(tl.uint32)  # the low 32 bits, all the twin's masked product keeps
        h = h * tl.full((BLOCK,), 0x7FEB352D, tl.uint32)
        h = h ^ (h >> 15)
        h = h * tl.full((BLOCK,), 0x68E31DA5, tl.uint32)
        h = h ^ (h >> 16)
        tl.store(out_ptr + offs, h.to(tl.int64), mask=live)

    return mix32_kernel
