"""The 4-bit formats' grouped SwiGLU GEMM on CUDA: W4A16 (Hopper has no FP4 MMA; the kernels
unpack e2m1 and apply the scales in registers, ``kernels/grouped_gemm_w4.py``), the decode
variant for batches of at most ``DECODE_MAX_PAIRS`` (token, expert) pairs. Until those kernels are
there, ``grouped_swiglu`` runs the eager twin instead (it reads the routing on the host: a sync),
after one warning."""
from __future__ import annotations

import functools
import importlib.util
import logging

import torch

from moe_offload.expert_scales import ExpertScales

log = logging.getLogger("sluice.moe")


@functools.cache
def has_w4_kernels() -> bool:
    if importlib.util.find_spec("moe_offload.kernels.grouped_gemm_w4") is not None:
        return True
    log.warning("moe_offload/kernels/grouped_gemm_w4.py is missing: 4-bit experts run the eager twin (syncs)")
    return False


def grouped_swiglu_w4(hidden: torch.Tensor, weights: torch.Tensor, slots: torch.Tensor, w13: torch.Tensor,
                      w2: torch.Tensor, scales: ExpertScales, out_dtype: torch.dtype | None = None,
                      **extras) -> torch.Tensor:
    """``grouped_swiglu`` over packed e2m1 banks ``w13 [S, 2I, H/2]``, ``w2 [S, H, I/2]`` with
    ``scales`` (nvfp4: e4m3 groups and per-row channel scales ``[S, N, 1]``, passed as ``[S, N]``;
    mxfp4: e8m0 groups)."""
    from moe_offload.kernels import grouped_gemm_w4
    from moe_offload.kernels.grouped_gemm_decode import DECODE_MAX_PAIRS

    ch13 = None if scales.w13_channel is None else scales.w13_channel[..., 0]
    ch2 = None if scales.w2_channel is None else scales.w2_channel[..., 0]
    args = (hidden, weights, slots, w13, scales.w13, ch13, w2, scales.w2, ch2)
    gemm = (grouped_gemm_w4.decode_grouped_swiglu_w4 if slots.numel() <= DECODE_MAX_PAIRS
            else grouped_gemm_w4.fused_grouped_swiglu_w4)
    return gemm(*args, fmt=scales.kind, out_dtype=out_dtype or hidden.dtype, **extras)  # gpt-oss: biases, activation
