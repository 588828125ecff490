"""Expert weight formats, one room each (``float``, ``fp8``, ``nvfp4``, ``mxfp4``), found through
``room_of``. A room knows the parts a matrix is stored in and how to quantize and dequantize it;
the store, the cache, the gathers and the staging move those parts as banks of bytes.

```
 format   w13 / w2 banks (one expert)          scale banks                         channel banks
 float    [2I, H] / [H, I]  bf16|fp32          -                                   -
 fp8      [2I, H] / [H, I]  e4m3               float32 per ScaleBlock              -
 nvfp4    [2I, H/2] / [H, I/2]  uint8 (e2m1)   e4m3 [2I, H/16] / [H, I/16]         float32 [2I, 1] / [H, 1]
 mxfp4    [2I, H/2] / [H, I/2]  uint8 (e2m1)   uint8 e8m0 [2I, H/32] / [H, I/32]   -
```
"""
from __future__ import annotations

import torch

from moe_offload.choices import EXPERT_DTYPES
from moe_offload.formats.expert_format import FP4_KINDS, FP8_DTYPE, MXFP4, NVFP4, ExpertFormat, ScaleBlock
from moe_offload.formats.float import FloatFormat
from moe_offload.formats.fp8 import FP8Format
from moe_offload.formats.mxfp4 import MXFP4Format
from moe_offload.formats.nvfp4 import NVFP4Format
from moe_offload.formats.room import MatrixPart, WeightFormat

__all__ = ["ExpertFormat", "ScaleBlock", "NVFP4", "MXFP4", "FP4_KINDS", "MatrixPart", "WeightFormat", "room_of",
           "bank_specs", "quantize_w13", "dequantize_w13", "resolve_expert_format"]

_ROOMS: dict[str, WeightFormat] = {r.family: r for r in (FloatFormat(), FP8Format(), NVFP4Format(), MXFP4Format())}
BLOCK_128 = ScaleBlock(128, 128)


def room_of(fmt: ExpertFormat) -> WeightFormat:
    return _ROOMS[fmt.family]


def bank_specs(fmt: ExpertFormat, inter: int, hidden: int) -> dict[str, tuple[tuple[int, int], torch.dtype]]:
    """One expert's banks in ``fmt``, name -> (shape, dtype): ``w13`` + suffix for each part of
    the gate (its rows doubled: the up's parts stacked under), then ``w2`` + suffix."""
    room = room_of(fmt)
    w13 = {"w13" + p.suffix: ((2 * p.shape[0], p.shape[1]), p.dtype) for p in room.parts(fmt, inter, hidden)}
    w2 = {"w2" + p.suffix: (p.shape, p.dtype) for p in room.parts(fmt, hidden, inter)}
    return {name: spec for pair in zip(w13.items(), w2.items()) for name, spec in pair}


def quantize_w13(fmt: ExpertFormat, w13: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """``w13 [..., 2I, H]`` -> its parts, each the gate's stacked on the up's."""
    inter, room = w13.shape[-2] // 2, room_of(fmt)
    gate, up = room.quantize(fmt, w13[..., :inter, :]), room.quantize(fmt, w13[..., inter:, :])
    return tuple(torch.cat(pair, dim=-2) for pair in zip(gate, up))


def dequantize_w13(fmt: ExpertFormat, parts: tuple[torch.Tensor, ...], dtype: torch.dtype) -> torch.Tensor:
    """Inverse of ``quantize_w13``: each half dequantized on its own parts."""
    room = room_of(fmt)
    halves = [tuple(p[..., h * (p.shape[-2] // 2):(h + 1) * (p.shape[-2] // 2), :] for p in parts) for h in (0, 1)]
    return torch.cat([room.dequantize(fmt, half, dtype) for half in halves], dim=-2)


def resolve_expert_format(requested: str, checkpoint: ExpertFormat, compute_dtype: torch.dtype) -> ExpertFormat:
    """``--expert-dtype``: ``auto`` keeps the checkpoint's format (float experts in the compute
    dtype); ``fp8`` keeps fp8 experts and quantizes others 128x128 when the store is filled;
    ``nvfp4`` / ``mxfp4`` keep that 4-bit format or quantize float and fp8 experts at fill;
    ``bf16`` runs every expert in the compute dtype (dequantizing at fill)."""
    if requested not in EXPERT_DTYPES:
        raise ValueError(f"--expert-dtype {requested!r} is not one of {', '.join(EXPERT_DTYPES)}")
    if requested == "bf16" or (requested == "auto" and not checkpoint.quantized):
        return ExpertFormat(compute_dtype)
    if requested == "auto" or checkpoint.family == requested:
        return checkpoint
    return {"fp8": ExpertFormat(FP8_DTYPE, BLOCK_128), "nvfp4": NVFP4, "mxfp4": MXFP4}[requested]
