"""Expert records: every bank of one expert side by side in one row of bytes.

The store's segment and the cache's slot pools hold their banks expert-major: record ``r`` is
``[w13 row | w2 row | scale rows ...]``, each bank's row at the same offset in every record (a
multiple of ``RECORD_ALIGN``), and a bank is a strided view ``[N, ...]`` into the records. So a run
of consecutive missed experts is one contiguous range on both sides, and the copy engine moves it
in one copy whatever the format's bank count (nvfp4 has six: copied bank by bank, its runs lost
5 % of the link to the copies' set-up, ``scripts/bench_copy_runs.py``). Kernels index a bank
through its strides, so they read a record's bank as they read a bank of its own.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

import torch

RECORD_ALIGN = 256  # every bank's row starts at a multiple: the kernels' vector loads, fp32 scale views


class RecordLayout(NamedTuple):
    offsets: tuple[int, ...]  # each bank's row within a record, in bank order
    record_bytes: int


def record_layout(row_bytes: Sequence[int]) -> RecordLayout:
    """Banks whose expert rows take ``row_bytes`` placed one after another in a record."""
    offsets, end = [], 0
    for nbytes in row_bytes:
        offsets.append(end)
        end += -(-nbytes // RECORD_ALIGN) * RECORD_ALIGN
    return RecordLayout(tuple(offsets), max(end, RECORD_ALIGN))


def bank_views(records: torch.Tensor, specs: Sequence[tuple[tuple[int, ...], torch.dtype]],
               layout: RecordLayout) -> list[torch.Tensor]:
    """``records [N, R]`` uint8 seen as banks ``[N, *shape]`` of each spec's dtype (``specs``: one
    expert's ``(shape, dtype)`` per bank, in ``layout``'s order)."""
    views = []
    for (shape, dtype), offset in zip(specs, layout.offsets):
        row = records[:, offset:offset + math.prod(shape) * dtype.itemsize]
        views.append(row.view(dtype).view(records.shape[0], *shape))
    return views


def allocate(count: int, specs: Sequence[tuple[tuple[int, ...], torch.dtype]],
             device: torch.device | str) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """``count`` records on ``device`` and the banks over them."""
    layout = record_layout([math.prod(shape) * dtype.itemsize for shape, dtype in specs])
    records = torch.empty(count, layout.record_bytes, dtype=torch.uint8, device=device)
    return records, bank_views(records, specs, layout)


def records_of(banks: Sequence[torch.Tensor]) -> tuple[torch.Tensor, tuple[int, ...]] | None:
    """The ``[N, R]`` uint8 records that ``banks [N, ...]`` are views into, and each bank's offset
    in a record; None where they are not (banks of their own, copies made by ``.to``, or not every
    bank of the record, in its order: a record copied whole must hold nothing else)."""
    first = banks[0]
    record_bytes = first.stride(0) * first.element_size()
    storage = first.untyped_storage()
    base = first.data_ptr()
    offsets = tuple(b.data_ptr() - base for b in banks)
    if record_layout([b[0].nbytes for b in banks]) != (offsets, record_bytes):
        return None
    for bank, offset in zip(banks, offsets):
        if (bank.untyped_storage().data_ptr() != storage.data_ptr() or bank.shape[0] != first.shape[0]
                or bank.stride(0) * bank.element_size() != record_bytes or not bank[0].is_contiguous()
                or offset + bank[0].nbytes > record_bytes):
            return None
    start = base - storage.data_ptr()
    if start + first.shape[0] * record_bytes > storage.nbytes():
        return None
    raw = first.view(torch.uint8)  # a view (not a copy), so as_strided below reaches the records' storage
    return raw.as_strided((first.shape[0], record_bytes), (record_bytes, 1), start), offsets


def whole_records(pairs: Sequence[tuple[torch.Tensor, ...]]) -> list[tuple[torch.Tensor, ...]]:
    """``pairs`` (one tuple of sides a bank: ``(host, pool)``, ``(pool, host, buffer)``) as one tuple
    of whole records, where every side is records with the banks at the same offsets (a run of
    experts is then one copy); else ``pairs`` as given."""
    found = [records_of(banks) for banks in zip(*pairs)]
    if any(r is None for r in found) or len({(r[1], r[0].shape[1]) for r in found}) != 1:
        return list(pairs)
    return [tuple(r[0] for r in found)]
