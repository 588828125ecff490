"""The Triton kernels of ``worker.linear_attention.gates`` (one program a token, or a token's head)."""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def delta_gates_kernel(a_ptr, b_ptr, A_log_ptr, dt_bias_ptr, g_ptr, beta_ptr, stride_a, stride_b,
                       HV: tl.constexpr, BH: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    h = tl.arange(0, BH)
    ok = h < HV
    a = tl.load(a_ptr + t * stride_a + h, mask=ok, other=0.0).to(tl.float32)
    b = tl.load(b_ptr + t * stride_b + h, mask=ok, other=0.0)
    x = a + tl.load(dt_bias_ptr + h, mask=ok, other=0.0)
    # torch's softplus: x itself above 20, else log1p(e^x), here as max(x, 0) + log1p(e^-|x|), with
    # log1p(u) ~ u - u^2/2 for small u (log(1 + u) loses u below float32's epsilon)
    u = tl.exp(-tl.abs(x))
    softplus = tl.where(x > 20.0, x, tl.maximum(x, 0.0) + tl.where(u < 1e-4, u - 0.5 * u * u, tl.log(1.0 + u)))
    g = -tl.exp(tl.load(A_log_ptr + h, mask=ok, other=0.0)) * softplus
    tl.store(g_ptr + t * HV + h, g, mask=ok)
    tl.store(beta_ptr + t * HV + h, tl.sigmoid(b.to(tl.float32)).to(beta_ptr.dtype.element_ty), mask=ok)


@triton.jit
def gated_rms_norm_kernel(x_ptr, gate_ptr, weight_ptr, out_ptr, stride_gt, stride_gh, eps,
                          HV: tl.constexpr, DV: tl.constexpr, BD: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)  # token * HV + head
    d = tl.arange(0, BD)
    ok = d < DV
    x = tl.load(x_ptr + row * DV + d, mask=ok, other=0.0)
    xf = x.to(tl.float32)
    normed = (xf * tl.rsqrt(tl.sum(xf * xf, 0) / DV + eps)).to(x.dtype)
    w = tl.load(weight_ptr + d, mask=ok, other=0.0)
    scaled = (w.to(tl.float32) * normed.to(tl.float32)).to(x.dtype)
    z = tl.load(gate_ptr + (row // HV) * stride_gt + (row % HV) * stride_gh + d, mask=ok, other=0.0).to(tl.float32)
    out = scaled.to(tl.float32) * (z * tl.sigmoid(z))
    tl.store(out_ptr + row * DV + d, out.to(out_ptr.dtype.element_ty), mask=ok)
