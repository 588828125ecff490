"""The GPU expert cache: one slot pool per weight bank shared by all MoE layers, and its tables.

```
 slots   | 0 ........ 2E-1 | 2E ......................................... S-1 |
         | lent to prefill |                 decode only                     |
         |  (invalidated before each prefill streams into them; decode may     |
         |   fill them again in between)                                       |
 tables  slot_for_id [L*E] int32 -> slot or -1      id_of_slot [S] int32 -> id or -1
         score, last_use [S] int64 (policy)         step [1] int64          stats [L, 6] int64
         prefetch_stats [L, 6] int64: the same counters for the ahead lookups of cross-layer prefetch
 scales  fp8: w13_scale, w2_scale float32 grids; 4-bit: packed w13 / w2, group scales (and nvfp4's
         per-row channel scales): formats.bank_specs, moved as bytes like the weights
```

Everything the hot path touches stays on the device: lookups, admissions, the copy plan, the step
counter and the statistics. ``stats()`` reads the counters and is meant for off the hot path.
"""
from __future__ import annotations

import math

import torch

from moe_offload import expert_records
from moe_offload.choices import POLICIES
from moe_offload.experts import ExpertBanks
from moe_offload.expert_scales import ExpertScales
from moe_offload.formats import ExpertFormat, ScaleBlock, bank_specs
from moe_offload.slot_fill import SlotFill
from moe_offload.kernels.invalidate_slots import invalidate_slots
from moe_offload.kernels.lookup_admit import STAT_FIELDS, CacheTables, CopyPlan, LowPriority, Policy, lookup_admit

# LFRU in model steps (one lookup per layer per step): each use banks a step and a quarter of credit
# against the one that decays, so an expert used every step gains a quarter step over one-off
# traffic each step, up to 8; a use banks 3 steps more for each (token, choice) pair past the first
# that routes to the expert (up to 8 pairs), so at batch 8 the experts that many sequences share
# outlast those one sequence used; and among equally old experts, those whose layer is looked up
# last go first (Policy.visit). Replayed with synthetic Qwen3-30B-A3B routing
# (scripts/cache_policy_report.py, 48 layers, 128 steps), as a fraction of Belady's MIN at 10% /
# 25% / 50% cache: batch 1 0.797 / 0.930 / 0.990; batch 8 0.910 / 0.814 / 0.954 (router seed 1:
# 0.913 / 0.813 / 0.954), where without the pair credit 0.837 / 0.795 / 0.954 (seed 1: 0.846 /
# 0.798 / 0.953). No credit at all (a step or less is plain recency) gave batch 8 0.699 at 10%.
# Batch 1 at 10% stays near 0.8 of MIN for every rule read from the experts' use history that a
# throw-away study tried (LRU-2, decayed LFU, age since admission, tables learned online): a
# token's 8 picks among its ~18 live experts are coin flips that only the offline optimum sees.
LFRU_CREDIT_QUARTER_STEPS = 5
LFRU_PAIR_CREDIT_QUARTER_STEPS = 12
LFRU_MAX_PAIRS = 8
LFRU_CAP_STEPS = 8
LFRU_VISIT = 2


def policy_for(name: str, num_layers: int, credit_quarter_steps: int = LFRU_CREDIT_QUARTER_STEPS,
               cap_steps: int = LFRU_CAP_STEPS, pair_credit_quarter_steps: int = LFRU_PAIR_CREDIT_QUARTER_STEPS
               ) -> Policy:
    """Policy parameters in launches; every layer's lookup advances the step counter. The lfru
    parameters are the engine's unless a replay (scripts/cache_policy_report.py) tries others."""
    if name == "lru":
        return Policy(credit=0, cap=0)
    if name == "lfru":
        def launches(quarter_steps: int) -> int:
            return -(-quarter_steps * num_layers // 4)  # rounded up: over a step at any L

        return Policy(credit=launches(credit_quarter_steps), cap=cap_steps * num_layers, visit=LFRU_VISIT,
                      pair_credit=launches(pair_credit_quarter_steps), max_pairs=LFRU_MAX_PAIRS)
    raise ValueError(f"cache policy {name!r} is not one of {POLICIES}")


def resolve_cache_slots(num_experts_total: int, slot_bytes: int, size: int | None = None,
                        fraction: float | None = None, auto_free_bytes: int | None = None) -> int:
    """Number of cache slots from exactly one of: ``size`` (slots), ``fraction`` (of all experts),
    ``auto_free_bytes`` (device bytes the cache may take). Never more than there are experts."""
    given = [name for name, value in (("size", size), ("fraction", fraction), ("auto_free_bytes", auto_free_bytes))
             if value is not None]
    if len(given) != 1:
        raise ValueError(f"give exactly one of size, fraction, auto_free_bytes; got {given or 'none'}")
    if num_experts_total < 1 or slot_bytes < 1:
        raise ValueError(f"need at least one expert and one byte per slot, got {num_experts_total}, {slot_bytes}")
    if size is not None:
        slots = size
    elif fraction is not None:
        if not 0.0 < fraction <= 1.0:
            raise ValueError(f"fraction must be in (0, 1], got {fraction}")
        slots = max(1, int(fraction * num_experts_total))
    else:
        slots = auto_free_bytes // slot_bytes
    if slots < 1:
        raise ValueError(f"the cache would hold no expert (size={size}, auto_free_bytes={auto_free_bytes}, "
                         f"{slot_bytes} bytes per slot)")
    return min(slots, num_experts_total)


def slot_bytes(w13_shape: tuple[int, int], w2_shape: tuple[int, int], dtype: torch.dtype,
               scale_block: ScaleBlock | None = None, kind: str = "") -> int:
    """Bytes of one expert of logical shapes ``w13 [2I, H]``, ``w2 [H, I]`` in its format (what a
    cache slot holds and a miss moves over PCIe): every bank the format holds, scales included."""
    specs = bank_specs(ExpertFormat(dtype, scale_block, kind), w2_shape[1], w2_shape[0])
    return sum(math.prod(shape) * dtype.itemsize for shape, dtype in specs.values())


class ExpertCache:
    """Slot pools ``w13 [S, ...]``, ``w2 [S, ...]`` in the experts' format and its scale pools
    (``scales``; ``formats.bank_specs``), and the device tables that map expert ids
    (``layer * E + e``) to slots. ``w13_shape [2I, H]`` and ``w2_shape [H, I]`` are the logical
    matrices (4-bit banks are packed). ``backend`` picks the kernels' path (``kernels.triton_support``)."""

    def __init__(self, num_layers: int, num_experts: int, w13_shape: tuple[int, int], w2_shape: tuple[int, int],
                 num_slots: int, dtype: torch.dtype, device: torch.device | str, policy: str = "lfru",
                 backend: str | None = None, scale_block: ScaleBlock | None = None, kind: str = ""):
        if num_slots < 1 or num_layers < 1 or num_experts < 1:
            raise ValueError(f"need layers, experts and slots >= 1, got {num_layers}, {num_experts}, {num_slots}")
        self.format = fmt = ExpertFormat(dtype, scale_block, kind)
        if (fmt.family != "float") != (scale_block is not None):
            raise ValueError(f"{fmt.family} slots of {dtype} need a scale block exactly when quantized "
                             f"(got {scale_block})")
        self.num_layers = num_layers
        self.num_experts = num_experts
        self.policy_name = policy
        self.policy = policy_for(policy, num_layers)
        self.backend = backend
        # ==== slot pools: contents are only meaningful where id_of_slot says so ====
        # expert-major: a slot is one record of every bank's row (``expert_records``), as in the store
        specs = list(bank_specs(fmt, w2_shape[1], w2_shape[0]).values())
        _, pools = expert_records.allocate(num_slots, specs, device)  # the views keep the records alive
        self.w13, self.w2 = pools[:2]
        self.scales = None if scale_block is None else ExpertScales(
            pools[2], pools[3], scale_block, kind=kind).with_tensors(pools[2:])
        self.slot_bytes = slot_bytes(w13_shape, w2_shape, dtype, scale_block, kind)  # what one miss moves over PCIe
        # ==== tables ====
        self.tables = CacheTables(
            slot_for_id=torch.full((num_layers * num_experts,), -1, dtype=torch.int32, device=device),
            id_of_slot=torch.full((num_slots,), -1, dtype=torch.int32, device=device),
            score=torch.zeros(num_slots, dtype=torch.int64, device=device),
            last_use=torch.zeros(num_slots, dtype=torch.int64, device=device),
            step=torch.ones(1, dtype=torch.int64, device=device),
            stats=torch.zeros(num_layers, len(STAT_FIELDS), dtype=torch.int64, device=device),
        )
        self.prefetch_stats = torch.zeros_like(self.tables.stats)

    @classmethod
    def for_banks(cls, banks: ExpertBanks, num_slots: int, device: torch.device | str, policy: str = "lfru",
                  backend: str | None = None) -> ExpertCache:
        """A cache on ``device`` for the experts of ``banks`` (wherever those live)."""
        inter, hidden = banks.w13.shape[2] // 2, banks.w2.shape[2]
        return cls(banks.num_layers, banks.num_experts, (2 * inter, hidden), (hidden, inter),
                   num_slots, banks.w13.dtype, device, policy, backend, banks.scale_block, banks.kind)

    @property
    def num_slots(self) -> int:
        return self.w13.shape[0]

    def lookup(self, layer: int, ids: torch.Tensor, slot_start: int = 0, num_slots: int | None = None,
               low: LowPriority = LowPriority(), ahead: bool = False, max_admit: int = 0) -> tuple[CopyPlan, torch.Tensor]:
        """Route ``ids [T, k]`` of ``layer`` to slots, admitting misses into ``[slot_start, +num_slots)``
        (default: every slot from ``slot_start`` on), slots below ``low.end`` ranking first as
        victims. The plan still has to be gathered (``fill``). ``ahead``: ``ids`` is a prediction
        for the next lookup (``kernels.lookup_admit``), counted in ``prefetch_stats``, admitting at most
        ``max_admit`` of its misses (0: all that fit)."""
        if num_slots is None:
            num_slots = self.num_slots - slot_start
        tables = self.tables._replace(stats=self.prefetch_stats) if ahead else self.tables
        return lookup_admit(ids, layer, self.num_experts, tables, slot_start, num_slots, self.policy,
                            self.slot_bytes, self.backend, low, ahead, max_admit)

    def fill(self, plan: CopyPlan, host_w13: torch.Tensor, host_w2: torch.Tensor,
             host_scales: ExpertScales | None = None, programs: int | None = None) -> None:
        """Copy the planned experts from ``host_w13 [L*E, 2I, H]``, ``host_w2 [L*E, H, I]`` (and a
        quantized cache's scale banks from ``host_scales``, ``[L*E, ...]``); ``programs`` as
        ``gather_missing`` takes it."""
        SlotFill(plan, host_w13, host_w2, host_scales).gather(self.w13, self.w2, self.scales, self.backend,
                                                              programs)

    def invalidate(self, slot_start: int, num_slots: int) -> None:
        """Empty ``[slot_start, slot_start + num_slots)`` (the prefill pipeline's lent slots)."""
        invalidate_slots(slot_start, num_slots, self.tables, self.backend)

    def stats(self) -> dict:
        """Per-layer and total counters, and the prefetch's totals (``prefetch``: experts predicted,
        already resident, admitted, evicted, bytes moved); reads the device, so call it off the hot
        path."""
        layers = [dict(zip(STAT_FIELDS, row)) for row in self.tables.stats.cpu().tolist()]
        total = {field: sum(layer[field] for layer in layers) for field in STAT_FIELDS}
        hit_rate = total["hits"] / total["lookups"] if total["lookups"] else 0.0
        prefetch = dict(zip(STAT_FIELDS, self.prefetch_stats.sum(0).cpu().tolist()))
        return {"policy": self.policy_name, "slots": self.num_slots, "slot_bytes": self.slot_bytes,
                "hit_rate": hit_rate, "total": total, "layers": layers, "prefetch": prefetch}

    def reset_stats(self) -> None:
        self.tables.stats.zero_()
        self.prefetch_stats.zero_()
