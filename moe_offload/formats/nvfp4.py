"""NVFP4 experts: e2m1 codes packed two per byte, an e4m3 scale per 16 columns and a float32
global scale per matrix, held per output row (``moe_offload.fp4``). The channel part is
``[N, 1]`` in the banks, so that every bank is a matrix per expert; the GEMM takes it as ``[N]``."""
from __future__ import annotations

import torch

from moe_offload import fp4
from moe_offload.formats.expert_format import ExpertFormat
from moe_offload.formats.room import MatrixPart, fp4_parts


class NVFP4Format:
    family = "nvfp4"
    group = fp4.NVFP4_GROUP

    def parts(self, fmt: ExpertFormat, rows: int, cols: int) -> tuple[MatrixPart, ...]:
        return (*fp4_parts(self.family, self.group, rows, cols, torch.float8_e4m3fn),
                MatrixPart("_channel_scale", (rows, 1), torch.float32))

    def quantize(self, fmt: ExpertFormat, w: torch.Tensor) -> tuple[torch.Tensor, ...]:
        packed, scale, channel = fp4.quantize_nvfp4(w)
        return packed, scale, channel[..., None]

    def dequantize(self, fmt: ExpertFormat, parts: tuple[torch.Tensor, ...], dtype: torch.dtype) -> torch.Tensor:
        packed, scale, channel = parts
        return fp4.dequantize_nvfp4(packed, scale, channel[..., 0], dtype)

