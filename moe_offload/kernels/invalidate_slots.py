"""Hand a slot range back empty: clear ``slot_for_id`` of the experts it holds, mark its slots
empty and zero their policy state. The prefill pipeline runs this over the slots it borrows
(``[0, 2E)``) before streaming into them, so no later lookup can hit a slot it overwrites.
"""
from __future__ import annotations

import functools

from moe_offload.kernels.triton_support import use_triton
from moe_offload.kernels.lookup_admit import CacheTables, check_tables

BLOCK = 1024


def invalidate_slots(slot_start: int, num_slots: int, tables: CacheTables, backend: str | None = None) -> None:
    """Empty slots ``[slot_start, slot_start + num_slots)``; one launch, bounds checked on the host."""
    check_tables(tables, slot_start, num_slots)
    if use_triton(tables.id_of_slot, backend):
        _kernel()[(-(-num_slots // BLOCK),)](tables.slot_for_id, tables.id_of_slot, tables.score, tables.last_use,
                                             slot_start, num_slots, BLOCK=BLOCK)
    else:
        invalidate_slots_eager(slot_start, num_slots, tables)


def invalidate_slots_eager(slot_start: int, num_slots: int, tables: CacheTables) -> None:
    """Reference twin (boolean-mask indexing: CPU path and oracle only)."""
    held = tables.id_of_slot[slot_start:slot_start + num_slots].long()
    tables.slot_for_id[held[held >= 0]] = -1
    tables.id_of_slot[slot_start:slot_start + num_slots] = -1
    tables.score[slot_start:slot_start + num_slots] = 0
    tables.last_use[slot_start:slot_start + num_slots] = 0


@functools.cache
def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def invalidate_slots_kernel(slot_for_id_ptr, id_of_slot_ptr, score_ptr, last_use_ptr, slot_start, num_slots,
                                BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        inside = offs < num_slots
        slots = slot_start + offs
        held = tl.load(id_of_slot_ptr + slots, mask=inside, other=-1)
        tl.debug_barrier()  # every thread reads before any thread clears, replicas included
        tl.store(slot_for_id_ptr + held, -1, mask=inside & (held >= 0))
        tl.store(id_of_slot_ptr + slots, -1, mask=inside)
        tl.store(score_ptr + slots, 0, mask=inside)
        tl.store(last_use_ptr + slots, 0, mask=inside)

    return invalidate_slots_kernel
