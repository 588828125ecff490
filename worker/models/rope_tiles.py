"""The rotary embedding's arithmetic as a Triton piece, shared by ``qk_rope``'s kernel
(``worker.models.rotary``) and the decode attention that rotates its own queries and new keys
(``worker.attention.decode_kernel``), so both round where the eager twin does.

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
