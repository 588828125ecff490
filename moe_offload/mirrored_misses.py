"""Prefill staging that moves a layer's misses by the copy engine, planned on the host from a mirror
of the cache's table.

The copy engine's copies are sized and addressed by the host, and the host cannot read which
experts are resident without a device-to-host sync. But it can hold a recent copy of the table:

- **the mirror**: ``slot_for_id`` copied device-to-host into pinned memory after every decode
  step's last lookup and after every chunk (``refresh``; on CUDA on a side stream forked from and
  joined back into the current one, so a captured decode graph carries it too). The host reads it
  whenever it plans, with no event: it is at most the steps in flight old, and may even be torn;
- **the plan** (``plan``, once per chunk): every expert the mirror does not hold at a slot
  ``>= lent`` is a miss, which the host will copy from the host banks into its buffer slot
  (``b*n + j``); its flags go to the device (one small copy), where a few launches for the whole
  chunk read the table (on the copy stream after ``begin``: no lookup runs inside a chunk) and
  write every layer's slot map (a true hit's own slot, read in place by the GEMM as in
  ``miss_copies``; else the buffer slot) and a compacted plan of the experts the mirror thought
  resident and are not;
- **the staging** (``stage``, per layer): one ``cudaMemcpyAsync`` per run of consecutive missed
  experts per bank (``copy_runs``; a bank of a few bytes an expert, fp8's scales, is copied across
  the hits between runs too, ``bridge_gaps``), then one ``gather_missing`` launch moves the layer's
  repairs (zero-copy reads; its count stays on the device). Experts the mirror thought missing and
  are resident are copied for nothing.

So the result is exact whatever the mirror says; only its bytes depend on it (counted in
``stale``: copies the mirror wasted, experts it had to repair). Nothing is read back inside a
chunk: the one host read is of the mirror, which no stream waits for.
"""
from __future__ import annotations

import torch

from moe_offload.copy_runs import bridge_gaps, copy_runs
from moe_offload.expert_records import whole_records
from moe_offload.host_register import pinned_device_view
from moe_offload.kernels.gather_missing import check_gather, gather_pairs
from moe_offload.miss_copies import through_slot_map

STALE_FIELDS = ("wasted", "repaired")  # per layer: host copies of experts that were resident; repairs
# A bank whose rows are this small next to a whole expert (fp8's scales: 768 B of 4.7 MB) is copied
# across the hits between two runs of misses too: a copy's set-up costs microseconds, the bytes nothing.
BRIDGE_BYTES = 64 << 10
BRIDGE_SHARE = 0.01


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
        self._host_row_lists = self.host_rows.tolist()  # what each chunk's plan walks
        self.rows = self.host_rows.to(device=device, dtype=torch.int32)
        # layer l's buffer slots: (l % 2) * n + j
        self.buffer_slots = ((torch.arange(num_layers)[:, None] % 2) * count + torch.arange(count)[None, :]).to(
            device=device, dtype=torch.int32)
        self.cuda = device.type == "cuda"
        # -1 everywhere until the first refresh: a first chunk copies every expert, like "memcpy"
        self.mirror = torch.full((num_layers * num_experts,), -1, dtype=torch.int32, pin_memory=self.cuda)
        self._mirror_dst = pinned_device_view(self.mirror, device) if self.cuda else self.mirror
        self.side = torch.cuda.Stream(device) if self.cuda else None
        self._forked = False
        # the chunk's plan (``plan``): the host's copies per layer as (host row, share index, length) runs
        self.runs: list[list[tuple[int, int, int]]] = []
        self.copied = torch.zeros(num_layers, count, dtype=torch.bool, device=device)  # the same, on the device
        self.slot_map = torch.zeros(num_layers, count, dtype=torch.int32, device=device)  # the GEMMs' slots
        # the repairs, compacted per layer: entries past a layer's count are -1, column ``n`` takes
        # the scatter of every entry that is not a repair; rows padded to 16 bytes, so that every
        # layer's views have the alignment Triton specialised the gather on (one compilation)
        width = -(-(count + 1) // 4) * 4
        self.repair_src = torch.full((num_layers, width), -1, dtype=torch.int32, device=device)
        self.repair_dst = torch.full((num_layers, width), -1, dtype=torch.int32, device=device)
        self.repair_count = torch.zeros(num_layers, 4, dtype=torch.int32, device=device)  # column 0
        self.in_place = torch.zeros(num_layers, dtype=torch.int64, device=device)
        self.stale = torch.zeros(num_layers, len(STALE_FIELDS), dtype=torch.int64, device=device)
        self.copies = 0  # cudaMemcpyAsync calls issued (host counter)
        # what ``stage`` copies and the repairs gather, resolved once: expert records where both sides
        # are (``expert_records``: a run is one copy), else each bank; with how many hits its copies
        # may bridge (0: none, as for a record or a weight bank)
        check_gather(self.repair_src[0, :count], self.repair_dst[0, :count], self.repair_count[0, :1], banks)
        self.gather_banks = whole_records(banks)
        row_bytes = [pool[0].nbytes for _, pool in self.gather_banks]
        self.copy_banks = [(*pair, bridge) for pair, bridge in zip(self.gather_banks, bridges(row_bytes, count))]
        self._repair(0)  # nothing to repair yet: compiles the gather at start-up, not in a chunk

    @property
    def copies_per_run(self) -> int:
        """Copies a run of missed experts takes: one between expert records, else one per bank not
        bridged (bf16's and fp8's two weight banks; 4-bit formats' group scales on their own too)."""
        return sum(1 for *_, bridge in self.copy_banks if not bridge)

    def refresh(self, beside: bool = True) -> None:
        """Enqueue a copy of the table into the mirror: ``beside`` the current stream's work on
        CUDA (``join`` before the work that must follow it ends, e.g. a captured forward), else
        on the current stream itself."""
        if not (self.cuda and beside):
            self._mirror_dst.copy_(self.slot_for_id, non_blocking=self.cuda)
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

    def plan(self, staged: torch.Tensor) -> None:
        """A chunk starts: the host's copies from the mirror as it reads now, their flags sent to the
        device, and from them and the table every layer's slot map and repairs, in a few launches
        for the whole chunk; enqueued on the current stream (the copy stream, after ``begin``: no
        lookup runs inside a chunk, so the table's decode slots hold still until it ends). Counts
        experts moved from the host into ``staged[:, 1]``, hits into ``in_place``, the mirror's
        errors into ``stale``."""
        planned = self.mirror[self.host_rows] < self.lent  # host tensors, read as they are
        self.runs = [copy_runs([r for r, miss in zip(rows, flags) if miss], [j for j, miss in enumerate(flags) if miss])
                     for rows, flags in zip(self._host_row_lists, planned.tolist())]
        self.copied.copy_(planned.pin_memory() if self.cuda else planned, non_blocking=True)
        held = self.slot_for_id[self.rows]
        resident = held >= self.lent
        torch.where(resident, held, self.buffer_slots, out=self.slot_map)
        repair = ~(resident | self.copied)
        order = torch.cumsum(repair, 1, dtype=torch.int32)
        place = torch.where(repair, order - 1, self.count).long()
        self.repair_src.fill_(-1).scatter_(1, place, self.rows)
        self.repair_dst.fill_(-1).scatter_(1, place, self.buffer_slots)
        self.repair_count[:, 0] = order[:, -1]
        hits, wasted = resident.sum(1), (resident & self.copied).sum(1)
        staged[:, 1] += self.count - hits + wasted
        self.in_place += hits
        self.stale[:, 0] += wasted
        self.stale[:, 1] += order[:, -1]

    def stage(self, layer: int) -> None:
        """Fill ``layer``'s buffer: the host's copies, one per run (of records; or per bank, a small
        bank's runs bridged across hits), then the repairs (one ``gather_missing`` launch, its count
        on the device); on the current stream (the copy stream), after the layer two back has let
        go of the buffer."""
        start = (layer % 2) * self.count
        for h, pool, bridge in self.copy_banks:
            for src, j, length in bridge_gaps(self.runs[layer], bridge) if bridge else self.runs[layer]:
                pool[start + j:start + j + length].copy_(h[src:src + length], non_blocking=True)
                self.copies += 1
        self._repair(layer)

    def _repair(self, layer: int) -> None:
        gather_pairs(self.repair_src[layer, :self.count], self.repair_dst[layer, :self.count],
                     self.repair_count[layer, :1], self.gather_banks, self.backend)

    def slots(self, layer: int, index: torch.Tensor) -> torch.Tensor:
        """Pool slots of ``layer``'s routed experts at share ``index``."""
        return through_slot_map(self.slot_map[layer], index)

    def reset_stats(self) -> None:
        self.in_place.zero_()
        self.stale.zero_()
        self.copies = 0

    def stats(self) -> dict:
        """The mirror's errors and the copies issued; reads the device (off the hot path)."""
        wasted, repaired = (int(v) for v in self.stale.sum(0).tolist())
        return {"mirror_wasted": wasted, "mirror_repaired": repaired, "mirror_copies": self.copies}


def bridges(row_bytes: list[int], count: int) -> list[int]:
    """Per bank whose expert rows take ``row_bytes``, the hits a copy may bridge (0: none)."""
    return [_bridge(row, sum(row_bytes), count) for row in row_bytes]


def _bridge(row_bytes: int, expert_bytes: int, count: int) -> int:
    """The hits a copy of a bank with ``row_bytes`` an expert may bridge: as many as stay within
    ``BRIDGE_BYTES`` and ``BRIDGE_SHARE`` of an expert's bytes (0 for weights)."""
    if row_bytes > BRIDGE_SHARE * expert_bytes:
        return 0
    return min(count, BRIDGE_BYTES // row_bytes)
