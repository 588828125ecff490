"""Rotary position embedding (rotate-half convention), fused with Qwen3's per-head q/k RMSNorm.

``qk_rope`` turns the q and k parts of the fused QKV projection into rotated, contiguous
``q [T, heads, D]`` and ``k [T, kv_heads, D]`` in one launch on CUDA (grid ``(T, heads +
kv_heads)``, a program per head row); eagerly it is about thirty launches (two norms of ~7, two
rotations of ~9). The kernel rounds where the reference does (norm output, then ``x * cos`` and
``rotate_half(x) * sin`` in the input dtype, then their sum), so on bf16 it matches the eager twin
up to the float32 sum order of the norm.

With a ``KVWrite`` the same launch also stores the rotated k and the new v in one layer's KV
cache at each token's slot (grid ``(T, heads + 2 kv_heads)``: the v programs only copy), which
saves the pool's two ``index_copy_`` launches per layer; a float8 pool gets them rounded
(``worker.kv.gpu_pool.to_kv``), while the returned k stays in the input dtype.

Positions and slots are device data, so the kernel clamps them (positions to the table's
``[0, max_positions)``, slots to the cache's) instead of trusting them for addressing; the twin
indexes and would raise instead.
"""
from __future__ import annotations

import functools
import math
from typing import NamedTuple

import torch

from moe_offload.kernels.triton_support import next_pow2, pdl_args, use_triton
from worker.kv.gpu_pool import check_caches, write_slots
from worker.models.family_config import Yarn
from worker.models.norm import rms_norm_eager
from worker.models.rope_tiles import rope_rows, rope_tables, to_kv


class Rotary:
    """cos/sin tables for every position up to the context length, float32 ``[max_positions, D]``.

    Partial rotary (``rotary_dim`` < D, Qwen3.5 and Qwen3-Next rotate a quarter of each head)
    pairs dim i with i + rotary_dim/2; the kernel pairs i with i + D/2. The loader reorders each
    head's q and k dims by ``partial_rotary_order`` so that the rotated pairs sit where the kernel
    pairs them, and the tables leave the other dims alone (cos 1, sin 0): q.k is unchanged by
    reordering both alike, and no kernel needs a second layout."""

    def __init__(self, head_dim: int, theta: float, max_positions: int, device: torch.device,
                 rotary_dim: int = 0, yarn: Yarn | None = None):
        rotary_dim = rotary_dim or head_dim
        inv_freq = 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim))
        scale = 1.0
        if yarn is not None:
            inv_freq, scale = yarn_inv_freq(yarn, theta, rotary_dim)
        half = torch.zeros(head_dim // 2)
        half[:rotary_dim // 2] = inv_freq  # the pass-through dims turn by a frequency of 0
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), half)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos = (emb.cos() * scale).to(device)
        self.sin = (emb.sin() * scale).to(device)


    def __call__(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """``x [T, heads, D]`` rotated by each token's position ``[T]`` (eager)."""
        cos = self.cos[positions].to(x.dtype)[:, None, :]
        sin = self.sin[positions].to(x.dtype)[:, None, :]
        half = x.shape[-1] // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return x * cos + rotated * sin


def yarn_inv_freq(yarn: Yarn, theta: float, dim: int) -> tuple[torch.Tensor, float]:
    """YaRN's frequencies and cos/sin scale, as transformers' ``_compute_yarn_parameters``: each
    frequency blends the original (extrapolated) and the ``factor``-slower (interpolated) one by a
    ramp over the dims between ``beta_fast`` and ``beta_slow`` rotations in the original context."""
    def correction_dim(rotations: float) -> float:
        return dim * math.log(yarn.original_max_positions / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(yarn.beta_fast), correction_dim(yarn.beta_slow)
    if yarn.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    high = high + 0.001 if low == high else high
    pos_freqs = theta ** (torch.arange(0, dim, 2).float() / dim)
    extrapolation = 1 - ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    inv_freq = (1.0 / (yarn.factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    scale = yarn.attention_factor
    if scale is None:
        scale = 0.1 * math.log(yarn.factor) + 1.0 if yarn.factor > 1 else 1.0
    return inv_freq, float(scale)


def partial_rotary_order(head_dim: int, rotary_dim: int) -> torch.Tensor:
    """For each dim of a reordered head, the checkpoint's dim it holds: the rotated pairs
    (i, i + rotary_dim/2) move to (i, i + head_dim/2), the pass-through dims fill the rest in order."""
    r, d = rotary_dim // 2, head_dim // 2
    rest = list(range(rotary_dim, head_dim))
    first = list(range(r)) + rest[:d - r]
    second = list(range(r, rotary_dim)) + rest[d - r:]
    return torch.tensor(first + second)


class KVWrite(NamedTuple):
    """The new tokens' values and where ``qk_rope`` stores them with the rotated keys."""

    v: torch.Tensor  # [T, kv_heads, D], any strides with a unit last one
    k_cache: torch.Tensor  # [slots, kv_heads, D] contiguous: one layer of the pool (KVPool.layer_slots)
    v_cache: torch.Tensor  # the same for values
    out_loc: torch.Tensor  # [T] int32/int64 slot of each token


class RopeInputs(NamedTuple):
    """What rotates a layer's new q and k and stores its new keys and values (``qk_rope``'s other
    arguments): the attention backend applies it, or, at a decode step on a GPU, the decode
    attention does the same work in its own launch (``paged_decode_attention(rope=...)``)."""

    positions: torch.Tensor  # [T] int32/int64
    rotary: Rotary
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    eps: float
    write: KVWrite

    def apply(self, q: torch.Tensor, k: torch.Tensor, backend: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``qk_rope`` on the projection's ``q, k``: rotated copies, the new keys and values stored."""
        return qk_rope(q, k, self.positions, self.rotary, self.q_norm, self.k_norm, self.eps, write=self.write,
                       backend=backend)

    def check(self, q: torch.Tensor, k: torch.Tensor) -> None:
        """``qk_rope``'s host checks, for a kernel that does its work."""
        _check(q, k, self.positions, self.rotary, self.q_norm, self.k_norm)
        _check_write(self.write, k)


def qk_rope(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, rotary: Rotary,
            q_norm: torch.Tensor | None = None, k_norm: torch.Tensor | None = None, eps: float = 0.0, *,
            write: KVWrite | None = None, backend: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``q [T, heads, D]``, ``k [T, kv_heads, D]`` (any strides with a unit last one, e.g. views
    of the QKV projection) -> rotated contiguous copies, each head RMSNormed first when the
    norm weights ``[D]`` are given (both or neither); with ``write``, the rotated k and
    ``write.v`` are also stored in the caches at ``write.out_loc``."""
    _check(q, k, positions, rotary, q_norm, k_norm)
    if write is not None:
        _check_write(write, k)
    if not use_triton(q, backend) or q.shape[0] == 0:
        return qk_rope_eager(q, k, positions, rotary, q_norm, k_norm, eps, write)
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    k_out = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    _launch(q, k, q_out, k_out, positions, rotary, q_norm, k_norm, eps, write)
    return q_out, k_out


def qk_rope_eager(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, rotary: Rotary,
                  q_norm: torch.Tensor | None, k_norm: torch.Tensor | None, eps: float,
                  write: KVWrite | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    if q_norm is not None:
        q, k = rms_norm_eager(q, q_norm, eps), rms_norm_eager(k, k_norm, eps)
    q, k = rotary(q, positions), rotary(k, positions)
    if write is not None:
        write_slots(write.k_cache, write.out_loc, k)
        write_slots(write.v_cache, write.out_loc, write.v)
    return q, k


def _launch(q: torch.Tensor, k: torch.Tensor, q_out: torch.Tensor, k_out: torch.Tensor, positions: torch.Tensor,
            rotary: Rotary, q_norm: torch.Tensor | None, k_norm: torch.Tensor | None, eps: float,
            write: KVWrite | None) -> None:
    tokens, heads, dim = q.shape
    kv_heads = k.shape[1]
    norm = q_norm is not None
    # without a write the cache arguments are unused stand-ins (the kernel never reads them)
    v, k_cache, v_cache, out_loc = write if write is not None else (k, k_out, k_out, positions)
    _kernel()[(tokens, heads + kv_heads * (2 if write is not None else 1))](
        q, k, v, q_out, k_out, k_cache, v_cache, out_loc, positions, rotary.cos, rotary.sin,
        q_norm if norm else q, k_norm if norm else k,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), k_cache.shape[0],
        rotary.cos.shape[0], eps,
        HEADS=heads, KV_HEADS=kv_heads, DIM=dim, HAS_NORM=norm, WRITE=write is not None,
        num_warps=1 if dim <= 128 else 2, **pdl_args(q))


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


def _check_write(write: KVWrite, k: torch.Tensor) -> None:
    """The kernel stores through raw pointers: the caches' layout is checked here."""
    v, k_cache, v_cache, out_loc = write
    if v.shape != k.shape or v.stride(2) != 1 or v.dtype != k.dtype or v.device != k.device:
        raise ValueError(f"v {tuple(v.shape)} {v.dtype} must match k {tuple(k.shape)} {k.dtype} (unit last stride)")
    if k_cache.dim() != 3 or k_cache.shape[1:] != k.shape[1:] or k_cache.shape[0] < 1:
        raise ValueError(f"k_cache {tuple(k_cache.shape)} must be [slots >= 1, {k.shape[1]}, {k.shape[2]}]")
    if v_cache.shape != k_cache.shape or not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("k_cache and v_cache must be contiguous and of one shape")
    check_caches(k_cache, v_cache, k.dtype)
    if {k_cache.device, v_cache.device} != {k.device}:
        raise ValueError(f"the caches must be on {k.device}")
    if out_loc.shape != (k.shape[0],) or out_loc.dtype not in (torch.int32, torch.int64) or out_loc.device != k.device:
        raise ValueError(f"out_loc must be [{k.shape[0]}] int32/int64 on {k.device}; got {tuple(out_loc.shape)}")


@functools.cache
def _kernel():
    import triton
    import triton.language as tl

    # positions and slots are views into the batch's packed index buffer, at offsets that follow the
    # token count: not specialised on alignment (each program loads one of each)
    @triton.jit(do_not_specialize_on_alignment=["loc_ptr", "pos_ptr"])
    def qk_rope_kernel(q_ptr, k_ptr, v_ptr, q_out_ptr, k_out_ptr, k_cache_ptr, v_cache_ptr, loc_ptr, pos_ptr,
                       cos_ptr, sin_ptr, qw_ptr, kw_ptr, q_stride_t, q_stride_h, k_stride_t, k_stride_h,
                       v_stride_t, v_stride_h, num_slots, max_positions, eps,
                       HEADS: tl.constexpr, KV_HEADS: tl.constexpr, DIM: tl.constexpr, HAS_NORM: tl.constexpr,
                       WRITE: tl.constexpr, PDL: tl.constexpr):
        if PDL:  # see triton_support.pdl_args
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        t = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1)
        cols = tl.arange(0, DIM)
        slot = t  # unused without a write (the grid then has no value programs)
        if WRITE:
            slot = tl.minimum(tl.maximum(tl.load(loc_ptr + t).to(tl.int64), 0), num_slots - 1)
        if h >= HEADS + KV_HEADS:  # a value head: copied into the cache as it is
            kv = h - HEADS - KV_HEADS
            x = tl.load(v_ptr + t * v_stride_t + kv * v_stride_h + cols)
            tl.store(v_cache_ptr + (slot * KV_HEADS + kv) * DIM + cols, to_kv(x, v_cache_ptr.dtype.element_ty))
        else:
            if h < HEADS:
                src = q_ptr + t * q_stride_t + h * q_stride_h
                dst = q_out_ptr + (t * HEADS + h) * DIM
                w_ptr = qw_ptr
            else:
                src = k_ptr + t * k_stride_t + (h - HEADS) * k_stride_h
                dst = k_out_ptr + (t * KV_HEADS + h - HEADS) * DIM
                w_ptr = kw_ptr
            cos, sin = rope_tables(cos_ptr, sin_ptr, pos_ptr, t, max_positions, cols, src.dtype.element_ty, DIM)
            one = tl.arange(0, 1)
            out = tl.reshape(rope_rows(src, 0, one, one == 0, cols, w_ptr, cos, sin, eps, DIM, HAS_NORM), (DIM,))
            tl.store(dst + cols, out)
            if WRITE:
                if h >= HEADS:
                    tl.store(k_cache_ptr + (slot * KV_HEADS + h - HEADS) * DIM + cols,
                             to_kv(out, k_cache_ptr.dtype.element_ty))

    return qk_rope_kernel
