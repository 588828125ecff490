"""Expert-cache lookup and admission for one layer's routing: one launch, fixed shapes.

The kernel dedupes the routed expert ids, marks hits, picks a victim slot for every miss among the
slots of the managed range that this launch does not use, updates the tables and the policy state,
writes a fixed-shape copy plan ``(src_id, dst_slot)`` with its count on the device, and rewrites the
routing to slot ids. Victims are the lowest eviction keys, one int64 per slot:

```
 bits 63 62 | 61 60 | 59 ............................... 20 | 19 ......... 0
     0   0 | class | score - step + 2^39 - visit * until_visit | slot - start   class: 0 empty, 1 resident,
                     (- the low-priority penalty)                                  3 used now
```

Keys are unique (the slot is in them), so the twin's sort and the kernel's repeated min agree. The
kernel extracts one min per miss: its cost follows the misses, each of which moves a whole expert.
Slots below ``LowPriority.end`` (the prefill pipeline's lent slots, when decode may use them) rank
as if ``penalty`` launches older than they are: a resident there goes before one elsewhere unless
that one has been idle ``penalty`` launches longer, so the next prefill wipes the coldest entries.
Among empty slots it is the other way round: the others fill first (an admission there survives
the next prefill), so the score field of an empty slot is 0, or 1 below ``LowPriority.end``.

An ``ahead`` launch admits the experts predicted for the *next* lookup (cross-layer prefetch) while
the experts of the launch before may still be read: it runs at the step that lookup will take (no
advance), counts slots used by the launch before as used too, marks predicted hits used without
crediting them, and gives its admissions the score 0: the real lookup raises a right guess to a
fresh admission's score (``max(score, step)`` plus its credit), a wrong one stays the first victim. It never
takes a slot in use as a victim: predicted misses beyond the free victims are not admitted. Its misses
are admitted in the order of the prediction (an expert's first place in ``ids``: a router's top-k
comes most likely first), at most ``max_admit`` of them when that is given, so a prefetch can be
held to what crosses PCIe while the layer before computes.
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import torch

from moe_offload.kernels.triton_support import next_pow2, num_warps_for, pdl_args, use_triton

# Per layer, summed over launches: distinct experts looked up, of which resident (hits) and admitted
# (misses, each copied in by gather_missing), misses that displaced a resident expert, bytes copied.
# ``predicted``: of the hits, the experts an ahead launch had marked for this one (its prefetch hits).
STAT_FIELDS = ("lookups", "hits", "misses", "evictions", "bytes_h2d", "predicted")
IDX_BITS = 20
REL_BITS = 40
MAX_SLOTS = 1 << IDX_BITS


class CacheTables(NamedTuple):
    """Device state of the expert cache. Global expert id = ``layer * E + e``."""

    slot_for_id: torch.Tensor  # [L*E] int32, -1 = not resident
    id_of_slot: torch.Tensor  # [S] int32, -1 = empty
    score: torch.Tensor  # [S] int64, eviction score (lowest goes first)
    last_use: torch.Tensor  # [S] int64, the launch that last used the slot (0 = never)
    step: torch.Tensor  # [1] int64, launch counter, starts at 1, advanced by every lookup
    stats: torch.Tensor  # [L, len(STAT_FIELDS)] int64, per-layer counters


class CopyPlan(NamedTuple):
    """Experts to copy into slots: the first ``count`` rows are valid, the rest are -1."""

    src_id: torch.Tensor  # [P] int32 global expert ids
    dst_slot: torch.Tensor  # [P] int32
    count: torch.Tensor  # [1] int32, stays on the device


class Policy(NamedTuple):
    """Score on use, in launches, of an expert that ``m`` (token, choice) pairs of the launch route
    to: ``min(step + cap, max(score, step) + credit + pair_credit * (min(m, max_pairs) - 1))``.

    The score is the last use plus a bonus that decays by one per launch; each use adds ``credit``
    to what is left of it, up to ``cap``. ``(0, 0)`` is LRU; with ``credit`` above the launches
    between an expert's uses, frequently used experts bank credit that one-off experts lack.
    ``pair_credit`` banks more for an expert that several tokens of a batch share (at batch 1 the
    k choices are distinct: ``m`` is 1).

    ``visit`` ranks a slot lower by ``visit`` per launch until its layer is looked up again (1 for
    the next layer, L for the layer of this launch): layers are looked up in a cycle, so an expert
    whose layer comes next is needed sooner than an equally recent one whose layer just ran. Plain
    recency evicts exactly the experts needed next, and once a step needs more experts than the
    cache holds (batch 8 at 25%), LRU hits almost nothing.
    """

    credit: int
    cap: int
    visit: int = 0
    pair_credit: int = 0
    max_pairs: int = 1


class LowPriority(NamedTuple):
    """Victim ranking of slots ``[0, end)``: their score counts ``penalty`` launches lower."""

    end: int = 0
    penalty: int = 0


def plan_capacity(num_routed: int, num_experts: int) -> int:
    """Rows of the copy plan: a launch admits at most one copy per distinct expert."""
    return min(num_routed, num_experts)


def check_tables(tables: CacheTables, slot_start: int, num_slots: int) -> int:
    """Host-side bounds of a slot range; returns the table size S."""
    dtypes = (torch.int32, torch.int32, torch.int64, torch.int64, torch.int64, torch.int64)
    if any(t.dtype != d or not t.is_contiguous() for t, d in zip(tables, dtypes)):
        raise ValueError(f"cache tables must be contiguous with dtypes {dtypes}")
    size = tables.id_of_slot.numel()
    if any(t.numel() != size for t in (tables.score, tables.last_use)):
        raise ValueError("id_of_slot, score and last_use must have one length")
    if tables.step.numel() != 1 or tables.stats.dim() != 2 or tables.stats.shape[1] != len(STAT_FIELDS):
        raise ValueError(f"step must be [1] and stats [L, {len(STAT_FIELDS)}]")
    if slot_start < 0 or num_slots < 1 or slot_start + num_slots > size:
        raise ValueError(f"slot range [{slot_start}, {slot_start + num_slots}) is outside the {size} cache slots")
    if num_slots > MAX_SLOTS:
        raise ValueError(f"{num_slots} slots exceed the {MAX_SLOTS} an eviction key can address")
    return size


def _check(ids: torch.Tensor, layer: int, num_experts: int, tables: CacheTables,
           slot_start: int, num_slots: int, policy: Policy, low: LowPriority) -> None:
    size = check_tables(tables, slot_start, num_slots)
    if not (0 <= low.end <= size and 0 <= low.penalty < 1 << (REL_BITS - 2)):
        raise ValueError(f"{low} needs 0 <= end <= {size} slots and 0 <= penalty < 2^{REL_BITS - 2}")
    if ids.dim() != 2 or ids.dtype != torch.int64 or ids.numel() < 1:
        raise ValueError(f"ids must be a non-empty [T, k] int64 tensor, got {tuple(ids.shape)} {ids.dtype}")
    num_layers = tables.stats.shape[0]
    if tables.slot_for_id.numel() != num_layers * num_experts or not 0 <= layer < num_layers:
        raise ValueError(f"layer {layer} / {num_experts} experts do not match slot_for_id of {tables.slot_for_id.numel()} ids")
    if num_slots < plan_capacity(ids.numel(), num_experts):
        raise ValueError(f"{num_slots} slots cannot hold the up to {plan_capacity(ids.numel(), num_experts)} "
                         "distinct experts of one launch")
    if not (0 <= policy.credit <= policy.cap < 1 << (REL_BITS - 2) and 0 <= policy.visit * num_layers < 1 << 30
            and policy.pair_credit >= 0 and 1 <= policy.max_pairs and policy.pair_credit * policy.max_pairs < 1 << 30):
        raise ValueError(f"policy {policy} needs 0 <= credit <= cap < 2^{REL_BITS - 2}, 0 <= visit * L < 2^30, "
                         "pair_credit >= 0, max_pairs >= 1 and pair_credit * max_pairs < 2^30")
    if len({t.device for t in (ids, *tables)}) != 1:
        raise ValueError("ids and the cache tables must be on one device")


def lookup_admit(ids: torch.Tensor, layer: int, num_experts: int, tables: CacheTables, slot_start: int,
                 num_slots: int, policy: Policy, expert_bytes: int, backend: str | None = None,
                 low: LowPriority = LowPriority(), ahead: bool = False,
                 max_admit: int = 0) -> tuple[CopyPlan, torch.Tensor]:
    """Look up ``ids [T, k]`` (experts of ``layer``) and admit the misses into victims of slots
    ``[slot_start, slot_start + num_slots)``. Returns the copy plan and the slot ids ``[T, k]``
    int64 (-1 for ids outside ``[0, E)``). Advances ``tables.step`` and the layer's stats.

    ``num_slots`` must be at least ``min(T*k, E)``, checked from shapes, so victims never run out.
    ``low`` lowers the rank of the first slots as victims (see the module docstring). ``ahead``
    admits a prediction for the next lookup instead (module docstring; the step stays), at most
    ``max_admit`` of its misses if that is above 0; a following real lookup then needs
    ``min(2*T*k, E)`` slots (its experts and the prediction's).
    """
    _check(ids, layer, num_experts, tables, slot_start, num_slots, policy, low)
    if max_admit < 0 or (max_admit and not ahead):
        raise ValueError(f"max_admit caps an ahead launch's admissions (0: no cap), got {max_admit}"
                         f"{'' if ahead else ' for a real lookup'}")
    capacity = plan_capacity(ids.numel(), num_experts)
    device = ids.device
    plan = CopyPlan(torch.empty(capacity, dtype=torch.int32, device=device),
                    torch.empty(capacity, dtype=torch.int32, device=device),
                    torch.empty(1, dtype=torch.int32, device=device))
    slots = torch.empty(ids.shape, dtype=torch.int64, device=device)
    args = (ids.contiguous(), layer, num_experts, tables, slot_start, num_slots, policy, low, expert_bytes, plan,
            slots, ahead, max_admit)
    if use_triton(ids, backend):
        _launch(*args)
    else:
        lookup_admit_eager(*args)
    return plan, slots


def _touch(tables: CacheTables, slots: torch.Tensor, pairs: torch.Tensor, policy: Policy, step: int) -> None:
    """Credit the experts in ``slots``, each routed by ``pairs`` (token, choice) pairs."""
    old = tables.score[slots]
    bonus = policy.credit + policy.pair_credit * (pairs.clamp(max=policy.max_pairs) - 1)
    tables.score[slots] = torch.minimum(old.clamp(min=step) + bonus, torch.full_like(old, step + policy.cap))


def lookup_admit_eager(ids: torch.Tensor, layer: int, num_experts: int, tables: CacheTables, slot_start: int,
                       num_slots: int, policy: Policy, low: LowPriority, expert_bytes: int, plan: CopyPlan,
                       slots: torch.Tensor, ahead: bool = False, max_admit: int = 0) -> None:
    """Reference twin: reads the step and the miss count on the host (CPU path and oracle only)."""
    device, step = ids.device, int(tables.step[0])
    flat = ids.reshape(-1)
    valid = (flat >= 0) & (flat < num_experts)
    pairs = torch.bincount(flat[valid], minlength=num_experts)
    present = pairs > 0
    gid = layer * num_experts + torch.arange(num_experts, device=device)
    cur = tables.slot_for_id[gid].long()
    hit, miss = present & (cur >= 0), present & (cur < 0)
    predicted = int((tables.last_use[cur[hit]] == step).sum())
    tables.last_use[cur[hit]] = step  # used by this launch: no victim

    keys, cls = _victim_order(tables, layer, num_experts, slot_start, num_slots, policy, low, step, ahead)
    src = gid[miss]
    if ahead:  # a prediction's misses, most likely first; never a slot in use: what does not fit is not prefetched
        src = src[torch.argsort(_first_places(flat, valid, num_experts)[miss])]
        src = src[:min(int((cls < 3).sum()), max_admit or src.numel())]
    num_miss = src.numel()
    dst = slot_start + (keys[:num_miss] & (MAX_SLOTS - 1))
    old = tables.id_of_slot[dst].long()
    tables.slot_for_id[old[old >= 0]] = -1
    tables.slot_for_id[src] = dst.int()
    tables.id_of_slot[dst] = src.int()
    tables.score[dst] = 0
    tables.last_use[dst] = step
    if not ahead:  # credit hits and admissions alike (an ahead launch's: the real lookup credits them)
        now = tables.slot_for_id[gid[present]].long()
        _touch(tables, now, pairs[present], policy, step)

    _write_plan(plan, src, dst)
    looked = tables.slot_for_id[layer * num_experts + flat.clamp(0, num_experts - 1)].long()
    slots.copy_(torch.where(valid, looked, -1).view_as(slots))
    counts = [int(present.sum()), int(hit.sum()), num_miss, int((old >= 0).sum()), num_miss * expert_bytes, predicted]
    tables.stats[layer].add_(torch.tensor(counts, dtype=torch.int64, device=device))
    if not ahead:
        tables.step.add_(1)


def _first_places(flat: torch.Tensor, valid: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Each expert's first place in the routing ``flat`` (its length where it is absent)."""
    places = torch.arange(flat.numel(), device=flat.device)
    first = torch.full((num_experts,), flat.numel(), dtype=torch.int64, device=flat.device)
    return first.scatter_reduce_(0, flat[valid], places[valid], reduce="amin")


def _victim_order(tables: CacheTables, layer: int, num_experts: int, slot_start: int, num_slots: int,
                  policy: Policy, low: LowPriority, step: int, ahead: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The twin's victim ranking: sorted keys (class, relative score, slot index) of the slots
    ``[slot_start, slot_start + num_slots)``, and each slot's class (3: in use this step)."""
    rng = torch.arange(num_slots, device=tables.id_of_slot.device)
    occ = tables.id_of_slot[slot_start + rng]
    last = tables.last_use[slot_start + rng]
    used = (last >= step - int(ahead)) & (last > 0)  # ahead: the launch before may still be reading
    cls = torch.where(used, 3, torch.where(occ < 0, 0, 1)).long()
    num_layers = tables.stats.shape[0]
    until_visit = (occ.long().clamp(min=0) // num_experts - layer - 1 + num_layers) % num_layers + 1
    penalty = torch.where(slot_start + rng < low.end, low.penalty, 0) + policy.visit * until_visit
    rel = (tables.score[slot_start + rng] - step + (1 << (REL_BITS - 1)) - penalty).clamp(0, (1 << REL_BITS) - 1)
    rel = torch.where(occ < 0, (slot_start + rng < low.end).long(), rel)  # empty: low-priority ones last
    return torch.sort((cls << (REL_BITS + IDX_BITS)) | (rel << IDX_BITS) | rng).values, cls


def _write_plan(plan: CopyPlan, src: torch.Tensor, dst: torch.Tensor) -> None:
    plan.src_id.fill_(-1)
    plan.dst_slot.fill_(-1)
    plan.src_id[:src.numel()] = src.int()
    plan.dst_slot[:src.numel()] = dst.int()
    plan.count.fill_(src.numel())


def _launch(ids: torch.Tensor, layer: int, num_experts: int, tables: CacheTables, slot_start: int,
            num_slots: int, policy: Policy, low: LowPriority, expert_bytes: int, plan: CopyPlan,
            slots: torch.Tensor, ahead: bool, max_admit: int) -> None:
    block_e = next_pow2(num_experts)
    block_s = next_pow2(num_slots)
    _kernel()[(1,)](
        ids, tables.slot_for_id, tables.id_of_slot, tables.score, tables.last_use, tables.step, tables.stats,
        plan.src_id, plan.dst_slot, plan.count, slots,
        ids.numel(), layer, num_experts, slot_start, num_slots, plan.src_id.numel(), max_admit or plan.src_id.numel(),
        policy.credit, policy.cap, policy.visit, policy.pair_credit, policy.max_pairs, tables.stats.shape[0], low.end,
        low.penalty, expert_bytes,
        BLOCK_N=max(1, 4096 // block_e), BLOCK_E=block_e, BLOCK_S=block_s, BLOCK_P=next_pow2(plan.src_id.numel()),
        NUM_STATS=len(STAT_FIELDS), AHEAD=int(ahead), num_warps=num_warps_for(max(block_s, block_e)),
        **pdl_args(ids))


@functools.cache
def _kernel():
    import triton
    import triton.language as tl

    # the routed count and the plan's length follow the batch; the ids may be a per-layer view of
    # every layer's routing (synthetic routing), at an offset that follows it: none specialised
    @triton.jit(do_not_specialize=["num_routed", "plan_cap", "max_admit"], do_not_specialize_on_alignment=["ids_ptr"])
    def lookup_admit_kernel(ids_ptr, slot_for_id_ptr, id_of_slot_ptr, score_ptr, last_use_ptr, step_ptr, stats_ptr,
                            plan_src_ptr, plan_dst_ptr, count_ptr, slots_ptr,
                            num_routed, layer, num_experts, slot_start, num_slots, plan_cap, max_admit,
                            credit, cap, visit, pair_credit, max_pairs, num_layers, low_end, low_penalty,
                            expert_bytes,
                            BLOCK_N: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_S: tl.constexpr,
                            BLOCK_P: tl.constexpr, NUM_STATS: tl.constexpr, AHEAD: tl.constexpr,
                            PDL: tl.constexpr):
        if PDL:  # see triton_support.pdl_args
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        # Where a block is smaller than the CTA, threads hold replicas of one element; every
        # read-then-write of one address is split by a barrier so that no replica reads a value
        # its owner already replaced. Counters and the step are read up front for the same reason.
        step = tl.load(step_ptr)
        fields = tl.arange(0, 8)
        stat_ptrs = stats_ptr + layer * NUM_STATS + fields
        stats = tl.load(stat_ptrs, mask=fields < NUM_STATS)
        # 1. dedupe: how many pairs route to each expert of this layer, by comparing chunks against all E
        experts = tl.arange(0, BLOCK_E)
        pairs = tl.zeros([BLOCK_E], dtype=tl.int32)
        first = tl.full([BLOCK_E], num_routed, dtype=tl.int32)  # ahead: each expert's first place in ids
        for start in range(0, num_routed, BLOCK_N):
            offs = start + tl.arange(0, BLOCK_N)
            ids = tl.load(ids_ptr + offs, mask=offs < num_routed, other=-1)
            match = ids[:, None] == experts[None, :]
            pairs += tl.sum(match.to(tl.int32), axis=0)
            if AHEAD:
                first = tl.minimum(first, tl.min(tl.where(match, offs[:, None], num_routed), axis=0))
        present = (pairs > 0) & (experts < num_experts)
        gid = layer * num_experts + experts
        cur = tl.load(slot_for_id_ptr + gid, mask=present, other=-1)
        hit = present & (cur >= 0)
        miss = present & (cur < 0)
        num_miss = tl.sum(miss.to(tl.int32), axis=0)

        # 2. mark the hits: last_use == step makes them used by this launch, no victims (their
        #    credit comes with the admissions', in 6)
        old_last = tl.load(last_use_ptr + cur, mask=hit, other=0)
        tl.debug_barrier()
        tl.store(last_use_ptr + cur, step, mask=hit)
        tl.debug_barrier()

        # 3. victims' keys over the range, read after the touches
        s = tl.arange(0, BLOCK_S)
        in_range = s < num_slots
        occ = tl.load(id_of_slot_ptr + slot_start + s, mask=in_range, other=-1)
        last = tl.load(last_use_ptr + slot_start + s, mask=in_range, other=0)
        used = (last >= step - AHEAD) & (last > 0)  # ahead: the launch before may still be reading
        score = tl.load(score_ptr + slot_start + s, mask=in_range, other=0)
        cls = tl.where(used | ~in_range, 3, tl.where(occ < 0, 0, 1)).to(tl.int64)
        until_visit = (tl.maximum(occ, 0) // num_experts - layer - 1 + num_layers) % num_layers + 1
        penalty = tl.where(slot_start + s < low_end, low_penalty, 0).to(tl.int64) + visit * until_visit.to(tl.int64)
        rel = tl.minimum(tl.maximum(score - step + (1 << 39) - penalty, 0), (1 << 40) - 1)
        rel = tl.where(occ < 0, (slot_start + s < low_end).to(tl.int64), rel)  # empty: low-priority ones last
        keys = (cls << 60) | (rel << 20) | s.to(tl.int64)  # the layout drawn in the module docstring
        num_admit = num_miss
        if AHEAD:  # a prediction never takes a slot in use: what does not fit is not prefetched
            num_admit = tl.minimum(tl.minimum(num_miss, tl.sum((cls < 3).to(tl.int32), axis=0)), max_admit)

        # 4. plan: sources are the first num_admit misses in expert order (ahead: in the order of
        #    their first places in ids), victims the num_admit lowest keys in key order; padding rows -1
        if AHEAD:
            todo = miss
            for j in range(0, num_admit):
                place = tl.min(tl.where(todo, first, num_routed), axis=0)
                pick = todo & (first == place)
                tl.store(plan_src_ptr + j, tl.sum(tl.where(pick, gid, 0), axis=0))
                todo = todo & ~pick
        else:
            rank = tl.cumsum(miss.to(tl.int32), axis=0) - 1
            tl.store(plan_src_ptr + rank, gid, mask=miss & (rank < num_admit))
        rows = tl.arange(0, BLOCK_P)
        pad = (rows >= num_admit) & (rows < plan_cap)
        tl.store(plan_src_ptr + rows, -1, mask=pad)
        tl.store(plan_dst_ptr + rows, -1, mask=pad)
        for j in range(0, num_admit):
            low = tl.min(keys, axis=0)
            tl.store(plan_dst_ptr + j, (slot_start + (low & ((1 << 20) - 1))).to(tl.int32))
            keys = tl.where(keys == low, 0x7FFFFFFFFFFFFFFF, keys)
        tl.debug_barrier()

        # 5. admit: the victim's old id leaves, the new one moves in with a fresh score
        admit = rows < num_admit
        src = tl.load(plan_src_ptr + rows, mask=admit, other=0)
        dst = tl.load(plan_dst_ptr + rows, mask=admit, other=0)
        old = tl.load(id_of_slot_ptr + dst, mask=admit, other=-1)
        evicted = admit & (old >= 0)
        tl.debug_barrier()
        tl.store(slot_for_id_ptr + old, -1, mask=evicted)
        tl.store(slot_for_id_ptr + src, dst, mask=admit)
        tl.store(id_of_slot_ptr + dst, src, mask=admit)
        tl.store(score_ptr + dst, 0, mask=admit)  # ahead: stays 0 (module docstring)
        tl.store(last_use_ptr + dst, step, mask=admit)
        tl.debug_barrier()

        # 6. credit the hits and the admissions (an ahead launch's: the real lookup credits them)
        if not AHEAD:
            now = tl.load(slot_for_id_ptr + gid, mask=present, other=-1)
            live = present & (now >= 0)
            old_score = tl.load(score_ptr + now, mask=live, other=0)
            tl.debug_barrier()
            bonus = credit + pair_credit * (tl.minimum(pairs, max_pairs) - 1)
            tl.store(score_ptr + now, tl.minimum(tl.maximum(old_score, step) + bonus, step + cap), mask=live)
            tl.debug_barrier()

        # 7. routing -> slots, read back from the updated table
        for start in range(0, num_routed, BLOCK_N):
            offs = start + tl.arange(0, BLOCK_N)
            ids = tl.load(ids_ptr + offs, mask=offs < num_routed, other=-1)
            ok = (ids >= 0) & (ids < num_experts)
            slot = tl.load(slot_for_id_ptr + layer * num_experts + ids, mask=ok, other=-1)
            tl.store(slots_ptr + offs, slot.to(tl.int64), mask=offs < num_routed)

        # 8. counters
        num_present = tl.sum(present.to(tl.int64), axis=0)
        num_hit = tl.sum(hit.to(tl.int64), axis=0)
        num_evicted = tl.sum(evicted.to(tl.int64), axis=0)
        num_predicted = tl.sum((hit & (old_last == step)).to(tl.int64), axis=0)
        add = tl.where(fields == 0, num_present, tl.where(fields == 1, num_hit, tl.where(
            fields == 2, num_admit.to(tl.int64), tl.where(fields == 3, num_evicted, tl.where(
                fields == 4, num_admit.to(tl.int64) * expert_bytes, num_predicted)))))
        tl.store(stat_ptrs, stats + add, mask=fields < NUM_STATS)
        tl.store(count_ptr, num_admit)
        if not AHEAD:
            tl.store(step_ptr, step + 1)

    return lookup_admit_kernel
