"""What an expert format is, as a value: the weight banks' dtype, the block one scale covers, and
for 4-bit formats their name. The rooms (``moe_offload.formats``) say what each format does."""
from __future__ import annotations

from typing import NamedTuple

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP4_KINDS = ("nvfp4", "mxfp4")


class ScaleBlock(NamedTuple):
    """Rows and columns covered by one scale; ``cols == 0`` means the whole row (per channel)."""

    rows: int
    cols: int

    def scale_shape(self, rows: int, cols: int) -> tuple[int, int]:
        """The scale grid of a ``[rows, cols]`` weight."""
        return -(-rows // self.rows), (1 if self.cols == 0 else -(-cols // self.cols))

    def col_block(self, cols: int) -> int:
        """Columns per scale for a weight of ``cols`` input columns."""
        return cols if self.cols == 0 else self.cols


class ExpertFormat(NamedTuple):
    """How expert weights are held: a float dtype; fp8 with scales over ``scale_block``; or e2m1
    codes packed two per byte (``dtype`` uint8) with group scales, ``kind`` "nvfp4" or "mxfp4"."""

    dtype: torch.dtype
    scale_block: ScaleBlock | None = None
    kind: str = ""

    @property
    def family(self) -> str:
        """The room this format lives in: float, fp8, nvfp4 or mxfp4."""
        if self.kind:
            return self.kind
        return "fp8" if self.dtype == FP8_DTYPE else "float"

    @property
    def quantized(self) -> bool:
        return self.scale_block is not None

    @property
    def name(self) -> str:
        """Short and stable (it goes into the expert store's identity): bf16, fp8-b128x128, fp8-ch,
        nvfp4, mxfp4."""
        if self.kind:
            return self.kind
        if not self.quantized:
            return str(self.dtype).removeprefix("torch.").replace("bfloat16", "bf16")
        block = self.scale_block
        return "fp8-ch" if block == ScaleBlock(1, 0) else f"fp8-b{block.rows}x{block.cols}"


NVFP4 = ExpertFormat(torch.uint8, ScaleBlock(1, 16), "nvfp4")
MXFP4 = ExpertFormat(torch.uint8, ScaleBlock(1, 32), "mxfp4")
