"""Zero-copy reads of ``.safetensors`` files without the safetensors package (moe_offload may import
torch and triton only). The format: ``u64`` header length, a JSON header of
``name -> {dtype, shape, data_offsets}``, then the raw little-endian tensor bytes.
"""
from __future__ import annotations

import json
import math
import mmap
import struct
from pathlib import Path

import torch

_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}


class SafetensorsFile:
    def __init__(self, path: str | Path):
        self.path = Path(path)
        with open(self.path, "rb") as f:
            # A private (copy-on-write) mapping is writable, so torch.frombuffer views it without a
            # warning; nothing writes to it, so no page is ever copied.
            self._mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
        (header_len,) = struct.unpack_from("<Q", self._mm, 0)
        self._entries: dict[str, dict] = json.loads(self._mm[8 : 8 + header_len])
        self._entries.pop("__metadata__", None)
        self._data_start = 8 + header_len

    def names(self) -> list[str]:
        return list(self._entries)

    def tensor(self, name: str) -> torch.Tensor:
        entry = self._entries[name]
        if entry["dtype"] not in _DTYPES:
            raise ValueError(f"{name} in {self.path}: unsupported dtype {entry['dtype']}")
        dtype, shape = _DTYPES[entry["dtype"]], tuple(entry["shape"])
        begin, end = entry["data_offsets"]
        if end - begin != math.prod(shape) * dtype.itemsize or self._data_start + end > len(self._mm):
            raise ValueError(f"{name} in {self.path}: data_offsets {begin}..{end} do not fit shape {shape} {dtype}")
        if end == begin:
            return torch.empty(shape, dtype=dtype)
        raw = torch.frombuffer(self._mm, dtype=torch.uint8, count=end - begin, offset=self._data_start + begin)
        if (self._data_start + begin) % dtype.itemsize:
            raw = raw.clone()  # a dtype view needs an aligned start; the format does not promise one
        return raw.view(dtype).view(shape)


def index_files(files: list[str | Path]) -> dict[str, SafetensorsFile]:
    """Tensor name -> the file holding it, over a sharded checkpoint."""
    index: dict[str, SafetensorsFile] = {}
    for path in files:
        f = SafetensorsFile(path)
        index.update(dict.fromkeys(f.names(), f))
    return index


def checkpoint_files(path: str | Path) -> list[Path]:
    """The shards named by a checkpoint directory's ``model.safetensors.index.json`` (some repos
    also ship a consolidated copy, not to be read twice), else all its ``*.safetensors``; or the
    one file given. Raises ``ValueError`` when there are none or the index names a missing file."""
    resolved = Path(path).resolve()
    index = resolved / "model.safetensors.index.json"
    if index.is_file():
        files = sorted({resolved / name for name in json.loads(index.read_text())["weight_map"].values()})
    else:
        files = sorted(resolved.glob("*.safetensors")) if resolved.is_dir() else [resolved]
    if not files:
        raise ValueError(f"{resolved}: no *.safetensors files")
    missing = [f.name for f in files if not f.is_file()]
    if missing:
        raise ValueError(f"{resolved}: safetensors index names missing files {missing}")
    return files
