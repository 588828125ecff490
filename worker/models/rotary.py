"""Rotary position embedding (rotate-half convention), fused with Qwen3's per-head q/k RMSNorm.

``qk_rope`` turns the q and k parts of the fused QKV projection into rotated, contiguous
``q [T, heads, D]`` and ``k [T, kv_heads, D]`` in one launch on CUDA (grid ``(T, heads +
kv_heads)``, a program per head row); eagerly it is about thirty launches (two norms of ~7, two
rotations of ~9). The kernel rounds where the reference does (norm output, then ``x * cos`` and
``rotate_half(x) * sin`` in the input dtype, then their sum), so on bf16 it matches the eager twin
up to the float32 sum order of the norm.

Positions are device data, so the kernel clamps them to the table (``[0, max_positions)``) instead
of trusting them for addressing; the twin indexes the table and would raise instead.
"""
from __future__ import annotations

import functools

import torch

from moe_offload.kernels.triton_support import next_pow2, use_triton
from worker.models.norm import rms_norm_eager


class Rotary:
    """cos/sin tables for every position up to the context length, float32 ``[max_positions, D]``."""

    def __init__(self, head_dim: int, theta: float, max_positions: int, device: torch.device):
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos = emb.cos().to(device)
        self.sin = emb.sin().to(device)

    def __call__(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """``x [T, heads, D]`` rotated by each token's position ``[T]`` (eager)."""
        cos = self.cos[positions].to(x.dtype)[:, None, :]
        sin = self.sin[positions].to(x.dtype)[:, None, :]
        half = x.shape[-1] // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return x * cos + rotated * sin


def qk_rope(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, rotary: Rotary,
            q_norm: torch.Tensor | None = None, k_norm: torch.Tensor | None = None, eps: float = 0.0, *,
            backend: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``q [T, heads, D]``, ``k [T, kv_heads, D]`` (any strides with a unit last one, e.g. views
    of the QKV projection) -> rotated contiguous copies, each head RMSNormed first when the
    norm weights ``[D]`` are given (both or neither)."""
    _check(q, k, positions, rotary, q_norm, k_norm)
    if not use_triton(q, backend) or q.shape[0] == 0:
        return qk_rope_eager(q, k, positions, rotary, q_norm, k_norm, eps)
    tokens, heads, dim = q.shape
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    k_out = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    norm = q_norm is not None
    _kernel()[(tokens, heads + k.shape[1])](
        q, k, q_out, k_out, positions, rotary.cos, rotary.sin, q_norm if norm else q, k_norm if norm else k,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), rotary.cos.shape[0], eps,
        HEADS=heads, KV_HEADS=k.shape[1], DIM=dim, HAS_NORM=norm, num_warps=1 if dim <= 128 else 2)
    return q_out, k_out


def qk_rope_eager(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, rotary: Rotary,
                  q_norm: torch.Tensor | None, k_norm: torch.Tensor | None,
                  eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    if q_norm is not None:
        q, k = rms_norm_eager(q, q_norm, eps), rms_norm_eager(k, k_norm, eps)
    return rotary(q, positions), rotary(k, positions)


def _check(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, rotary: Rotary,
           q_norm: torch.Tensor | None, k_norm: torch.Tensor | None) -> None:
    if q.dim() != 3 or k.dim() != 3 or q.shape[0] != k.shape[0] or q.shape[2] != k.shape[2]:
        raise ValueError(f"expected q [T, heads, D] and k [T, kv_heads, D]; got {tuple(q.shape)}, {tuple(k.shape)}")
    dim = q.shape[2]
    if dim % 2 or dim != next_pow2(dim) or rotary.cos.shape[1] != dim:
        raise ValueError(f"head dim {dim} must be a power of two matching the rotary tables {tuple(rotary.cos.shape)}")
    if q.stride(2) != 1 or k.stride(2) != 1 or q.dtype != k.dtype:
        raise ValueError("q and k need unit stride in the head dim and one dtype")
    if positions.shape != (q.shape[0],) or positions.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"positions must be [{q.shape[0]}] int32/int64; got {tuple(positions.shape)} {positions.dtype}")
    if (q_norm is None) != (k_norm is None):
        raise ValueError("give both q and k norm weights or neither")
    if q_norm is not None and (q_norm.shape != (dim,) or k_norm.shape != (dim,) or q_norm.dtype != q.dtype):
        raise ValueError(f"norm weights must be [{dim}] in {q.dtype}")


@functools.cache
def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def qk_rope_kernel(q_ptr, k_ptr, q_out_ptr, k_out_ptr, pos_ptr, cos_ptr, sin_ptr, qw_ptr, kw_ptr,
                       q_stride_t, q_stride_h, k_stride_t, k_stride_h, max_positions, eps,
                       HEADS: tl.constexpr, KV_HEADS: tl.constexpr, DIM: tl.constexpr, HAS_NORM: tl.constexpr):
        t = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1)
        is_q = h < HEADS
        if is_q:
            src = q_ptr + t * q_stride_t + h * q_stride_h
            dst = q_out_ptr + (t * HEADS + h) * DIM
            w_ptr = qw_ptr
        else:
            src = k_ptr + t * k_stride_t + (h - HEADS) * k_stride_h
            dst = k_out_ptr + (t * KV_HEADS + h - HEADS) * DIM
            w_ptr = kw_ptr
        cols = tl.arange(0, DIM)
        half: tl.constexpr = DIM // 2
        partner = (cols + half) % DIM
        x = tl.load(src + cols)
        x_p = tl.load(src + partner)
        dtype = x.dtype
        if HAS_NORM:
            xf = x.to(tl.float32)
            inv = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / DIM + eps)
            w = tl.load(w_ptr + cols).to(tl.float32)
            w_p = tl.load(w_ptr + partner).to(tl.float32)
            x = ((xf * inv).to(dtype).to(tl.float32) * w).to(dtype)
            x_p = ((x_p.to(tl.float32) * inv).to(dtype).to(tl.float32) * w_p).to(dtype)
        pos = tl.minimum(tl.maximum(tl.load(pos_ptr + t).to(tl.int64), 0), max_positions - 1)
        cos = tl.load(cos_ptr + pos * DIM + cols).to(dtype).to(tl.float32)
        sin = tl.load(sin_ptr + pos * DIM + cols).to(dtype).to(tl.float32)
        rotated = tl.where(cols < half, -x_p.to(tl.float32), x_p.to(tl.float32))
        a = (x.to(tl.float32) * cos).to(dtype).to(tl.float32)
        b = (rotated * sin).to(dtype).to(tl.float32)
        tl.store(dst + cols, (a + b).to(dtype))

    return qk_rope_kernel
