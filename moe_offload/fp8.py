"""FP8 (e4m3) expert weights with float32 scales: the format, quantization and its inverse.

A quantized weight ``[N, K]`` (output rows, input columns) is stored as ``q`` in
``torch.float8_e4m3fn`` and ``scale`` in float32, one scale per block of ``ScaleBlock`` rows and
columns; dequantized, ``w[n, k] = q[n, k] * scale[n // rows, k // cols]``. Both checkpoint layouts
Sluice reads fit this one form:

```
 Hugging Face fine-grained fp8 (weight_scale_inv)   ScaleBlock(128, 128)   scale [ceil(N/128), ceil(K/128)]
 compressed-tensors, one scale per output channel   ScaleBlock(1, 0)       scale [N, 1]   (cols 0 = whole row)
```

``w13 [2I, H]`` stacks the gate's rows on the up's, and each half keeps its own scale grid (as
the checkpoint's ``gate_proj`` and ``up_proj`` do), so ``w13``'s scale is the gate's grid stacked on
the up's: ``[2 * ceil(I / rows), C]``. When ``I`` is not a multiple of ``rows`` this differs from
the grid of one ``[2I, H]`` matrix; ``quantize_w13`` / ``dequantize_w13`` handle the halves.

The scale multiplies (Hugging Face calls it ``weight_scale_inv`` because it is the inverse of the
quantization's scale; compressed-tensors calls the same factor ``weight_scale``).
"""
from __future__ import annotations

import torch

from moe_offload.formats.expert_format import FP8_DTYPE, ScaleBlock

FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448


BLOCK_128 = ScaleBlock(128, 128)
PER_CHANNEL = ScaleBlock(1, 0)
# Activations quantized on the fly (fp8 x fp8 GEMMs): one scale per token and 128 columns.
ACTIVATION_BLOCK = ScaleBlock(1, 128)


def expand_scale(scale: torch.Tensor, block: ScaleBlock, rows: int, cols: int) -> torch.Tensor:
    """``scale [..., R, C]`` -> one factor per element ``[..., rows, cols]`` (float32)."""
    col_block = block.col_block(cols)
    full = scale.float().repeat_interleave(block.rows, dim=-2).repeat_interleave(col_block, dim=-1)
    return full[..., :rows, :cols]


def dequantize(q: torch.Tensor, scale: torch.Tensor, block: ScaleBlock, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``q [..., N, K]`` fp8 and its ``scale [..., R, C]`` -> ``[..., N, K]`` in ``dtype``."""
    rows, cols = q.shape[-2:]
    _check_scale(q.shape, scale.shape, block)
    return (q.float() * expand_scale(scale, block, rows, cols)).to(dtype)


def amax_scale(amax: torch.Tensor) -> torch.Tensor:
    """``amax / 448`` correctly rounded on every device (1 where ``amax`` is 0). CUDA divides by a
    Python scalar as a multiplication by its reciprocal, 1 ulp off now and then; a tensor divisor
    keeps the true division that the Triton quantizer (``div_rn``) and the CPU perform."""
    return torch.where(amax > 0, amax, FP8_MAX) / torch.full_like(amax, FP8_MAX)


def quantize(w: torch.Tensor, block: ScaleBlock = BLOCK_128) -> tuple[torch.Tensor, torch.Tensor]:
    """``w [..., N, K]`` -> ``(q fp8 [..., N, K], scale float32 [..., R, C])`` by amax per block.

    An all-zero block gets scale 1 (its ``q`` is zero either way), so no scale is ever 0 or inf.
    """
    rows, cols = w.shape[-2:]
    grid_r, grid_c = block.scale_shape(rows, cols)
    col_block = block.col_block(cols)
    pad_r, pad_c = grid_r * block.rows - rows, grid_c * col_block - cols
    padded = torch.nn.functional.pad(w.float(), (0, pad_c, 0, pad_r))
    tiles = padded.reshape(*w.shape[:-2], grid_r, block.rows, grid_c, col_block)
    amax = tiles.abs().amax(dim=(-3, -1))
    scale = amax_scale(amax)
    q = (w.float() / expand_scale(scale, block, rows, cols)).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q, scale


def w13_scale_shape(block: ScaleBlock, inter: int, hidden: int) -> tuple[int, int]:
    rows, cols = block.scale_shape(inter, hidden)
    return 2 * rows, cols


def quantize_w13(w13: torch.Tensor, block: ScaleBlock = BLOCK_128) -> tuple[torch.Tensor, torch.Tensor]:
    """``w13 [..., 2I, H]`` -> fp8 and the gate's scale grid stacked on the up's."""
    inter = w13.shape[-2] // 2
    gate_q, gate_s = quantize(w13[..., :inter, :], block)
    up_q, up_s = quantize(w13[..., inter:, :], block)
    return torch.cat([gate_q, up_q], dim=-2), torch.cat([gate_s, up_s], dim=-2)


def dequantize_w13(q: torch.Tensor, scale: torch.Tensor, block: ScaleBlock,
                   dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Inverse of ``quantize_w13``."""
    inter, rows = q.shape[-2] // 2, scale.shape[-2] // 2
    gate = dequantize(q[..., :inter, :], scale[..., :rows, :], block, dtype)
    up = dequantize(q[..., inter:, :], scale[..., rows:, :], block, dtype)
    return torch.cat([gate, up], dim=-2)


def _check_scale(weight_shape: torch.Size, scale_shape: torch.Size, block: ScaleBlock) -> None:
    want = block.scale_shape(*weight_shape[-2:])
    if tuple(scale_shape[-2:]) != want or tuple(scale_shape[:-2]) != tuple(weight_shape[:-2]):
        raise ValueError(f"scale {tuple(scale_shape)} does not fit weight {tuple(weight_shape)} "
                         f"with {block.rows}x{block.cols or 'row'} blocks (want [..., {want[0]}, {want[1]}])")
