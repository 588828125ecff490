"""RMSNorm, alone and fused with the residual add before it: one launch per norm on CUDA.

A decode step is bound by kernel count, not bytes (a profile of qwen3-30b-geometry at batch 1 on
the H200: ~1,450 kernels a step, most of them 1-2 µs elementwise glue). The eager norm is about
eight launches (cast, square, mean, add, rsqrt, multiply, cast, scale) and the residual add one
more; the kernel does all of it in one pass over each row.

Numerics follow the reference (Hugging Face's RMSNorm): the residual sum is rounded to the input
dtype, normalised in float32, rounded to the input dtype, then multiplied by the weight (the
product rounded once more).
"""
from __future__ import annotations

import functools

import torch

from moe_offload.kernels.triton_support import next_pow2, num_warps_for, pdl_args, use_triton


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, *, backend: str | None = None) -> torch.Tensor:
    """``x [..., D]`` normalised over its last dimension and scaled by ``weight [D]``."""
    _check(x, None, weight)
    if not use_triton(x, backend) or x.numel() == 0:
        return rms_norm_eager(x, weight, eps)
    return _launch(x, None, weight, eps)[0]


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, *,
                 backend: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``s = x + residual``; returns ``(rms_norm(s), s)``: the pre-norm block's residual step."""
    _check(x, residual, weight)
    if not use_triton(x, backend) or x.numel() == 0:
        return add_rms_norm_eager(x, residual, weight, eps)
    return _launch(x, residual, weight, eps)


def rms_norm_eager(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Normalise in float32 and scale in the input dtype, as the reference implementation does."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def add_rms_norm_eager(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                       eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    summed = x + residual
    return rms_norm_eager(summed, weight, eps), summed


def _check(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor) -> None:
    if weight.dim() != 1 or x.shape[-1] != weight.shape[0]:
        raise ValueError(f"weight {tuple(weight.shape)} does not fit rows of {x.shape[-1]}")
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype):
        raise ValueError(f"residual {tuple(residual.shape)} {residual.dtype} must match x {tuple(x.shape)} {x.dtype}")
    if x.dtype != weight.dtype or (x.device != weight.device):
        raise ValueError(f"x and weight must share dtype and device; got {x.dtype}/{weight.dtype}")


def _launch(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
            eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    dim = x.shape[-1]
    rows_in = x.reshape(-1, dim).contiguous()
    res_in = residual.reshape(-1, dim).contiguous() if residual is not None else rows_in
    out = torch.empty_like(rows_in)
    summed = torch.empty_like(rows_in) if residual is not None else rows_in
    block = next_pow2(dim)
    _kernel()[(rows_in.shape[0],)](rows_in, res_in, weight, out, summed, dim, eps,
                                   HAS_RESIDUAL=residual is not None, BLOCK=block, num_warps=num_warps_for(block),
                                   **pdl_args(rows_in))
    return out.view(x.shape), summed.view(x.shape)


@functools.cache
def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def add_rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, sum_ptr, dim, eps,
                            HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
        if PDL:  # see triton_support.pdl_args
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        row = tl.program_id(0).to(tl.int64) * dim
        cols = tl.arange(0, BLOCK)
        live = cols < dim
        x = tl.load(x_ptr + row + cols, mask=live, other=0.0)
        if HAS_RESIDUAL:
            x = (x.to(tl.float32) + tl.load(res_ptr + row + cols, mask=live, other=0.0).to(tl.float32)).to(x.dtype)
            tl.store(sum_ptr + row + cols, x, mask=live)
        xf = x.to(tl.float32)
        inv = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / dim + eps)
        normed = (xf * inv).to(x.dtype).to(tl.float32)
        w = tl.load(w_ptr + cols, mask=live, other=0.0).to(tl.float32)
        tl.store(out_ptr + row + cols, (normed * w).to(x.dtype), mask=live)

    return add_rms_norm_kernel
