"""What every weight format (a "room") tells the rest of Sluice: the parts one matrix is stored
in, how a float matrix becomes those parts and back. Everything else (the store, the cache, the
gathers, the staging) moves the parts as banks of bytes.

A matrix ``[N, K]`` is a tuple of parts, each ``[rows, cols]`` with its own dtype and a bank-name
suffix ("" for the weight, then e.g. "_scale", "_channel_scale"). ``w13`` is the gate's parts
stacked on the up's, row by row, so each half keeps its own scales.
"""
from __future__ import annotations

from typing import NamedTuple, Protocol

import torch

from moe_offload.formats.expert_format import ExpertFormat


class MatrixPart(NamedTuple):
    suffix: str
    shape: tuple[int, int]
    dtype: torch.dtype


def fp4_parts(family: str, group: int, rows: int, cols: int, scale_dtype: torch.dtype) -> tuple[MatrixPart, ...]:
    """A 4-bit room's codes (e2m1, two per byte) and its scale per ``group`` columns."""
    if cols % group:
        raise ValueError(f"{family} needs input dims that are multiples of {group}; got {cols}")
    return MatrixPart("", (rows, cols // 2), torch.uint8), MatrixPart("_scale", (rows, cols // group), scale_dtype)


class WeightFormat(Protocol):
    family: str

    def parts(self, fmt: ExpertFormat, rows: int, cols: int) -> tuple[MatrixPart, ...]:
        """The parts a ``[rows, cols]`` matrix is held in."""
        ...

    def quantize(self, fmt: ExpertFormat, w: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """A float ``[..., N, K]`` matrix -> its parts in ``fmt``."""
        ...

    def dequantize(self, fmt: ExpertFormat, parts: tuple[torch.Tensor, ...], dtype: torch.dtype) -> torch.Tensor:
        """Its parts -> the matrix in ``dtype``."""
        ...
