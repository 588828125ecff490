"""A checkpoint matrix as stored: float, or quantized in one of the expert formats with its scale
parts; and the checked read of one named tensor. The formats' readers (``fp8_checkpoint.py``,
``formats/fp4_checkpoint.py``) build on these."""
from __future__ import annotations

from typing import Collection, Mapping, NamedTuple, Sequence

import torch

from moe_offload.formats import ExpertFormat, room_of
from moe_offload.safetensors_file import SafetensorsFile

# A 4-bit tensor's weight is stored under another name: compressed-tensors' NAME_packed, gpt-oss's
# NAME_blocks. The probes and the loaders' "is it there" checks accept those for NAME.
PACKED_SUFFIXES = ("_packed", "_blocks")


class StoredMatrix(NamedTuple):
    """``weight`` alone (float), or ``fmt``'s parts: fp8 ``weight`` and float32 ``scale``; 4-bit
    packed ``weight``, group ``scale`` and nvfp4's per-row ``channel [..., N, 1]``."""

    weight: torch.Tensor
    scale: torch.Tensor | None = None
    channel: torch.Tensor | None = None
    fmt: ExpertFormat | None = None

    @property
    def parts(self) -> tuple[torch.Tensor, ...]:
        return tuple(t for t in (self.weight, self.scale, self.channel) if t is not None)

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        if self.fmt is None:
            return self.weight.to(dtype)
        return room_of(self.fmt).dequantize(self.fmt, self.parts, dtype)

    def map(self, fn) -> StoredMatrix:
        """``fn`` applied to every part (e.g. one half's rows, a move to a device)."""
        return StoredMatrix(*(None if t is None else fn(t) for t in self[:3]), fmt=self.fmt)


def is_stored(name: str, names: Collection[str]) -> bool:
    """Whether tensor ``name`` is in the checkpoint, as itself or as a 4-bit packed weight."""
    return name in names or any(name + suffix in names for suffix in PACKED_SUFFIXES)


def read_tensor(index: Mapping[str, SafetensorsFile], name: str, shape: Sequence[int],
                dtype: torch.dtype | None = None) -> torch.Tensor:
    """Tensor ``name``, which must have ``shape`` (and ``dtype`` when given)."""
    if name not in index:
        raise ValueError(f"missing tensor {name}")
    tensor = index[name].tensor(name)
    if tuple(tensor.shape) != tuple(shape):
        raise ValueError(f"{index[name].path.name}: tensor {name} has shape {tuple(tensor.shape)}, "
                         f"expected {tuple(shape)}")
    if dtype is not None and tensor.dtype != dtype:
        raise ValueError(f"{index[name].path.name}: tensor {name} is {str(tensor.dtype).removeprefix('torch.')}, "
                         f"expected {str(dtype).removeprefix('torch.')}")
    return tensor
