"""Float experts (bf16 on a GPU, float32 on the CPU): one part, the weight itself."""
from __future__ import annotations

import torch

from moe_offload.formats.expert_format import ExpertFormat
from moe_offload.formats.room import MatrixPart


class FloatFormat:
    family = "float"

    def parts(self, fmt: ExpertFormat, rows: int, cols: int) -> tuple[MatrixPart, ...]:
        return (MatrixPart("", (rows, cols), fmt.dtype),)

    def quantize(self, fmt: ExpertFormat, w: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return (w.to(fmt.dtype),)

    def dequantize(self, fmt: ExpertFormat, parts: tuple[torch.Tensor, ...], dtype: torch.dtype) -> torch.Tensor:
        return parts[0].to(dtype)
