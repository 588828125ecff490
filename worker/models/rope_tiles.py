"""The rotary embedding as Triton pieces, shared by ``qk_rope``'s kernel (``worker.models.rotary``)
and the decode attention that rotates its own queries and new keys
(``worker.attention.decode_kernel``), so both read and round as the eager twin does; with them
``to_kv``, how both round a new key or value into the pool's dtype.

May import: triton only.
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def norm_rope(x, x_p, w, w_p, cos, sin, low, eps, DIM: tl.constexpr, HAS_NORM: tl.constexpr):
    """Rows ``x [R, DIM]`` (a head each) RMSNormed by ``w`` (HAS_NORM), then rotated: ``x_p`` is the
    same rows read at each column's partner (``(i + DIM/2) % DIM``) and ``w_p`` the weight there;
    ``cos, sin [1, DIM]`` are float32 already rounded to x's dtype, ``low`` marks the columns below
    DIM/2. Rounded to x's dtype after the norm, after ``x * cos`` and ``rotate_half(x) * sin``, and
    after their sum, as ``qk_rope_eager``."""
    dtype = x.dtype
    if HAS_NORM:
        xf = x.to(tl.float32)
        inv = (1.0 / tl.sqrt(tl.sum(xf * xf, axis=1) / DIM + eps))[:, None]
        x = ((xf * inv).to(dtype).to(tl.float32) * w).to(dtype)
        x_p = ((x_p.to(tl.float32) * inv).to(dtype).to(tl.float32) * w_p).to(dtype)
    rotated = tl.where(low, -x_p.to(tl.float32), x_p.to(tl.float32))
    a = (x.to(tl.float32) * cos).to(dtype).to(tl.float32)
    b = (rotated * sin).to(dtype).to(tl.float32)
    return (a + b).to(dtype)


@triton.jit
def rope_tables(cos_ptr, sin_ptr, pos_ptr, t, max_positions, cols, dtype: tl.constexpr, DIM: tl.constexpr):
    """Token ``t``'s rows of the cos and sin tables (its position clamped into them), rounded to
    ``dtype`` as the twin does: ``[1, DIM]`` float32 each."""
    pos = tl.minimum(tl.maximum(tl.load(pos_ptr + t).to(tl.int64), 0), max_positions - 1)
    cos = tl.load(cos_ptr + pos * DIM + cols).to(dtype).to(tl.float32)[None, :]
    sin = tl.load(sin_ptr + pos * DIM + cols).to(dtype).to(tl.float32)[None, :]
    return cos, sin


@triton.jit
def rope_rows(src, stride_h, rows, row_ok, cols, w_ptr, cos, sin, eps, DIM: tl.constexpr, HAS_NORM: tl.constexpr):
    """Heads ``rows`` of one token's projection at ``src`` (row stride ``stride_h``), normed by the
    weights at ``w_ptr`` (HAS_NORM) and rotated by ``rope_tables``' ``cos, sin``: ``[R, DIM]``."""
    half: tl.constexpr = DIM // 2
    partner = (cols + half) % DIM
    x = tl.load(src + rows[:, None] * stride_h + cols[None, :], mask=row_ok[:, None], other=0.0)
    x_p = tl.load(src + rows[:, None] * stride_h + partner[None, :], mask=row_ok[:, None], other=0.0)
    w, w_p = cos, cos  # unread without a norm
    if HAS_NORM:
        w = tl.load(w_ptr + cols).to(tl.float32)[None, :]
        w_p = tl.load(w_ptr + partner).to(tl.float32)[None, :]
    return norm_rope(x, x_p, w, w_p, cos, sin, (cols < half)[None, :], eps, DIM, HAS_NORM)


@triton.jit
def to_kv(x, dtype: tl.constexpr):
    """``x`` as the KV pool stores it (``worker.kv.gpu_pool.to_kv``): float8 e4m3 saturates at +-448
    (scale 1) and rounds to nearest, ties to even; any other dtype is a plain cast. The rounding is
    done in float32 on e4m3's grid (3 mantissa bits, spacing 2^-9 below 2^-6), so the cast itself is
    exact: Triton's interpreter rounds a float8 cast half up and can lose the carry into the exponent."""
    if dtype == tl.float8e4nv:
        bits = tl.clamp(x.to(tl.float32), -448.0, 448.0).to(tl.int32, bitcast=True)
        biased = tl.maximum((bits >> 23) & 0xFF, 121)  # the exponent + 127, at least e4m3's smallest normal's
        step = ((biased - 3) << 23).to(tl.float32, bitcast=True)  # e4m3's spacing there
        y = (bits & 0x7FFFFFFF).to(tl.float32, bitcast=True) / step  # |x| in steps: exact, at most 14
        low = tl.floor(y)
        odd = low - 2.0 * tl.floor(low * 0.5)
        near = (low + ((y - low > 0.5) | ((y - low == 0.5) & (odd != 0.0))).to(tl.float32)) * step
        signed = near.to(tl.int32, bitcast=True) | ((bits >> 31) << 31)  # the sign as it was, -0.0 too
        return signed.to(tl.float32, bitcast=True).to(dtype)
    return x.to(dtype)
