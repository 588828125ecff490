"""The elementwise glue of a Gated DeltaNet layer, one launch each instead of torch's chain of
small kernels (about fifteen a layer; at batch 1 a decode step is bound by launches, not bytes):

    delta_gates      a, b [T, Hv] -> g = -exp(A_log) softplus(a + dt_bias) (float32), beta = sigmoid(b)
    gated_rms_norm   o, z [T, Hv, Dv] -> RMSNorm(o) * weight * SiLU(z), per head

CUDA tensors run the Triton kernels of ``gates_kernel.py``; other devices the eager twins here,
which round where transformers' modules do (the kernels follow them).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from moe_offload.kernels.triton_support import next_pow2, use_triton


def delta_gates(a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor, *,
                backend: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``a, b [T, Hv]`` (views of the input projection), ``A_log, dt_bias [Hv]`` float32 -> the
    decay ``g [T, Hv]`` float32 and ``beta [T, Hv]`` in b's dtype."""
    T, Hv = a.shape
    if b.shape != (T, Hv) or A_log.shape != (Hv,) or dt_bias.shape != (Hv,):
        raise ValueError(f"a {tuple(a.shape)}, b {tuple(b.shape)}, A_log {tuple(A_log.shape)}, "
                         f"dt_bias {tuple(dt_bias.shape)} do not match")
    if a.stride(1) != 1 or b.stride(1) != 1 or A_log.dtype != torch.float32 or dt_bias.dtype != torch.float32:
        raise ValueError("a and b need unit column strides, A_log and dt_bias float32")
    if not use_triton(a, backend) or T == 0:
        return delta_gates_eager(a, b, A_log, dt_bias)
    from worker.linear_attention.gates_kernel import delta_gates_kernel

    g = torch.empty((T, Hv), dtype=torch.float32, device=a.device)
    beta = torch.empty((T, Hv), dtype=b.dtype, device=b.device)
    delta_gates_kernel[(T,)](a, b, A_log, dt_bias, g, beta, a.stride(0), b.stride(0), HV=Hv, BH=next_pow2(Hv))
    return g, beta


def delta_gates_eager(a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor,
                      dt_bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return -A_log.exp() * F.softplus(a.float() + dt_bias), torch.sigmoid(b)


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float, *,
                   backend: str | None = None) -> torch.Tensor:
    """``x [T, Hv, Dv]``, ``gate`` of the same shape (any token and head strides), ``weight [Dv]``
    -> ``[T, Hv, Dv]`` in x's dtype: each head's RMSNorm, scaled, times SiLU(gate)."""
    T, Hv, Dv = x.shape
    x = x.contiguous()
    if gate.shape != x.shape or weight.shape != (Dv,) or gate.stride(2) != 1:
        raise ValueError(f"x {tuple(x.shape)}, gate {tuple(gate.shape)} (unit last stride) and "
                         f"weight {tuple(weight.shape)} do not match")
    if weight.dtype != x.dtype:
        raise ValueError(f"the norm's weight ({weight.dtype}) must be in x's dtype ({x.dtype})")
    if not use_triton(x, backend) or T == 0:
        return gated_rms_norm_eager(x, gate, weight, eps)
    from worker.linear_attention.gates_kernel import gated_rms_norm_kernel

    out = torch.empty_like(x)
    gated_rms_norm_kernel[(T * Hv,)](x, gate, weight, out, gate.stride(0), gate.stride(1), eps, HV=Hv, DV=Dv,
                                     BD=next_pow2(Dv))
    return out


def gated_rms_norm_eager(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' gated RMSNorm: normalised in float32 and rounded, scaled by the weight in x's
    dtype, then times SiLU of the gate in float32."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return ((weight * xf.to(x.dtype)) * F.silu(gate.float())).to(x.dtype)
