"""Reading fp8 matrices from a checkpoint, and turning expert weights into the format they run in
(``w13``'s halves are converted one at a time: each keeps its own scale grid, ``moe_offload.fp8``).

A quantized Linear stores ``NAME.weight`` in e4m3 beside a float scale tensor: Hugging Face
fine-grained fp8 names it ``NAME.weight_scale_inv``, compressed-tensors ``NAME.weight_scale``; in
both the scale multiplies. Modules a checkpoint leaves unquantized (``modules_to_not_convert``,
``ignore``) are plain float tensors and are read as they are, so nothing here needs those lists.

```
 checkpoint layout                        FP8Scheme                                   scale as stored
 fp8, weight_block_size [128, 128]        ("_scale_inv", BLOCK_128)                    [ceil(N/128), ceil(K/128)]
 compressed-tensors, strategy channel     ("_scale", PER_CHANNEL)                      [N, 1]
 compressed-tensors, strategy block       ("_scale", BLOCK_128)                        [ceil(N/128), ceil(K/128)]
 either, one scale per matrix             (suffix, PER_CHANNEL, per_tensor=True)       [] or [1]: repeated per row
```
"""
from __future__ import annotations

from typing import Mapping, NamedTuple, Sequence

import torch

from moe_offload.checkpoint_matrix import StoredMatrix, read_tensor
from moe_offload.fp8 import FP8_DTYPE, PER_CHANNEL, ScaleBlock
from moe_offload.formats import FP4_KINDS, ExpertFormat, room_of
from moe_offload.formats.fp4_checkpoint import FP4Scheme
from moe_offload.safetensors_file import SafetensorsFile

_SCALE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class FP8Scheme(NamedTuple):
    """How a checkpoint stores its fp8 weights: the scale's name suffix and the block it covers.
    A per-tensor scale is read as per-channel (``PER_CHANNEL``) with the one value repeated."""

    scale_suffix: str
    block: ScaleBlock
    per_tensor: bool = False

    @property
    def runtime_block(self) -> ScaleBlock:
        """The block of the scale grids this scheme is read into."""
        return PER_CHANNEL if self.per_tensor else self.block

    @property
    def format(self) -> ExpertFormat:
        return ExpertFormat(FP8_DTYPE, self.runtime_block)


Scheme = FP8Scheme | FP4Scheme  # how a checkpoint stores its quantized weights (None: all float)


def read_matrix(index: Mapping[str, SafetensorsFile], name: str, shape: Sequence[int],
                scheme: Scheme | None) -> StoredMatrix:
    """``name`` of ``shape`` (a matrix); an e4m3 one comes with its float32 scale grid over
    ``scheme.runtime_block``, a 4-bit one with its parts (``formats.fp4_checkpoint``)."""
    if isinstance(scheme, FP4Scheme):
        return scheme.read(index, name, shape)
    weight = read_tensor(index, name, shape)
    if weight.dtype != FP8_DTYPE:
        if not weight.dtype.is_floating_point or weight.dtype.itemsize == 1:
            raise ValueError(f"tensor {name} is {weight.dtype}; Sluice reads float and float8_e4m3fn weights")
        return StoredMatrix(weight)
    if scheme is None:
        raise ValueError(f"tensor {name} is float8_e4m3fn but config.json declares no fp8 quantization_config")
    return StoredMatrix(weight, _read_scale(index, name, tuple(weight.shape), scheme), fmt=scheme.format)


def _read_scale(index: Mapping[str, SafetensorsFile], name: str, shape: tuple[int, ...],
                scheme: FP8Scheme) -> torch.Tensor:
    scale_name = name + scheme.scale_suffix
    if scale_name not in index:
        raise ValueError(f"fp8 tensor {name} has no scale {scale_name}")
    scale = index[scale_name].tensor(scale_name)
    if scheme.per_tensor:
        want, fits = "[] or [1]", scale.numel() == 1 and scale.dim() <= 2
    else:
        grid = (*shape[:-2], *scheme.block.scale_shape(*shape[-2:]))
        want, fits = str(list(grid)), tuple(scale.shape) == grid
    if not fits or scale.dtype not in _SCALE_DTYPES:
        raise ValueError(f"scale {scale_name} ({str(scale.dtype).removeprefix('torch.')} {list(scale.shape)}) does "
                         f"not fit fp8 weight {name} {list(shape)}: want a float scale of shape {want}")
    if scheme.per_tensor:
        return scale.float().reshape(1, 1).expand(shape[-2], 1).contiguous()
    return scale.float()


def dequantized(matrix: StoredMatrix, scheme: object, dtype: torch.dtype) -> torch.Tensor:
    """The matrix in ``dtype``: its parts dequantized by its format's room, a float one cast."""
    return matrix.dequantized(dtype)


def to_expert_format(matrix: StoredMatrix, scheme: object, target: ExpertFormat) -> StoredMatrix:
    """One expert matrix (``w13``'s gate or up half, or ``w2``) in ``target``'s format: kept when
    it is stored so, dequantized for a float target, quantized from float (or from fp8, for a 4-bit
    target). Any other change (fp8 re-blocked, 4-bit to another format) would round twice onto a
    grid no finer, so it is refused."""
    if not target.quantized:
        return StoredMatrix(matrix.dequantized(target.dtype))
    if matrix.fmt == target:
        return matrix
    if matrix.fmt is not None and (target.family == "fp8" or matrix.fmt.family in FP4_KINDS):
        raise ValueError(f"{matrix.fmt.name} scales cannot run as {target.name} without rounding twice; "
                         "use the checkpoint's format or bf16")
    weight = matrix.weight if matrix.fmt is None else matrix.dequantized(torch.float32)
    return StoredMatrix(*room_of(target).quantize(target, weight), fmt=target)
