"""FP8 (e4m3) experts: the weight and a float32 scale per ``ScaleBlock`` (``moe_offload.fp8``)."""
from __future__ import annotations

import torch

from moe_offload import fp8
from moe_offload.formats.expert_format import ExpertFormat
from moe_offload.formats.room import MatrixPart


class FP8Format:
    family = "fp8"

    def parts(self, fmt: ExpertFormat, rows: int, cols: int) -> tuple[MatrixPart, ...]:
        return (MatrixPart("", (rows, cols), fp8.FP8_DTYPE),
                MatrixPart("_scale", fmt.scale_block.scale_shape(rows, cols), torch.float32))

    def quantize(self, fmt: ExpertFormat, w: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return fp8.quantize(w, fmt.scale_block)

    def dequantize(self, fmt: ExpertFormat, parts: tuple[torch.Tensor, ...], dtype: torch.dtype) -> torch.Tensor:
        return fp8.dequantize(parts[0], parts[1], fmt.scale_block, dtype)
