"""Prefill staging that moves a layer's misses by the copy engine, planned on the host from a mirror
of the cache's table.

The copy engine's copies are sized and addressed by the host, and the host cannot read which
experts are resident without a device-to-host sync. But it can hold a recent copy of the table:

- **the mirror**: ``slot_for_id`` copied device-to-host into pinned memory after every decode
  step's last lookup and after every chunk (``refresh``; on CUDA on a side stream forked from and
  joined back into the current one, so a captured decode graph carries it too). The host reads it
  whenever it plans, with no event: it is at most the steps in flight old, and may even be torn;
- **the plan** (``plan``, once per chunk): every expert the mirror does not hold at a slot
  ``>= lent`` is a miss; the host copies those from the host banks into their buffer slots
  (``b*n + j``), one ``cudaMemcpyAsync`` per run of consecutive experts per bank
  (``copy_runs``), and sends its flags to the device (one small copy);
- **the repair** (``stage``, per layer, on the device, fixed shapes): the layer's true hits (the
  table read on the copy stream after ``begin``) are read in place through the GEMM's slot map,
  as in ``miss_copies``; the experts the mirror thought resident and are not are gathered into
  their buffer slots by one ``gather_missing`` launch (zero-copy reads), from a plan compacted on
  the device. Experts the mirror thought missing and are resident were copied for nothing.

So the result is exact whatever the mirror says; only its bytes depend on it (counted in
``stale``: copies the mirror wasted, experts it had to repair). Nothing is read back inside a
chunk: the one host read is of the mirror, which no stream waits for.
"""
from __future__ import annotations

import torch

from moe_offload.copy_runs import copy_runs
from moe_offload.host_register import mapped_device_bytes, pinned_device_pointer
from moe_offload.kernels.gather_missing import gather_missing

STALE_FIELDS = ("wasted", "repaired")  # per layer: host copies of experts that were resident; repairs


class MirroredMisses:
    """The host's mirror of ``slot_for_id``, each chunk's copy plan from it, and the device-side
    repair (module docstring). ``banks``: ``(host [L*E, ...], pool [S, ...])`` for the weights and
    every scale bank, the host side device-addressable on CUDA; the buffer of ``b`` is
    ``pool[b*n : (b+1)*n]``. ``experts``: the share's expert ids per layer (``n`` of them)."""

    def __init__(self, slot_for_id: torch.Tensor, banks: list[tuple[torch.Tensor, torch.Tensor]],
                 num_layers: int, num_experts: int, experts: torch.Tensor, lent: int, backend: str | None = None):
        device = slot_for_id.device
        count = experts.numel()
        self.slot_for_id, self.banks, self.lent, self.count, self.backend = slot_for_id, banks, lent, count, backend
        self.host_rows = torch.arange(num_layers)[:, None] * num_experts + experts.cpu()[None, :]  # [L, n]
        self.rows = self.host_rows.to(device=device, dtype=torch.int32)
        self.cuda = device.type == "cuda"
        # -1 everywhere until the first refresh: a first chunk copies every expert, like "memcpy"
        self.mirror = torch.full((num_layers * num_experts,), -1, dtype=torch.int32, pin_memory=self.cuda)
        self._mirror_dst = _device_view(self.mirror, device) if self.cuda else self.mirror
        self.side = torch.cuda.Stream(device) if self.cuda else None
        self._forked = False
        # this chunk's host copies: per layer (host row, share index) runs, from ``plan``
        self.runs: list[list[tuple[int, int, int]]] = [copy_runs(rows, list(range(count)))
                                                       for rows in self.host_rows.tolist()]
        self.copied = torch.ones(num_layers, count, dtype=torch.bool, device=device)  # the same, on the device
        self.slot_map = torch.zeros(2, count, dtype=torch.int32, device=device)
        self.buffer_slots = torch.arange(2 * count, dtype=torch.int32, device=device).view(2, count)
        self.in_place = torch.zeros(num_layers, dtype=torch.int64, device=device)
        self.stale = torch.zeros(num_layers, len(STALE_FIELDS), dtype=torch.int64, device=device)
        # the repair's plan: rows past its count are -1, entry ``count`` is where non-repairs scatter
        self.repair_src = torch.full((count + 1,), -1, dtype=torch.int32, device=device)
        self.repair_dst = torch.full((count + 1,), -1, dtype=torch.int32, device=device)
        self.repair_count = torch.zeros(1, dtype=torch.int32, device=device)
        self.copies = 0  # cudaMemcpyAsync calls issued (host counter)

    def refresh(self) -> None:
        """Enqueue a copy of the table into the mirror, beside the current stream's work on CUDA
        (``join`` before the work that must follow it ends, e.g. a captured forward)."""
        if not self.cuda:
            self.mirror.copy_(self.slot_for_id)
            return
        current = torch.cuda.current_stream(self.slot_for_id.device)
        self.side.wait_stream(current)
        with torch.cuda.stream(self.side):
            self._mirror_dst.copy_(self.slot_for_id, non_blocking=True)
        self._forked = True

    def join(self) -> None:
        """Work enqueued on the current stream from now on follows the last refresh."""
        if self._forked:
            torch.cuda.current_stream(self.slot_for_id.device).wait_stream(self.side)
            self._forked = False

    def plan(self) -> None:
        """A chunk starts: its host copies from the mirror as it reads now, and their flags sent to
        the device (on the current stream: the copy stream, after ``begin``)."""
        planned = self.mirror[self.host_rows] < self.lent  # host tensors, read as they are
        self.runs = [copy_runs([r for r, miss in zip(rows, flags) if miss], [j for j, miss in enumerate(flags) if miss])
                     for rows, flags in zip(self.host_rows.tolist(), planned.tolist())]
        self.copied.copy_(planned.pin_memory() if self.cuda else planned, non_blocking=True)

    def stage(self, layer: int, staged: torch.Tensor) -> None:
        """Copy the planned misses of ``layer`` into its buffer, write the buffer's slot map and
        repair what the mirror got wrong; count experts moved from the host into ``staged[layer,
        1]``, hits into ``in_place``, the mirror's errors into ``stale``. Enqueued on the current
        stream (the copy stream); nothing is read back."""
        buf, count = layer % 2, self.count
        for src, j, length in self.runs[layer]:
            for host, pool in self.banks:
                pool[buf * count + j:buf * count + j + length].copy_(host[src:src + length], non_blocking=True)
                self.copies += 1
        held = self.slot_for_id[self.rows[layer]]
        resident, copied = held >= self.lent, self.copied[layer]
        torch.where(resident, held, self.buffer_slots[buf], out=self.slot_map[buf])
        repair = ~(resident | copied)
        self._repair(layer, buf, repair)
        hits = resident.sum()
        staged[layer, 1] += count - hits + (resident & copied).sum()
        self.in_place[layer] += hits
        self.stale[layer, 0] += (resident & copied).sum()
        self.stale[layer, 1] += repair.sum()

    def slots(self, buf: int, index: torch.Tensor) -> torch.Tensor:
        """Pool slots of the routed experts at share ``index`` (-1: not this share's, stays -1)."""
        return torch.where(index >= 0, self.slot_map[buf][index.clamp(min=0)], -1)

    def _repair(self, layer: int, buf: int, repair: torch.Tensor) -> None:
        """Gather the experts flagged in ``repair`` into their buffer slots: the plan compacted on
        the device (a running count places each), one ``gather_missing`` launch."""
        count = self.count
        order = torch.cumsum(repair, 0, dtype=torch.int32)
        place = torch.where(repair, order - 1, count).long()
        self.repair_src.fill_(-1)
        self.repair_dst.fill_(-1)
        self.repair_src.scatter_(0, place, self.rows[layer])
        self.repair_dst.scatter_(0, place, self.buffer_slots[buf])
        self.repair_count.copy_(order[-1:])
        host = [h for h, _ in self.banks]
        pools = [p for _, p in self.banks]
        scales = {} if len(self.banks) == 2 else {"host_scales": tuple(host[2:]), "slot_scales": tuple(pools[2:])}
        gather_missing(self.repair_src[:count], self.repair_dst[:count], self.repair_count, host[0], host[1],
                       pools[0], pools[1], self.backend, **scales)

    def reset_stats(self) -> None:
        self.in_place.zero_()
        self.stale.zero_()
        self.copies = 0

    def stats(self) -> dict:
        """The mirror's errors and the copies issued; reads the device (off the hot path)."""
        wasted, repaired = (int(v) for v in self.stale.sum(0).tolist())
        return {"mirror_wasted": wasted, "mirror_repaired": repaired, "mirror_copies": self.copies}


def _device_view(pinned: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A CUDA tensor over pinned host memory (mapped: the device writes it over PCIe), so the
    refresh is a device-to-device copy in torch's eyes, capturable in a CUDA graph."""
    nbytes = pinned.numel() * pinned.element_size()
    device_ptr = pinned_device_pointer(pinned.data_ptr(), device)
    return mapped_device_bytes(device_ptr, nbytes, device, owner=pinned).view(pinned.dtype)
