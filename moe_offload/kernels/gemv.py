"""``x @ w.T`` for one row of ``x``: the dense projections (qkv, o, the router) of a batch-1 decode step.

At one row a projection is a matrix-vector product bound by reading ``w``; cuBLAS's kernels for it
reach about 0.4 (o, split-K plus a reduce launch) to 0.6 (qkv) of the H200's HBM bandwidth. This
kernel gives each program ``BLOCK_N`` rows of ``w`` and unrolls the whole reduction at compile time
(``K`` is a constexpr), so every weight load of a program is issued before the first multiply-add
needs it, float32 products accumulate in a ``[BLOCK_K, BLOCK_N]`` tile summed once at the end:

```
 grid (N / BLOCK_N)    program p: out[p*BN : (p+1)*BN] = sum over K/BLOCK_K steps of x[ks] * w[rows, ks]
```

``linear`` takes the kernel for one row of a 16-bit dtype on CUDA whose ``K`` a power-of-two step
of at least 16 divides, and ``torch.nn.functional.linear`` (the twin) for everything else.
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from moe_offload.kernels.triton_support import use_triton

BLOCK_N = 8  # rows of w per program: 256 programs for a 2048-row projection
MAX_BLOCK_K = 512


def linear(x: torch.Tensor, w: torch.Tensor, *, backend: str | None = None) -> torch.Tensor:
    """``F.linear(x, w)`` for ``x [..., K]`` and ``w [N, K]``; one row of bfloat16 or float16 runs
    the kernel on CUDA (or with ``backend="triton"``), anything else the twin."""
    if not _fits(x, w) or not use_triton(x, backend):
        return F.linear(x, w)
    n, k = w.shape
    x = x.contiguous()
    out = torch.empty(*x.shape[:-1], n, dtype=x.dtype, device=x.device)
    _kernel()[(-(-n // BLOCK_N),)](x, w, out, n, w.stride(0), K=k, BLOCK_N=BLOCK_N, BLOCK_K=block_k(k),
                                    EVEN_N=n % BLOCK_N == 0, num_warps=8 if k >= 4096 else 4)
    return out


def block_k(k: int) -> int:
    """The largest power of two up to MAX_BLOCK_K that divides ``k`` (0: none of at least 16)."""
    step = MAX_BLOCK_K
    while step >= 16 and k % step:
        step //= 2
    return step if step >= 16 else 0


def _fits(x: torch.Tensor, w: torch.Tensor) -> bool:
    """One row, 16-bit floats of one dtype, ``w`` rows contiguous and not empty, ``K`` a multiple of 16."""
    return (x.numel() == x.shape[-1] and x.dtype in (torch.bfloat16, torch.float16) and w.dtype == x.dtype
            and w.dim() == 2 and w.shape[1] == x.shape[-1] and w.stride(1) == 1 and w.device == x.device
            and w.numel() > 0 and block_k(w.shape[1]) > 0)


@functools.cache
def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def gemv_kernel(x_ptr, w_ptr, out_ptr, n, stride_wn, K: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_K: tl.constexpr, EVEN_N: tl.constexpr):
        rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        row_ok = rows < n
        w_rows = w_ptr + rows[None, :].to(tl.int64) * stride_wn
        acc = tl.zeros((BLOCK_K, BLOCK_N), tl.float32)
        for step in tl.static_range(K // BLOCK_K):
            ks = step * BLOCK_K + tl.arange(0, BLOCK_K)
            if EVEN_N:
                w = tl.load(w_rows + ks[:, None])
            else:
                w = tl.load(w_rows + ks[:, None], mask=row_ok[None, :], other=0.0)
            acc += tl.load(x_ptr + ks).to(tl.float32)[:, None] * w.to(tl.float32)
        tl.store(out_ptr + rows, tl.sum(acc, 0).to(out_ptr.dtype.element_ty), mask=row_ok)

    return gemv_kernel
