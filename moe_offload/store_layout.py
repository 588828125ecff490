"""What an expert store holds and whose it is: the bank layout and the store identity (the header
that records both at the start of the segment is ``store_header.py``).

```
 0              HEADER_BYTES         (every offset a multiple of ALIGN)                total_bytes
 ┌──────────────┬──────────────────────┬─────┬──────────────────────┬─────┐
 │ header       │ bank w13 [L,E,2I,H]  │ pad │ bank w2 [L,E,H,I]    │ pad │ quantized: w13_scale, w2_scale, ...
 └──────────────┴──────────────────────┴─────┴──────────────────────┴─────┘
 header: magic 8s | version u32 | complete u32 | json_len u64 | created f64 | fill_seconds f64 | json
```

Each bank has its own dtype and shape, as the experts' format says (``formats.bank_specs``): fp8
``w13``/``w2`` in ``float8_e4m3fn`` with float32 scale grids; 4-bit packed uint8 ``w13``/``w2`` with
group scales and nvfp4's channel scales; the layout records the scale block and the 4-bit kind.

`complete` is written last, after the data and `fill_seconds`, so a crashed fill is never taken
for a usable store.
"""
from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import torch

from moe_offload.formats import ExpertFormat, ScaleBlock, bank_specs
from moe_offload.safetensors_file import checkpoint_files

FORMAT_VERSION = 1
SEGMENT_PREFIX = "sluice-experts-"
HEADER_BYTES = 1 << 16  # the banks start here (store_header.py writes what comes before)
ALIGN = 4096


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return dtype


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


class ExpertGeometry(NamedTuple):
    num_layers: int
    num_experts: int
    hidden: int
    intermediate: int

    @property
    def w13_shape(self) -> tuple[int, int, int, int]:
        return (self.num_layers, self.num_experts, 2 * self.intermediate, self.hidden)

    @property
    def w2_shape(self) -> tuple[int, int, int, int]:
        return (self.num_layers, self.num_experts, self.hidden, self.intermediate)


class BankSpec(NamedTuple):
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    offset: int

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


@dataclass(frozen=True)
class BankLayout:
    """Named banks placed one after another behind the header, each at an ALIGN boundary;
    ``scale_block`` is that of the scale banks (None without them), ``kind`` names a 4-bit format."""

    banks: tuple[BankSpec, ...]
    scale_block: ScaleBlock | None = None
    kind: str = ""

    @classmethod
    def of(cls, banks: dict[str, tuple[tuple[int, ...], torch.dtype]],
           scale_block: ScaleBlock | None = None, kind: str = "") -> BankLayout:
        """``banks``: name -> (shape, dtype), in segment order."""
        specs, offset = [], HEADER_BYTES
        for name, (shape, dtype) in banks.items():
            spec = BankSpec(name, tuple(int(d) for d in shape), dtype, offset)
            specs.append(spec)
            offset = _align(offset + spec.nbytes)
        return cls(tuple(specs), scale_block, kind)

    @classmethod
    def experts(cls, geometry: ExpertGeometry, fmt: ExpertFormat | torch.dtype) -> BankLayout:
        """``w13``, ``w2`` in the format's dtype, then its scale banks (``formats.bank_specs``)."""
        fmt, lead = as_format(fmt), (geometry.num_layers, geometry.num_experts)
        specs = bank_specs(fmt, geometry.intermediate, geometry.hidden)
        return cls.of({name: ((*lead, *shape), dtype) for name, (shape, dtype) in specs.items()},
                      fmt.scale_block, fmt.kind)

    @property
    def format(self) -> ExpertFormat:
        return ExpertFormat(self.bank("w13").dtype, self.scale_block, self.kind)

    @property
    def total_bytes(self) -> int:
        return _align(self.banks[-1].offset + self.banks[-1].nbytes) if self.banks else HEADER_BYTES

    def bank(self, name: str) -> BankSpec:
        for spec in self.banks:
            if spec.name == name:
                return spec
        raise KeyError(f"no bank {name!r} in the expert store (has {[b.name for b in self.banks]})")

    def to_json(self) -> list[dict]:
        return [
            {"name": b.name, "shape": list(b.shape), "dtype": dtype_name(b.dtype), "offset": b.offset, "nbytes": b.nbytes}
            for b in self.banks
        ]

    @classmethod
    def from_json(cls, banks: list[dict], scale_block: list[int] | None = None, kind: str = "") -> BankLayout:
        specs = tuple(BankSpec(b["name"], tuple(b["shape"]), dtype_from_name(b["dtype"]), b["offset"]) for b in banks)
        return cls(specs, ScaleBlock(*scale_block) if scale_block else None, kind)


def as_format(fmt: ExpertFormat | torch.dtype) -> ExpertFormat:
    """A plain dtype is the float format of that dtype."""
    return fmt if isinstance(fmt, ExpertFormat) else ExpertFormat(fmt)


def _format_key(fmt: ExpertFormat) -> str:
    """The expert format in a store's key: float formats keep the dtype name they always had (so
    existing bf16 stores stay valid), fp8 ones say their scale block (``fp8-b128x128``)."""
    return fmt.name if fmt.quantized else dtype_name(fmt.dtype)


@dataclass(frozen=True)
class StoreIdentity:
    """Whose weights a store holds. ``key`` holds everything that must match for reuse and is hashed
    into the segment name; ``label`` is what ``scripts/expert_store.py list`` shows."""

    label: str
    key: str

    @property
    def name(self) -> str:
        return SEGMENT_PREFIX + hashlib.sha256(self.key.encode()).hexdigest()[:16]

    @classmethod
    def checkpoint(cls, path: str | Path, fmt: ExpertFormat | torch.dtype) -> StoreIdentity:
        """A checkpoint directory or one file, in the expert format the store holds (a float
        checkpoint quantized to fp8 is another store); a rewritten shard changes the key."""
        resolved, fmt = Path(path).resolve(), as_format(fmt)
        files = checkpoint_files(resolved)
        stats = [[f.name, f.stat().st_size, f.stat().st_mtime_ns] for f in files]
        key = {"checkpoint": str(resolved), "files": stats, "dtype": _format_key(fmt), "layout": FORMAT_VERSION}
        return cls(f"checkpoint {resolved} {fmt.name}", json.dumps(key, sort_keys=True))

    @classmethod
    def dummy(cls, geometry: ExpertGeometry, seed: int, fmt: ExpertFormat | torch.dtype) -> StoreIdentity:
        fmt = as_format(fmt)
        key = ["dummy", list(geometry), seed, _format_key(fmt), FORMAT_VERSION]
        g = geometry
        label = f"dummy L={g.num_layers} E={g.num_experts} H={g.hidden} I={g.intermediate} seed={seed} {fmt.name}"
        return cls(label, json.dumps(key))
