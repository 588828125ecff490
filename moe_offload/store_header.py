"""The header at the start of an expert store's segment: written when a store is created, marked
complete once it is filled, read and checked when a store is opened (``expert_store.py`` calls each
once and never touches a header's bytes itself).

    magic 8s | version u32 | complete u32 | json_len u64 | created f64 | fill_seconds f64 | json

``complete`` is written last, after the data and ``fill_seconds``, so a crashed fill is never taken
for a usable store.
"""
from __future__ import annotations

import json
import mmap
import os
import struct
import time
from typing import NamedTuple

from moe_offload.store_layout import FORMAT_VERSION, HEADER_BYTES, BankLayout, StoreIdentity

MAGIC = b"SLUICEXS"
_FIXED = struct.Struct("<8sIIQdd")
COMPLETE_OFFSET = 12
FILL_SECONDS_OFFSET = 32


class Header(NamedTuple):
    identity: StoreIdentity
    layout: BankLayout
    complete: bool
    created: float
    fill_seconds: float


def pack_header(identity: StoreIdentity, layout: BankLayout) -> bytes:
    """A header with ``complete`` unset; the creator sets it once the banks are filled."""
    block = list(layout.scale_block) if layout.scale_block else None
    meta = json.dumps({"label": identity.label, "key": identity.key, "banks": layout.to_json(),
                       "scale_block": block, "kind": layout.kind}).encode()
    if _FIXED.size + len(meta) > HEADER_BYTES:
        raise ValueError(f"expert store header of {len(meta)} bytes does not fit in {HEADER_BYTES}")
    return _FIXED.pack(MAGIC, FORMAT_VERSION, 0, len(meta), time.time(), 0.0) + meta


def parse_header(raw: bytes) -> Header:
    """Raises ValueError saying what is wrong with a header that is not ours or not readable."""
    if len(raw) < _FIXED.size:
        raise ValueError(f"too short for a header ({len(raw)} bytes)")
    magic, version, complete, meta_len, created, fill_seconds = _FIXED.unpack_from(raw)
    if magic != MAGIC:
        raise ValueError(f"foreign magic {magic!r}")
    if version != FORMAT_VERSION:
        raise ValueError(f"format version {version}, expected {FORMAT_VERSION}")
    if _FIXED.size + meta_len > min(len(raw), HEADER_BYTES):
        raise ValueError(f"header metadata length {meta_len} out of range")
    try:
        meta = json.loads(raw[_FIXED.size : _FIXED.size + meta_len])
        identity = StoreIdentity(meta["label"], meta["key"])
        layout = BankLayout.from_json(meta["banks"], meta.get("scale_block"), meta.get("kind", ""))
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"unreadable header metadata ({e})") from None
    return Header(identity, layout, complete == 1, created, fill_seconds)


def read_header(fd: int, identity: StoreIdentity, layout: BankLayout) -> tuple[Header | None, str | None]:
    """The header of the segment open at ``fd``, and why it cannot serve as ``identity``'s store
    of ``layout`` (None if it can)."""
    size = os.fstat(fd).st_size
    try:
        header = parse_header(os.pread(fd, HEADER_BYTES, 0))
    except ValueError as e:
        return None, str(e)
    if header.identity.key != identity.key:
        return header, f"holds another model ({header.identity.label})"
    if header.layout != layout:
        return header, "bank layout differs"
    if size != layout.total_bytes:
        return header, f"size is {size} bytes, expected {layout.total_bytes}"
    if not header.complete:
        return header, "fill never completed"
    return header, None


def write_header(mm: mmap.mmap, identity: StoreIdentity, layout: BankLayout) -> Header:
    """A new segment's header, not complete yet."""
    raw = pack_header(identity, layout)
    mm[: len(raw)] = raw
    return parse_header(raw)


def mark_complete(mm: mmap.mmap, fill_seconds: float) -> None:
    struct.pack_into("<d", mm, FILL_SECONDS_OFFSET, fill_seconds)
    mm.flush()
    struct.pack_into("<I", mm, COMPLETE_OFFSET, 1)  # last: only now may anyone use it
    mm.flush(0, mmap.PAGESIZE)
