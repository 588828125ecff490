"""Parity of the expert-cache kernels (lookup_admit, gather_missing, invalidate_slots) with their
eager twins, and their host-side bounds checks. Interpreted on the CPU (TRITON_INTERPRET=1, tiny
sizes); compiled and sync-free on a GPU."""
from __future__ import annotations

import contextlib
import importlib.util
import os
from typing import NamedTuple

import pytest
import torch

# The interpreter is chosen when a kernel is decorated, i.e. lazily on the first launch inside a
# test; on a GPU the kernels must compile instead.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from moe_offload.choices import FILL_MODES  # noqa: E402
from tests.launch_count import count_launches, sync_errors  # noqa: E402
from moe_offload.experts import ExpertBanks, ResidentExperts  # noqa: E402
from moe_offload.kernels import gather_missing as gather_mod  # noqa: E402
from moe_offload.kernels import invalidate_slots as invalidate_mod  # noqa: E402
from moe_offload.kernels import lookup_admit as lookup_mod  # noqa: E402
from moe_offload.kernels.lookup_admit import STAT_FIELDS, CacheTables, LowPriority, Policy  # noqa: E402
from moe_offload.offloaded import OffloadedExperts  # noqa: E402

interpreted = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1" or importlib.util.find_spec("triton") is None,
                                 reason="needs triton and TRITON_INTERPRET=1")
TRIALS = 20


class Config(NamedTuple):
    layers: int
    experts: int
    table_slots: int
    slot_start: int
    num_slots: int
    tokens: int
    top_k: int
    policy: Policy
    low: LowPriority = LowPriority()


CONFIGS = {
    "lru-small": Config(2, 8, 12, 0, 12, 3, 2, Policy(0, 0)),
    "lfru-offset": Config(3, 16, 40, 4, 20, 5, 4, Policy(6, 96)),  # hits may sit outside the range
    "exact-capacity": Config(2, 8, 10, 2, 8, 8, 2, Policy(4, 64)),  # T*k > E = num_slots
    "odd-sizes": Config(3, 6, 9, 1, 6, 1, 3, Policy(3, 30)),
    "low-priority": Config(3, 16, 40, 0, 40, 5, 4, Policy(6, 96), LowPriority(16, 20)),  # decode in lent slots
    "low-priority-lru": Config(2, 16, 24, 0, 24, 2, 2, Policy(0, 0), LowPriority(16, 3)),
    "visit": Config(3, 16, 40, 4, 20, 5, 4, Policy(6, 96, 2)),  # layers' next lookups rank the victims
    "visit-low-priority": Config(4, 8, 28, 0, 28, 2, 2, Policy(4, 8, 3), LowPriority(16, 10)),
    "pairs": Config(3, 16, 40, 4, 20, 5, 4, Policy(0, 96, 2, 6, 4)),  # shared experts bank credit per pair
    "pairs-credit-capped": Config(2, 8, 12, 0, 12, 6, 2, Policy(4, 12, 0, 3, 8)),
}


def empty_tables(cfg: Config, device="cpu") -> CacheTables:
    size, ids = cfg.table_slots, cfg.layers * cfg.experts
    return CacheTables(torch.full((ids,), -1, dtype=torch.int32, device=device),
                       torch.full((size,), -1, dtype=torch.int32, device=device),
                       torch.zeros(size, dtype=torch.int64, device=device),
                       torch.zeros(size, dtype=torch.int64, device=device),
                       torch.ones(1, dtype=torch.int64, device=device),
                       torch.zeros(cfg.layers, len(STAT_FIELDS), dtype=torch.int64, device=device))


def random_tables(cfg: Config, gen: torch.Generator) -> CacheTables:
    """A consistent cache: empty, half, nearly full or full, with random (often tied) scores."""
    tables = empty_tables(cfg)
    size = cfg.table_slots
    fill = [0, size // 2, size - 1, size][int(torch.randint(4, (1,), generator=gen))]
    slots = torch.randperm(size, generator=gen)[:fill]
    ids = torch.randperm(cfg.layers * cfg.experts, generator=gen)[:fill]
    tables.id_of_slot[slots] = ids.int()
    tables.slot_for_id[ids] = slots.int()
    step = int(torch.randint(20, 200, (1,), generator=gen))
    tables.step.fill_(step)
    ago = torch.randint(1, step, (fill,), generator=gen)
    recent = torch.rand(fill, generator=gen) < 0.5  # banked credit near the cap only matters for these
    tables.last_use[slots] = step - torch.where(recent, torch.randint(1, 4, (fill,), generator=gen), ago)
    bonus = torch.randint(0, cfg.policy.cap + 1, (fill,), generator=gen) // 4 * 4  # coarse: many ties
    tables.score[slots] = tables.last_use[slots] + bonus
    tables.stats.copy_(torch.randint(0, 100, tables.stats.shape, generator=gen))
    return tables


def random_ids(cfg: Config, gen: torch.Generator) -> torch.Tensor:
    """Routing drawn from a random subset of the experts, so duplicates are common."""
    pool = torch.randperm(cfg.experts, generator=gen)[:int(torch.randint(1, cfg.experts + 1, (1,), generator=gen))]
    return pool[torch.randint(len(pool), (cfg.tokens, cfg.top_k), generator=gen)]


def clone(tables: CacheTables, device="cpu") -> CacheTables:
    return CacheTables(*(t.clone().to(device) for t in tables))


def assert_same(got, want) -> None:
    for name, a, b in zip(got._fields, got, want):
        assert torch.equal(a.cpu(), b.cpu()), f"{name}: {a} != {b}"


def run_lookups(cfg: Config, seed: int, device: str, backend: str | None, guard=contextlib.nullcontext,
                launches: int = 3, ahead: bool = False, max_admit: int = 0) -> None:
    """Consecutive launches on random layers from a random state, kernel (under ``guard``) vs twin;
    with ``ahead``, each followed by an ahead launch (a prefetch) for the next layer, admitting at
    most ``max_admit`` (0: no cap), which the next launch then looks up, as the engine does
    (``ExpertPrefetch.fits`` counts slots for that)."""
    gen = torch.Generator().manual_seed(seed)
    want = random_tables(cfg, gen)
    got = clone(want, device)
    layer = int(torch.randint(cfg.layers, (1,), generator=gen))
    for _ in range(launches):
        if not ahead:
            layer = int(torch.randint(cfg.layers, (1,), generator=gen))
        for lookup_layer, is_ahead in ((layer, False), ((layer + 1) % cfg.layers, True))[:1 + ahead]:
            ids = random_ids(cfg, gen)
            args = (lookup_layer, cfg.experts)
            rest = (cfg.slot_start, cfg.num_slots, cfg.policy, 1000)
            cap = max_admit if is_ahead else 0
            want_plan, want_slots = lookup_mod.lookup_admit(ids, *args, want, *rest, backend="eager", low=cfg.low,
                                                            ahead=is_ahead, max_admit=cap)
            dev_ids = ids.to(device)
            with guard():
                got_plan, got_slots = lookup_mod.lookup_admit(dev_ids, *args, got, *rest, backend=backend,
                                                              low=cfg.low, ahead=is_ahead, max_admit=cap)
            assert_same(got_plan, want_plan)
            assert torch.equal(got_slots.cpu(), want_slots)
            assert_same(got, want)
        layer = (layer + 1) % cfg.layers
    check_consistent(want)


def check_consistent(tables: CacheTables) -> None:
    """The twin keeps the two maps inverse to each other: the oracle itself must be sane."""
    resident = torch.nonzero(tables.slot_for_id >= 0).squeeze(-1)
    assert torch.equal(tables.id_of_slot[tables.slot_for_id[resident].long()].long(), resident)
    assert int((tables.id_of_slot >= 0).sum()) == resident.numel()


# ==== lookup_admit ====

@interpreted
@pytest.mark.parametrize("name", CONFIGS)
def test_lookup_admit_interpreted(name):
    for trial in range(TRIALS):
        run_lookups(CONFIGS[name], seed=trial, device="cpu", backend="triton")


@interpreted
@pytest.mark.parametrize("max_admit", [0, 1, 3])
@pytest.mark.parametrize("name", ["lru-small", "lfru-offset", "low-priority", "visit"])
def test_lookup_admit_ahead_interpreted(name, max_admit):
    for trial in range(TRIALS):
        run_lookups(CONFIGS[name], seed=trial, device="cpu", backend="triton", ahead=True, max_admit=max_admit)


@pytest.mark.parametrize("backend", ["eager", "triton"])
def test_an_ahead_lookup_admits_the_guess_in_its_order_up_to_its_cap(backend):
    """A prediction's misses are admitted most likely first (their first place in the guess, not
    their expert ids' order), at most ``max_admit``; its hits are marked, not counted as admitted."""
    if backend == "triton" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the kernel runs interpreted on the CPU")
    cfg = Config(2, 16, 8, 0, 8, 1, 6, Policy(credit=4, cap=16))
    tables = empty_tables(cfg)
    guess = torch.tensor([[11, 3, 14, 3, 7, 2]])
    lookup_mod.lookup_admit(torch.tensor([[14]]), 1, 16, tables, 0, 8, cfg.policy, 1, backend=backend)  # 14 resident
    for cap, admitted in ((2, [16 + 11, 16 + 3]), (0, [16 + 11, 16 + 3, 16 + 7, 16 + 2])):
        fresh = clone(tables)
        plan, _ = lookup_mod.lookup_admit(guess, 1, 16, fresh, 0, 8, cfg.policy, 1, backend=backend, ahead=True,
                                          max_admit=cap)
        assert plan.src_id[:int(plan.count)].tolist() == admitted
        assert int(fresh.slot_for_id[16 + 14]) >= 0 and all(int(fresh.slot_for_id[i]) >= 0 for i in admitted)


def test_max_admit_is_for_ahead_lookups():
    cfg = Config(1, 8, 8, 0, 8, 1, 2, Policy(credit=4, cap=16))
    for bad, ahead in ((-1, True), (2, False)):
        with pytest.raises(ValueError, match="max_admit"):
            lookup_mod.lookup_admit(torch.tensor([[1, 2]]), 0, 8, empty_tables(cfg), 0, 8, cfg.policy, 1,
                                    ahead=ahead, max_admit=bad)


def test_an_expert_that_more_tokens_share_banks_more_credit():
    """Score on use: max(score, step) + credit + pair_credit * (min(pairs, max_pairs) - 1), capped."""
    policy = Policy(credit=1, cap=20, pair_credit=4, max_pairs=3)
    cfg = Config(1, 8, 8, 0, 8, 4, 2, policy)
    tables = empty_tables(cfg)
    tables.step.fill_(10)
    ids = torch.tensor([[0, 1], [0, 2], [0, 1], [0, 3]])  # expert 0: 4 pairs (3 counted), 1: 2, 2 and 3: 1
    _, slots = lookup_mod.lookup_admit(ids, 0, 8, tables, 0, 8, policy, 1, backend="eager")
    score = {e: int(tables.score[tables.slot_for_id[e]]) for e in range(4)}
    assert score == {0: min(10 + 1 + 4 * 2, 10 + 20), 1: 10 + 1 + 4, 2: 11, 3: 11}
    tables.step.fill_(12)  # again: the banked credit grows from what is left, up to the cap
    lookup_mod.lookup_admit(ids[:1], 0, 8, tables, 0, 8, policy, 1, backend="eager")
    assert int(tables.score[tables.slot_for_id[0]]) == min(19 + 1, 12 + 20)


def test_lookup_admit_twin_semantics():
    """Hand-checked case: hits keep their slots, misses fill empty slots first, then the lowest
    score among slots not used by this launch; the step and the stats advance."""
    cfg = Config(1, 8, 4, 0, 4, 2, 2, Policy(0, 0))
    tables = empty_tables(cfg)
    for slot, (expert, last) in enumerate([(0, 5), (1, 3), (2, 4)]):  # slot 3 empty
        tables.id_of_slot[slot], tables.slot_for_id[expert] = expert, slot
        tables.last_use[slot] = tables.score[slot] = last
    tables.step.fill_(10)
    ids = torch.tensor([[2, 5], [6, 5]])
    plan, slots = lookup_mod.lookup_admit(ids, 0, 8, tables, 0, 4, cfg.policy, 7, backend="eager")
    assert plan.count.tolist() == [2] and plan.src_id.tolist() == [5, 6, -1, -1]
    assert plan.dst_slot.tolist() == [3, 1, -1, -1]  # the empty slot, then expert 1 (oldest)
    assert slots.tolist() == [[2, 3], [1, 3]]
    assert tables.id_of_slot.tolist() == [0, 6, 2, 5] and tables.slot_for_id.tolist() == [0, -1, 2, -1, -1, 3, 1, -1]
    assert tables.last_use.tolist() == [5, 10, 10, 10] and tables.step.tolist() == [11]
    assert tables.stats[0].tolist() == [3, 1, 2, 1, 14, 0]  # no prefetch marked any hit


def test_lookup_admit_visit_ranks_the_layer_looked_up_last_first():
    """Equally old residents of layers 1, 2 and 0; a miss of layer 0 evicts layer 1's expert under
    LRU (the lowest slot of a tie) but layer 0's with ``visit``: layer 1 is looked up next, layer 0
    only after a whole cycle."""
    cfg = Config(3, 4, 3, 0, 3, 1, 1, Policy(0, 0))
    for visit, want in ((0, 0), (1, 2)):
        tables = empty_tables(cfg)
        for slot, gid in enumerate([4, 8, 0]):  # layers 1, 2, 0
            tables.id_of_slot[slot], tables.slot_for_id[gid] = gid, slot
            tables.last_use[slot] = tables.score[slot] = 5
        tables.step.fill_(10)
        plan, _ = lookup_mod.lookup_admit(torch.tensor([[1]]), 0, 4, tables, 0, 3, Policy(0, 0, visit), 1,
                                          backend="eager")
        assert plan.dst_slot.tolist() == [want]


@pytest.mark.parametrize("backend", ["eager", "triton"])
def test_lookup_admit_fills_empty_slots_outside_the_low_priority_range_first(backend):
    """Empty slots 0-5, slots 0-3 low priority (lent): three misses take slots 4, 5, then 0. An
    admission outside the lent range survives the next prefill; among residents the lent ones still
    go first (slot 2, resident as long as slot 6, is the victim before it)."""
    if backend == "triton" and os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available():
        pytest.skip("needs TRITON_INTERPRET=1 or a GPU")
    device = "cuda" if backend == "triton" and torch.cuda.is_available() else "cpu"
    cfg = Config(1, 16, 6, 0, 6, 3, 1, Policy(0, 0), LowPriority(4, 3))
    tables = empty_tables(cfg, device)
    plan, _ = lookup_mod.lookup_admit(torch.tensor([[7], [8], [9]], device=device), 0, 16, tables, 0, 6, cfg.policy,
                                      1, low=cfg.low, backend=backend)
    assert plan.dst_slot.tolist()[:3] == [4, 5, 0]
    cfg = Config(1, 16, 7, 0, 7, 1, 1, Policy(0, 0), LowPriority(4, 3))
    tables = empty_tables(cfg, device)
    for slot, expert in enumerate([0, 1, 2, 3, 4, 5, 6]):
        tables.id_of_slot[slot], tables.slot_for_id[expert] = expert, slot
        tables.last_use[slot] = tables.score[slot] = 5 + (slot not in (2, 6))  # slots 2 and 6 the oldest
    tables.step.fill_(10)
    plan, _ = lookup_mod.lookup_admit(torch.tensor([[9]], device=device), 0, 16, tables, 0, 7, cfg.policy, 1,
                                      low=cfg.low, backend=backend)
    assert plan.dst_slot.tolist()[:1] == [2]


def test_lookup_admit_bounds():
    cfg = Config(1, 256, 600, 0, 600, 4, 8, Policy(0, 0))
    tables = empty_tables(cfg)
    ids = torch.zeros(4, 8, dtype=torch.int64)
    with pytest.raises(ValueError, match="outside"):
        lookup_mod.lookup_admit(ids, 0, 256, tables, 512, 256, cfg.policy, 1)
    with pytest.raises(ValueError, match="outside"):
        lookup_mod.lookup_admit(ids, 0, 256, tables, -1, 8, cfg.policy, 1)
    with pytest.raises(ValueError, match="distinct"):  # 31 slots < min(T*k=32, E=256)
        lookup_mod.lookup_admit(ids, 0, 256, tables, 0, 31, cfg.policy, 1)
    with pytest.raises(ValueError, match="layer"):
        lookup_mod.lookup_admit(ids, 1, 256, tables, 0, 32, cfg.policy, 1)
    with pytest.raises(ValueError, match="int64"):
        lookup_mod.lookup_admit(ids.int(), 0, 256, tables, 0, 32, cfg.policy, 1)
    with pytest.raises(ValueError, match="credit"):
        lookup_mod.lookup_admit(ids, 0, 256, tables, 0, 32, Policy(5, 1), 1)


# ==== gather_missing ====

class GatherShape(NamedTuple):
    num_ids: int
    num_slots: int
    hidden: int
    inter: int
    capacity: int


GATHER_SHAPES = [GatherShape(6, 4, 10, 3, 5), GatherShape(10, 7, 4, 8, 16),
                 GatherShape(20, 14, 4, 8, 16),  # more misses than gather_missing.SPLIT
                 GatherShape(3, 3, 64, 40, 32)]  # the last needs two blocks per expert


def random_gather(shape: GatherShape, gen: torch.Generator):
    """Host banks [N, 2I, H], [N, H, I], slot pools, and a plan of distinct slots, padded -1."""
    num_ids, num_slots, hidden, inter, capacity = shape
    host_w13 = torch.randn(num_ids, 2 * inter, hidden, generator=gen)
    host_w2 = torch.randn(num_ids, hidden, inter, generator=gen)
    slot_w13 = torch.randn(num_slots, 2 * inter, hidden, generator=gen)
    slot_w2 = torch.randn(num_slots, hidden, inter, generator=gen)
    count = int(torch.randint(0, min(capacity, num_slots) + 1, (1,), generator=gen))
    src = torch.full((capacity,), -1, dtype=torch.int32)
    dst = torch.full((capacity,), -1, dtype=torch.int32)
    src[:count] = torch.randint(num_ids, (count,), generator=gen).int()
    dst[:count] = torch.randperm(num_slots, generator=gen)[:count].int()
    return (src, dst, torch.tensor([count], dtype=torch.int32)), (host_w13, host_w2), (slot_w13, slot_w2)


def run_gather(shape: GatherShape, seed: int, device: str, backend: str | None, guard=contextlib.nullcontext,
               programs: int = 0) -> None:
    plan, host, slots = random_gather(shape, torch.Generator().manual_seed(seed))
    want = [t.clone() for t in slots]
    got = [t.to(device) for t in slots]
    gather_mod.gather_missing(*plan, *host, *want, backend="eager")
    dev_host = host if device == "cpu" else [t.pin_memory() for t in host]  # zero-copy from pinned memory
    dev_plan = [t.to(device) for t in plan]
    with guard():
        gather_mod.gather_missing(*dev_plan, *dev_host, *got, backend=backend, programs=programs)
    for a, b in zip(got, want):
        assert torch.equal(a.cpu(), b)


@interpreted
@pytest.mark.parametrize("programs", [0, 1, 3])
@pytest.mark.parametrize("shape", GATHER_SHAPES, ids=str)
def test_gather_missing_interpreted(shape, programs):
    """The wide grid, and the few programs that deal the steps among them (one program, and three,
    fewer than some plans' rows and steps)."""
    for trial in range(TRIALS):
        run_gather(shape, trial, "cpu", "triton", programs=programs)


def scale_banks(count: int, num_ids: int, gen: torch.Generator) -> list[torch.Tensor]:
    """Banks of several item sizes and shapes, as quantized experts carry them: e4m3 block scales,
    float32 channel scales, uint8 e8m0 exponents, one bank longer than a block."""
    shapes = [(3, 5), (7, 1), (2, 3000), (4, 9)][:count]
    dtypes = [torch.float8_e4m3fn, torch.float32, torch.uint8, torch.bfloat16][:count]
    return [torch.randn(num_ids, *shape, generator=gen).to(dtype) if dtype != torch.uint8
            else torch.randint(0, 255, (num_ids, *shape), generator=gen, dtype=torch.uint8)
            for shape, dtype in zip(shapes, dtypes)]


@interpreted
@pytest.mark.parametrize("programs", [0, 2])
@pytest.mark.parametrize("num_scales", [1, 2, 4])
def test_gather_missing_moves_every_bank_in_one_launch_interpreted(num_scales, programs):
    """w13, w2 and 1, 2 or 4 scale banks of other item sizes: one launch (of the wide grid or of
    two programs), every bank's planned rows byte for byte, every other row untouched."""
    kernel = "triton.gather_missing_few_kernel" if programs else "triton.gather_missing_kernel"
    for trial in range(6):
        gen = torch.Generator().manual_seed(trial)
        plan, host, slots = random_gather(GATHER_SHAPES[trial % len(GATHER_SHAPES)], gen)
        host_scales = scale_banks(num_scales, host[0].shape[0], gen)
        slot_scales = [t[:slots[0].shape[0]].clone() for t in scale_banks(num_scales, host[0].shape[0], gen)]
        want = [t.clone() for t in (*slots, *slot_scales)]
        gather_mod.gather_missing(*plan, *host, *want[:2], backend="eager", host_scales=host_scales,
                                  slot_scales=want[2:])
        got = [t.clone() for t in (*slots, *slot_scales)]
        with count_launches() as launches:
            gather_mod.gather_missing(*plan, *host, *got[:2], backend="triton", host_scales=host_scales,
                                      slot_scales=got[2:], programs=programs)
        assert dict(launches.launches) == {kernel: 1}
        for a, b in zip(got, want):
            assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), trial


def test_gather_missing_checks():
    plan, host, slots = random_gather(GATHER_SHAPES[0], torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match="does not match"):
        gather_mod.gather_missing(*plan, host[0][:, :, :-1].contiguous(), host[1], *slots)
    with pytest.raises(ValueError, match="int32"):
        gather_mod.gather_missing(plan[0].long(), plan[1], plan[2], *host, *slots)
    with pytest.raises(ValueError, match="same experts"):
        gather_mod.gather_missing(*plan, host[0][:-1].contiguous(), host[1], *slots)
    many = scale_banks(4, host[0].shape[0], torch.Generator().manual_seed(1)) * 2
    with pytest.raises(ValueError, match="at most 4"):
        gather_mod.gather_missing(*plan, *host, *slots, host_scales=many[:5], slot_scales=many[:5])
    with pytest.raises(ValueError, match="programs must be 0"):
        gather_mod.gather_missing(*plan, *host, *slots, programs=-1)


# ==== invalidate_slots ====

def run_invalidate(cfg: Config, seed: int, device: str, backend: str | None, guard=contextlib.nullcontext) -> None:
    gen = torch.Generator().manual_seed(seed)
    want = random_tables(cfg, gen)
    got = clone(want, device)
    start = int(torch.randint(cfg.table_slots, (1,), generator=gen))
    count = int(torch.randint(1, cfg.table_slots - start + 1, (1,), generator=gen))
    invalidate_mod.invalidate_slots(start, count, want, backend="eager")
    with guard():
        invalidate_mod.invalidate_slots(start, count, got, backend=backend)
    assert_same(got, want)
    check_consistent(want)
    assert (want.id_of_slot[start:start + count] == -1).all() and (want.score[start:start + count] == 0).all()


@interpreted
@pytest.mark.parametrize("name", ["lru-small", "lfru-offset", "odd-sizes"])
def test_invalidate_slots_interpreted(name):
    for trial in range(TRIALS):
        run_invalidate(CONFIGS[name], trial, "cpu", "triton")


def test_invalidate_slots_bounds():
    tables = empty_tables(Config(1, 256, 600, 0, 600, 1, 1, Policy(0, 0)))
    with pytest.raises(ValueError, match="outside"):
        invalidate_mod.invalidate_slots(512, 256, tables)
    with pytest.raises(ValueError, match="outside"):
        invalidate_mod.invalidate_slots(0, 0, tables)


@interpreted
@pytest.mark.parametrize("fill", FILL_MODES)
def test_offloaded_experts_interpreted(fill):
    """The kernels together behind ``OffloadedExperts`` (lookup, the GEMM and the fill in it, or the
    gather before it) match resident experts."""
    layers, experts, hidden, inter = 2, 8, 8, 4
    gen = torch.Generator().manual_seed(0)
    banks = ExpertBanks(torch.randn(layers, experts, 2 * inter, hidden, generator=gen),
                        torch.randn(layers, experts, hidden, inter, generator=gen))
    offloaded = OffloadedExperts.create(banks, experts + 2, "cpu", "lfru", backend="triton", fill=fill)
    resident = ResidentExperts(banks)
    with count_launches() as counter:
        for step in range(8):
            if step == 4:
                offloaded.cache.invalidate(0, experts)
            for layer in range(layers):
                x, weights = torch.randn(3, hidden, generator=gen), torch.rand(3, 2, generator=gen)
                ids = torch.randint(experts, (3, 2), generator=gen)
                torch.testing.assert_close(offloaded.forward(layer, x, weights, ids),
                                           resident.forward(layer, x, weights, ids))
    assert offloaded.cache.stats()["total"]["evictions"] > 0
    assert ("triton.gather_missing_few_kernel" in counter.launches) == (fill == "gather")
    assert "triton._decode_gate_up_kernel" in counter.launches


@interpreted
def test_prefetch_gathers_its_guess_on_few_programs_interpreted():
    """Cross-layer prefetch through the kernels: the guess of the next layer and each layer's own
    misses are gathered by the few-program launch (the guess's runs beside compute), and the
    outputs match resident experts."""
    layers, experts, hidden, inter = 3, 8, 8, 4
    gen = torch.Generator().manual_seed(0)
    banks = ExpertBanks(torch.randn(layers, experts, 2 * inter, hidden, generator=gen),
                        torch.randn(layers, experts, hidden, inter, generator=gen))
    offloaded = OffloadedExperts.create(banks, 2 * experts, "cpu", "lfru", backend="triton", prefetch=True,
                                        fill="gather")
    resident = ResidentExperts(banks)
    ids = [torch.randint(experts, (1, 2), generator=gen) for _ in range(layers)]
    with count_launches() as counter:
        for layer in range(layers):
            x, weights = torch.randn(1, hidden, generator=gen), torch.rand(1, 2, generator=gen)
            next_ids = ids[layer + 1] if layer + 1 < layers else None
            torch.testing.assert_close(offloaded.forward(layer, x, weights, ids[layer], next_ids=next_ids),
                                       resident.forward(layer, x, weights, ids[layer]), rtol=1e-5, atol=1e-5)
    # each layer's own lookup gathers, and each layer but the last gathers the next one's guess
    assert counter.launches["triton.gather_missing_few_kernel"] == 2 * layers - 1
    assert "triton.gather_missing_kernel" not in counter.launches
    stats = offloaded.cache.stats()
    assert stats["prefetch"]["bytes_h2d"] > 0
    assert stats["layers"][1]["misses"] == stats["layers"][2]["misses"] == 0  # the guesses were exact


@interpreted
def test_kernels_really_interpret():
    """Forcing the Triton path on the CPU must run the interpreter, not silently the twin."""
    for kernel in (lookup_mod._kernel(), gather_mod.gather_missing_kernel, invalidate_mod._kernel()):
        assert type(kernel).__name__ == "InterpretedFunction"


# ==== GPU ====

@pytest.mark.cuda
@pytest.mark.parametrize("name", CONFIGS)
def test_lookup_admit_cuda(name):
    for trial in range(TRIALS):
        run_lookups(CONFIGS[name], trial, "cuda", None, guard=sync_errors)


@pytest.mark.cuda
@pytest.mark.parametrize("max_admit", [0, 2])
@pytest.mark.parametrize("name", CONFIGS)
def test_lookup_admit_ahead_cuda(name, max_admit):
    for trial in range(TRIALS):
        run_lookups(CONFIGS[name], trial, "cuda", None, guard=sync_errors, ahead=True, max_admit=max_admit)


@pytest.mark.cuda
@pytest.mark.parametrize("programs", [0, 32])
@pytest.mark.parametrize("shape", GATHER_SHAPES, ids=str)
def test_gather_missing_cuda(shape, programs):
    for trial in range(TRIALS):
        run_gather(shape, trial, "cuda", None, guard=sync_errors, programs=programs)


@pytest.mark.cuda
@pytest.mark.parametrize("name", ["lru-small", "lfru-offset", "odd-sizes"])
def test_invalidate_slots_cuda(name):
    for trial in range(TRIALS):
        run_invalidate(CONFIGS[name], trial, "cuda", None, guard=sync_errors)


@pytest.mark.cuda
def test_cache_kernels_do_not_sync():
    cfg = CONFIGS["lfru-offset"]
    tables = clone(random_tables(cfg, torch.Generator().manual_seed(0)), "cuda")
    ids = torch.randint(cfg.experts, (cfg.tokens, cfg.top_k), device="cuda")
    host = [torch.randn(cfg.layers * cfg.experts, 6, 4).pin_memory(), torch.randn(cfg.layers * cfg.experts, 4, 3).pin_memory()]
    pools = [torch.zeros(cfg.table_slots, 6, 4, device="cuda"), torch.zeros(cfg.table_slots, 4, 3, device="cuda")]
    for checked in (False, True):  # the first round compiles
        with sync_errors(checked):
            plan, _ = lookup_mod.lookup_admit(ids, 0, cfg.experts, tables, cfg.slot_start, cfg.num_slots, cfg.policy, 1)
            gather_mod.gather_missing(*plan, *host, *pools)
            invalidate_mod.invalidate_slots(0, cfg.table_slots, tables)
    torch.cuda.synchronize()
