"""Test banks as the store and the cache hold them: strided views into expert records
(``moe_offload.expert_records``), the same values as banks of their own."""
from __future__ import annotations

import torch

from moe_offload.expert_records import allocate, bank_views, record_layout


def as_records(banks: list[torch.Tensor], pin: bool = False) -> list[torch.Tensor]:
    """The same values ``[N, ...]`` as views into expert records on the banks' device (pinned host
    memory with ``pin``); the padding between banks filled with 0xAB, never read as a bank."""
    specs = [(b.shape[1:], b.dtype) for b in banks]
    device = "cpu" if pin else banks[0].device
    records, _ = allocate(banks[0].shape[0], specs, device)
    records = records.fill_(0xAB).pin_memory() if pin else records.fill_(0xAB)
    views = bank_views(records, specs, record_layout([b[0].nbytes for b in banks]))
    for view, bank in zip(views, banks):
        view.copy_(bank)
    return views
