"""MXFP4 experts: e2m1 codes packed two per byte and an e8m0 scale (a power of two, bias 127,
stored as uint8) per 32 columns (``moe_offload.fp4``)."""
from __future__ import annotations

import torch

from moe_offload import fp4
from moe_offload.formats.expert_format import ExpertFormat
from moe_offload.formats.room import MatrixPart, fp4_parts


class MXFP4Format:
    family = "mxfp4"
    group = fp4.MXFP4_GROUP

    def parts(self, fmt: ExpertFormat, rows: int, cols: int) -> tuple[MatrixPart, ...]:
        return fp4_parts(self.family, self.group, rows, cols, torch.uint8)

    def quantize(self, fmt: ExpertFormat, w: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return fp4.quantize_mxfp4(w)

    def dequantize(self, fmt: ExpertFormat, parts: tuple[torch.Tensor, ...], dtype: torch.dtype) -> torch.Tensor:
        return fp4.dequantize_mxfp4(parts[0], parts[1], dtype)
