"""What an expert store holds and whose it is: the bank layout and the store identity (the header
that records both at the start of the segment is ``store_header.py``).

```
 0              HEADER_BYTES                                                             total_bytes
 ┌──────────────┬───────────────────────────────────────┬───────────────────────┬─────┬─────┐
 │ header       │ record 0 = expert (layer 0, expert 0)  │ record 1              │ ... │ pad │
 └──────────────┴───────────────────────────────────────┴───────────────────────┴─────┴─────┘
 a record:  w13 row [2I,H] | w2 row [H,I] | quantized: w13_scale row | w2_scale row | ...   (each at a
            multiple of expert_records.RECORD_ALIGN; record_bytes the same for every expert)
 header: magic 8s | version u32 | complete u32 | json_len u64 | created f64 | fill_seconds f64 | json
```

Each bank has its own dtype and shape, as the experts' format says (``formats.bank_specs``): fp8
``w13``/``w2`` in ``float8_e4m3fn`` with float32 scale grids; 4-bit packed uint8 ``w13``/``w2`` with
group scales and nvfp4's channel scales; the layout records the scale block and the 4-bit kind. A
bank is a strided view ``[L, E, ...]`` into the records (``BankLayout.view``); the cache's slots are
records of the same layout, so the copy engine moves a run of experts in one copy.

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

from moe_offload.expert_records import RecordLayout, bank_views, record_layout
from moe_offload.formats import ExpertFormat, ScaleBlock, bank_specs
from moe_offload.safetensors_file import checkpoint_files

FORMAT_VERSION = 2  # 2: expert-major records (1: bank after bank)
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
    shape: tuple[int, ...]  # [L, E, ...]
    dtype: torch.dtype
    offset: int  # of an expert's row within its record

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


@dataclass(frozen=True)
class BankLayout:
    """Named banks ``[L, E, ...]``, stored expert-major behind the header: one record of
    ``record_bytes`` an expert (``expert_records``: each bank's row at its ``offset``), so a run of
    experts is one contiguous range. ``scale_block`` is that of the scale banks (None without them),
    ``kind`` names a 4-bit format."""

    banks: tuple[BankSpec, ...]
    record_bytes: int
    scale_block: ScaleBlock | None = None
    kind: str = ""

    @classmethod
    def of(cls, banks: dict[str, tuple[tuple[int, ...], torch.dtype]],
           scale_block: ScaleBlock | None = None, kind: str = "") -> BankLayout:
        """``banks``: name -> (shape ``[L, E, ...]``, dtype), in record order."""
        shapes = [tuple(int(d) for d in shape) for shape, _ in banks.values()]
        if len({shape[:2] for shape in shapes}) > 1:
            raise ValueError(f"banks of different experts {[shape[:2] for shape in shapes]} cannot share records")
        dtypes = [dtype for _, dtype in banks.values()]
        rows = record_layout([math.prod(shape[2:]) * dtype.itemsize for shape, dtype in zip(shapes, dtypes)])
        specs = tuple(BankSpec(*spec) for spec in zip(banks, shapes, dtypes, rows.offsets))
        return cls(specs, rows.record_bytes, scale_block, kind)

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
    def num_records(self) -> int:
        return math.prod(self.banks[0].shape[:2]) if self.banks else 0

    @property
    def total_bytes(self) -> int:
        return _align(HEADER_BYTES + self.num_records * self.record_bytes)

    def bank(self, name: str) -> BankSpec:
        for spec in self.banks:
            if spec.name == name:
                return spec
        raise KeyError(f"no bank {name!r} in the expert store (has {[b.name for b in self.banks]})")

    def view(self, segment: torch.Tensor, name: str) -> torch.Tensor:
        """Bank ``name`` ``[L, E, ...]`` over ``segment``, the whole segment's bytes (a strided
        view into the records)."""
        spec = self.bank(name)
        records = segment[HEADER_BYTES:HEADER_BYTES + self.num_records * self.record_bytes]
        rows = bank_views(records.view(self.num_records, self.record_bytes), [(spec.shape[2:], spec.dtype)],
                          RecordLayout((spec.offset,), self.record_bytes))
        return rows[0].view(spec.shape)

    def to_json(self) -> list[dict]:
        return [
            {"name": b.name, "shape": list(b.shape), "dtype": dtype_name(b.dtype), "offset": b.offset, "nbytes": b.nbytes}
            for b in self.banks
        ]

    @classmethod
    def from_json(cls, banks: list[dict], scale_block: list[int] | None = None, kind: str = "") -> BankLayout:
        """The layout of ``to_json``'s banks (their offsets follow from their order, shapes and dtypes)."""
        return cls.of({b["name"]: (tuple(b["shape"]), dtype_from_name(b["dtype"])) for b in banks},
                      ScaleBlock(*scale_block) if scale_block else None, kind)


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
