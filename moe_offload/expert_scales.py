"""The scale banks that travel beside quantized expert weights, per slot (or per expert id):
what the grouped GEMM, the gathers and the staging take. Float experts have none."""
from __future__ import annotations

from typing import NamedTuple

import torch

from moe_offload.formats.expert_format import FP8_DTYPE, ExpertFormat, ScaleBlock


class ExpertScales(NamedTuple):
    """``w13 [N, R13, C13]``, ``w2 [N, R2, C2]`` over ``block`` (fp8: float32 grids; nvfp4: e4m3 per
    16 columns; mxfp4: e8m0 bytes per 32); nvfp4 adds its float32 per-row global scales
    ``w13_channel [N, 2I, 1]``, ``w2_channel [N, H, 1]``. ``kind``: "" for fp8, else the 4-bit format."""

    w13: torch.Tensor
    w2: torch.Tensor
    block: ScaleBlock
    w13_channel: torch.Tensor | None = None
    w2_channel: torch.Tensor | None = None
    kind: str = ""

    @property
    def format(self) -> ExpertFormat:
        return ExpertFormat(torch.uint8 if self.kind else FP8_DTYPE, self.block, self.kind)

    def tensors(self) -> tuple[torch.Tensor, ...]:
        """Every scale bank present, in bank order (the gathers and staging move them as bytes)."""
        return tuple(t for t in (self.w13, self.w2, self.w13_channel, self.w2_channel) if t is not None)

    def with_tensors(self, tensors: tuple[torch.Tensor, ...] | list[torch.Tensor]) -> ExpertScales:
        """The same scales over other banks (e.g. a buffer's views), given in ``tensors()``'s order."""
        channels = tuple(tensors[2:]) if len(tensors) > 2 else (None, None)
        return self._replace(w13=tensors[0], w2=tensors[1], w13_channel=channels[0], w2_channel=channels[1])
