"""Reading 4-bit checkpoint matrices into the bank layout of ``moe_offload.fp4``. Which layout a
matrix is in shows in its tensor names, so a module left unquantized (``exclude_modules``,
``ignore``, ``modules_to_not_convert``) is read as the float tensor it is stored as:

```
 layout                   weight (NAME = X.weight)              scales
 ModelOpt NVFP4           X.weight uint8 [N, K/2]               X.weight_scale e4m3 [N, K/16], X.weight_scale_2 f32 []
 compressed-tensors nvfp4 X.weight_packed uint8 [N, K/2]        X.weight_scale e4m3 [N, K/16], X.weight_global_scale
                                                                f32 [1] (the reciprocal of the global scale)
 compressed-tensors mxfp4 X.weight_packed uint8 [N, K/2]        X.weight_scale uint8 e8m0 [N, K/32]
 gpt-oss MXFP4 (fused)    NAME_blocks uint8 [E, N, K/32, 16]    NAME_scales uint8 e8m0 [E, N, K/32]
```
(``input_scale`` of a weight-only ModelOpt export is not read.)
"""
from __future__ import annotations

import math
from typing import Mapping, NamedTuple, Sequence

import torch

from moe_offload.checkpoint_matrix import StoredMatrix, read_tensor
from moe_offload.formats.expert_format import MXFP4, NVFP4, ExpertFormat
from moe_offload.safetensors_file import SafetensorsFile

Index = Mapping[str, SafetensorsFile]


class FP4Scheme(NamedTuple):
    """A 4-bit checkpoint: its format (``NVFP4`` or ``MXFP4``)."""

    format: ExpertFormat

    @property
    def group(self) -> int:
        return self.format.scale_block.cols

    def read(self, index: Index, name: str, shape: Sequence[int]) -> StoredMatrix:
        """Matrix ``name`` of logical ``shape [..., N, K]``: its 4-bit parts, or the float tensor."""
        shape = tuple(shape)
        if name + "_blocks" in index:
            return self._read_blocks(index, name, shape)
        packed_name = _base(name) + "weight_packed"
        if packed_name in index:
            return self._read_parts(index, packed_name, _base(name) + "weight_scale", shape,
                                    _base(name) + "weight_global_scale", reciprocal=True)
        if name in index and index[name].tensor(name).dtype == torch.uint8:
            return self._read_parts(index, name, name + "_scale", shape, name + "_scale_2", reciprocal=False)
        weight = read_tensor(index, name, shape)
        if not weight.dtype.is_floating_point:
            raise ValueError(f"tensor {name} is {weight.dtype}; a {self.format.name} checkpoint stores float or "
                             f"4-bit weights")
        return StoredMatrix(weight)

    def stored_format(self, index: Index, name: str) -> ExpertFormat | None:
        """The format ``name`` is stored in when it is 4-bit (None: a float tensor)."""
        if name + "_blocks" in index or _base(name) + "weight_packed" in index:
            return self.format
        return self.format if name in index and index[name].tensor(name).dtype == torch.uint8 else None

    def _read_parts(self, index: Index, packed_name: str, scale_name: str, shape: tuple[int, ...],
                    global_name: str, reciprocal: bool) -> StoredMatrix:
        lead, (rows, cols) = shape[:-2], shape[-2:]
        self._check_cols(packed_name, cols)
        packed = read_tensor(index, packed_name, (*lead, rows, cols // 2), torch.uint8)
        scale = read_tensor(index, scale_name, (*lead, rows, cols // self.group), self._scale_dtype)
        if self.format.kind != "nvfp4":
            return StoredMatrix(packed, scale, fmt=self.format)
        channel = _global_scale(index, global_name, lead, reciprocal)
        return StoredMatrix(packed, scale, channel.expand(*lead, rows, 1).contiguous(), fmt=self.format)

    def _read_blocks(self, index: Index, name: str, shape: tuple[int, ...]) -> StoredMatrix:
        lead, (rows, cols) = shape[:-2], shape[-2:]
        self._check_cols(name + "_blocks", cols)
        if self.format.kind != "mxfp4":
            raise ValueError(f"{name}_blocks is gpt-oss's MXFP4 layout, but the checkpoint declares {self.format.name}")
        blocks = read_tensor(index, name + "_blocks", (*lead, rows, cols // 32, 16), torch.uint8)
        scale = read_tensor(index, name + "_scales", (*lead, rows, cols // 32), torch.uint8)
        return StoredMatrix(blocks.reshape(*lead, rows, cols // 2), scale, fmt=self.format)

    @property
    def _scale_dtype(self) -> torch.dtype:
        return torch.float8_e4m3fn if self.format.kind == "nvfp4" else torch.uint8

    def _check_cols(self, name: str, cols: int) -> None:
        if cols % self.group:
            raise ValueError(f"{name}: {self.format.name} needs input dims that are multiples of {self.group}, "
                             f"got {cols}")


def _base(name: str) -> str:
    return name.removesuffix("weight")


def _global_scale(index: Index, name: str, lead: tuple[int, ...], reciprocal: bool) -> torch.Tensor:
    """The per-matrix float32 global scale as ``[*lead, 1, 1]`` (one value, or one per leading index)."""
    if name not in index:
        raise ValueError(f"nvfp4 tensor has no global scale {name}")
    scale = index[name].tensor(name)
    if scale.dtype != torch.float32 or scale.numel() not in (1, math.prod(lead)):
        raise ValueError(f"global scale {name} ({str(scale.dtype).removeprefix('torch.')} {list(scale.shape)}) "
                         f"must be float32 with one value per matrix")
    value = scale.float().reshape(*(lead if scale.numel() > 1 else [1] * len(lead)), 1, 1)
    return 1.0 / value if reciprocal else value


# ==== what a config says: (scheme, None) or (None, the problem in a few words) ====

def modelopt_scheme(qc: dict) -> tuple[FP4Scheme | None, str | None]:
    """ModelOpt's ``quantization`` (``hf_quant_config.json``) or its ``quantization_config``:
    weight-only NVFP4 with groups of 16 (``exclude_modules`` are stored float and read so)."""
    algo = str(qc.get("quant_algo") or "none")
    if algo.upper() != "NVFP4":
        return None, f"modelopt {algo}"
    return _grouped(NVFP4_SCHEME, qc.get("group_size", 16), "modelopt NVFP4")


def mxfp4_scheme(qc: dict) -> tuple[FP4Scheme | None, str | None]:
    """gpt-oss's ``quant_method: mxfp4`` (groups of 32, e8m0 scales)."""
    return _grouped(MXFP4_SCHEME, qc.get("group_size", 32), "mxfp4")


def compressed_tensors_fp4(weights: dict) -> tuple[FP4Scheme | None, str | None]:
    """A compressed-tensors group of float4 weights: nvfp4 (``tensor_group`` of 16, e4m3 scales and
    a global scale) or mxfp4 (``group`` of 32, e8m0 scales)."""
    strategy, scale_dtype = weights.get("strategy"), str(weights.get("scale_dtype") or "")
    if strategy == "tensor_group":
        if scale_dtype and "e4m3" not in scale_dtype:
            return None, f"nvfp4 with {scale_dtype} scales"
        return _grouped(NVFP4_SCHEME, weights.get("group_size"), "float4 weights (nvfp4)")
    if strategy == "group":
        if scale_dtype and not ("uint8" in scale_dtype or "e8m0" in scale_dtype):
            return None, f"mxfp4 with {scale_dtype} scales"
        return _grouped(MXFP4_SCHEME, weights.get("group_size"), "float4 weights (mxfp4)")
    return None, f"float4 weights with strategy {strategy!r}"


def _grouped(scheme: FP4Scheme, group_size, what: str) -> tuple[FP4Scheme | None, str | None]:
    if group_size != scheme.group:
        return None, f"{what} with group_size {group_size} (the format's is {scheme.group})"
    return scheme, None


NVFP4_SCHEME = FP4Scheme(NVFP4)
MXFP4_SCHEME = FP4Scheme(MXFP4)
