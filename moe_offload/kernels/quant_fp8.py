"""Dynamic fp8 quantization of activations, one scale per token and group of columns.

``x [R, C]`` -> ``q [R, C]`` e4m3 and ``scale [R, ceil(C / group)]`` float32, exactly
``moe_offload.fp8.quantize(x, ScaleBlock(1, group))`` (amax / 448, an all-zero group gets scale 1),
which is the eager twin. The fp8 x fp8 grouped GEMM quantizes its inputs with it; rows at or past
``*total`` (alignment padding that no GEMM block reads) are skipped.

The Triton interpreter of triton 3.9 rounds fp32 -> fp8 without carrying into the exponent
(125.4 -> 64), so this kernel is checked on a GPU only.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from moe_offload.fp8 import ACTIVATION_BLOCK, FP8_DTYPE, FP8_MAX, ScaleBlock, quantize
from moe_offload.kernels.triton_support import use_triton

ACT_GROUP = ACTIVATION_BLOCK.cols  # columns per activation scale; the GEMMs' BLOCK_K must divide it
ROWS_PER_PROGRAM = 16


@triton.jit(do_not_specialize=["num_rows"])  # the batch's rows: a new count compiles nothing
def _quant_groups_kernel(x_ptr, q_ptr, s_ptr, total_ptr, num_rows, cols, num_groups, stride_x,
                         GROUP: tl.constexpr, BLOCK_R: tl.constexpr, HAS_TOTAL: tl.constexpr, FP8_MAX: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    limit = tl.minimum(tl.load(total_ptr), num_rows) if HAS_TOTAL else num_rows
    if tl.program_id(0) * BLOCK_R >= limit:
        return
    group = tl.program_id(1)
    offs = group * GROUP + tl.arange(0, GROUP)
    row_ok = rows < limit
    mask = row_ok[:, None] & (offs < cols)[None, :]
    rows64 = rows.to(tl.int64)
    x = tl.load(x_ptr + rows64[:, None] * stride_x + offs[None, :], mask=mask, other=0.0).to(tl.float32)
    amax = tl.max(tl.abs(x), 1)
    scale = tl.where(amax > 0, tl.math.div_rn(amax, FP8_MAX), 1.0)  # correctly rounded, as torch divides
    q = tl.clamp(tl.math.div_rn(x, scale[:, None]), -FP8_MAX, FP8_MAX)
    tl.store(q_ptr + rows64[:, None] * cols + offs[None, :], q.to(q_ptr.dtype.element_ty), mask=mask)
    tl.store(s_ptr + rows64 * num_groups + group, scale, mask=row_ok)


def quantize_activations(x: torch.Tensor, group: int = ACT_GROUP, total: torch.Tensor | None = None,
                         backend: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [R, C]`` -> ``(q [R, C] fp8, scale [R, ceil(C / group)] float32)``; with ``total``
    ([1] int32 on the device) rows from ``*total`` on are left unwritten."""
    if x.dim() != 2 or x.stride(1) != 1 or group < 1 or group & (group - 1):
        raise ValueError(f"expected x [R, C] with unit column stride and a power-of-two group; "
                         f"got {tuple(x.shape)}, stride {x.stride()}, group {group}")
    if not use_triton(x, backend):
        return quantize(x, ScaleBlock(1, group))
    num_rows, cols = x.shape
    num_groups = triton.cdiv(cols, group)
    q = torch.empty(num_rows, cols, dtype=FP8_DTYPE, device=x.device)
    scale = torch.empty(num_rows, num_groups, dtype=torch.float32, device=x.device)
    if num_rows == 0:
        return q, scale
    grid = (triton.cdiv(num_rows, ROWS_PER_PROGRAM), num_groups)
    _quant_groups_kernel[grid](x, q, scale, total if total is not None else x, num_rows, cols, num_groups, x.stride(0),
                               GROUP=group,
                               BLOCK_R=ROWS_PER_PROGRAM, HAS_TOTAL=total is not None, FP8_MAX=FP8_MAX)
    return q, scale
