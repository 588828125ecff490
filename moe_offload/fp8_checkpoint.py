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

from moe_offload.fp8 import FP8_DTYPE, PER_CHANNEL, ExpertFormat, ScaleBlock, dequantize, quantize
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


class StoredMatrix(NamedTuple):
    """A checkpoint matrix as stored: float (``scale`` None) or e4m3 with its float32 scale grid."""

    weight: torch.Tensor
    scale: torch.Tensor | None = None


def read_tensor(index: Mapping[str, SafetensorsFile], name: str, shape: Sequence[int]) -> torch.Tensor:
    if name not in index:
        raise ValueError(f"missing tensor {name}")
    tensor = index[name].tensor(name)
    if tuple(tensor.shape) != tuple(shape):
        raise ValueError(f"{index[name].path.name}: tensor {name} has shape {tuple(tensor.shape)}, "
                         f"expected {tuple(shape)}")
    return tensor


def read_matrix(index: Mapping[str, SafetensorsFile], name: str, shape: Sequence[int],
                scheme: FP8Scheme | None) -> StoredMatrix:
    """``name`` of ``shape`` (a matrix); an e4m3 one comes with its float32 scale grid over
    ``scheme.runtime_block``."""
    weight = read_tensor(index, name, shape)
    if weight.dtype != FP8_DTYPE:
        if not weight.dtype.is_floating_point or weight.dtype.itemsize == 1:
            raise ValueError(f"tensor {name} is {weight.dtype}; Sluice reads float and float8_e4m3fn weights")
        return StoredMatrix(weight)
    if scheme is None:
        raise ValueError(f"tensor {name} is float8_e4m3fn but config.json declares no fp8 quantization_config")
    return StoredMatrix(weight, _read_scale(index, name, tuple(weight.shape), scheme))


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


def dequantized(matrix: StoredMatrix, scheme: FP8Scheme | None, dtype: torch.dtype) -> torch.Tensor:
    """The matrix in ``dtype``: e4m3 times its scales (``fp8.dequantize``), float cast."""
    if matrix.scale is None:
        return matrix.weight.to(dtype)
    return dequantize(matrix.weight, matrix.scale, scheme.runtime_block, dtype)


def to_expert_format(matrix: StoredMatrix, scheme: FP8Scheme | None, target: ExpertFormat) -> StoredMatrix:
    """One expert matrix (``w13``'s gate or up half, or ``w2``) in ``target``'s format: fp8 kept when
    the blocks agree, dequantized for a float target, a float one quantized (amax) for an fp8 one.
    Re-blocking fp8 would round twice, so it is refused."""
    if not target.quantized:
        return StoredMatrix(dequantized(matrix, scheme, target.dtype))
    if matrix.scale is None:
        return StoredMatrix(*quantize(matrix.weight, target.scale_block))
    if scheme.runtime_block != target.scale_block:
        raise ValueError(f"fp8 experts with {ExpertFormat(FP8_DTYPE, scheme.runtime_block).name} scales cannot "
                         f"run as {target.name} without rounding twice; use the checkpoint's format or bf16")
    return matrix
