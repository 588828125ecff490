"""The 4-bit formats' grouped SwiGLU GEMM on CUDA: W4A16 (Hopper has no FP4 MMA; the kernels
unpack e2m1 and apply the scales in registers, ``kernels/grouped_gemm_w4.py``, which picks its
decode path for small batches). The banks hold nvfp4's channel scales as ``[S, N, 1]`` so that
every bank is a matrix per slot; the kernels take them as ``[S, N]``."""
from __future__ import annotations

import torch

from moe_offload.expert_scales import ExpertScales
from moe_offload.slot_fill import SlotFill


def grouped_swiglu_w4(hidden: torch.Tensor, weights: torch.Tensor, slots: torch.Tensor, w13: torch.Tensor,
                      w2: torch.Tensor, scales: ExpertScales, out_dtype: torch.dtype | None = None,
                      backend: str | None = None, fill: SlotFill | None = None, groups: int | None = None,
                      **extras) -> torch.Tensor:
    """``grouped_swiglu`` over packed e2m1 banks ``w13 [S, 2I, H/2]``, ``w2 [S, H, I/2]`` with
    ``scales`` (nvfp4: e4m3 groups and per-row channel scales; mxfp4: e8m0 groups); ``extras``:
    gpt-oss's biases and activation. ``fill``: copied in by the GEMM where its path can (a
    decode batch on the Triton path), else gathered first; ``groups`` as ``grouped_swiglu``'s."""
    from moe_offload.kernels import grouped_gemm_w4

    if fill is not None and not grouped_gemm_w4.fills_in_gemm(hidden, slots, backend):
        fill.gather(w13, w2, scales, backend)
        fill = None
    ch13 = None if scales.w13_channel is None else scales.w13_channel[..., 0]
    ch2 = None if scales.w2_channel is None else scales.w2_channel[..., 0]
    bank13 = grouped_gemm_w4.W4Bank(w13, scales.w13, ch13, extras.pop("w13_bias", None))
    bank2 = grouped_gemm_w4.W4Bank(w2, scales.w2, ch2, extras.pop("w2_bias", None))
    return grouped_gemm_w4.grouped_swiglu_w4(hidden, weights, slots, bank13, bank2, fmt=scales.kind,
                                             out_dtype=out_dtype, backend=backend, fill=fill, groups=groups,
                                             **extras)
