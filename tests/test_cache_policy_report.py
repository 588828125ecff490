"""scripts/cache_policy_report.py: Belady's MIN gives the known optimum (a textbook trace, and
exhaustive search over small traces of multi-expert lookups), the engine's lru is textbook LRU, a
trace's pipelined steps are chunks, the lanes reference reads the router's lanes and evicts the
expert no lane will hold, and the report's rows."""
from __future__ import annotations

import functools
import itertools
import json
from collections import OrderedDict

import pytest
import torch

from moe_offload.routing_trace import RoutingTrace
from moe_offload.synthetic_routing import synthetic_trace
from scripts.cache_policy_report import (LANES_LOOKAHEAD, engine_hit_rate, lane_use_probability, lanes_hit_rate, main,
                                         min_hit_rate, synthetic_lane_use, synthetic_steps, trace_steps)


def single(sequence: list[int]) -> list:
    """One layer, one expert per lookup."""
    return [[torch.tensor([x])] for x in sequence]


def test_min_on_the_textbook_trace():
    # 1 2 3 4 1 2 5 1 2 3 4 5 with 3 frames: the optimum faults 7 times (Belady 1966; Silberschatz)
    assert min_hit_rate(single([1, 2, 3, 4, 1, 2, 5, 1, 2, 3, 4, 5]), 8, 3) == pytest.approx(5 / 12)
    assert min_hit_rate(single([1, 2, 3, 1, 2, 3]), 8, 3) == pytest.approx(3 / 6)


def brute_force_hits(requests: list[frozenset[int]], slots: int) -> int:
    """Most hits over every admissible eviction choice (every miss admitted, none of the lookup's
    own experts evicted)."""
    @functools.cache
    def best(r: int, cache: frozenset[int]) -> int:
        if r == len(requests):
            return 0
        request = requests[r]
        hits, missing = len(request & cache), request - cache
        overflow = len(cache) + len(missing) - slots
        choices = [frozenset()] if overflow <= 0 else map(frozenset, itertools.combinations(cache - request, overflow))
        return hits + max(best(r + 1, (cache - out) | missing) for out in choices)

    return best(0, frozenset())


@pytest.mark.parametrize("seed", range(12))
def test_min_equals_exhaustive_search(seed):
    gen = torch.Generator().manual_seed(seed)
    layers, experts, slots = 2, 4, 3 + seed % 2
    steps = [[torch.unique(torch.randint(experts, (int(torch.randint(1, 3, (1,), generator=gen)),), generator=gen))
              for _ in range(layers)] for _ in range(7)]
    requests = [frozenset(layer * experts + int(e) for e in ids) for step in steps for layer, ids in enumerate(step)]
    lookups = sum(len(r) for r in requests)
    assert min_hit_rate(steps, experts, slots) == pytest.approx(brute_force_hits(requests, slots) / lookups)


def test_engine_lru_is_textbook_lru():
    gen = torch.Generator().manual_seed(0)
    sequence = torch.randint(0, 12, (200,), generator=gen).tolist()
    cache, hits = OrderedDict(), 0
    for x in sequence:
        hits += x in cache
        cache[x] = None
        cache.move_to_end(x)
        if len(cache) > 5:
            cache.popitem(last=False)
    assert engine_hit_rate(single(sequence), 1, 12, 5, "lru") == pytest.approx(hits / len(sequence))


def test_lfru_replayed_with_a_credit_of_one_step_and_no_bank_is_lru():
    """``--lfru-credit 4 --lfru-cap 1`` (one layer): every use scores its step plus one, as LRU does;
    the engine's own lfru banks credit and hits differently on the same sequence."""
    gen = torch.Generator().manual_seed(0)
    hot = torch.randint(0, 4, (200,), generator=gen)
    sequence = torch.where(torch.rand(200, generator=gen) < 0.5, hot, torch.randint(4, 40, (200,), generator=gen))
    steps = single(sequence.tolist())
    lru = engine_hit_rate(steps, 1, 40, 5, "lru")
    assert engine_hit_rate(steps, 1, 40, 5, "lfru", lfru=dict(credit_quarter_steps=4, cap_steps=1)) == lru
    assert engine_hit_rate(steps, 1, 40, 5, "lfru") != lru


def test_pipelined_steps_of_a_trace_are_chunks():
    # a 12-token step routes 12 * 2 >= 4 * 4 pairs (the pipeline); 1-token steps look up
    step = torch.tensor([0] + [1] * 12 + [2])
    ids = torch.randint(0, 4, (14, 3, 2))
    trace = RoutingTrace(4, step, torch.ones(14, dtype=torch.long), torch.arange(14), ids, torch.ones(14, 3, 2))
    steps = trace_steps(trace)
    assert steps[1] is None and len(steps) == 3
    assert [torch.equal(a, ids[13, layer]) for layer, a in enumerate(steps[2])] == [True] * 3  # repeats kept


def test_lane_use_probability_by_hand():
    # W = 4 lanes, k = 2 picked: an expert on one lane is missed with C(3, 2) / C(4, 2) = 1/2, on
    # two with 1/6, on three never; on one lane in each of two sequences, with 1/2 * 1/2
    lanes = torch.tensor([[0, 1, 1, 2], [0, 3, 3, 3]]).view(1, 2, 1, 4)
    assert lane_use_probability(lanes, 2, 5)[0, 0].tolist() == pytest.approx([3 / 4, 5 / 6, 1 / 2, 1, 0])


def test_lane_use_probability_matches_the_synthetic_router():
    layers, experts, top_k, batch, steps = 4, 32, 4, 2, 64
    ids = synthetic_trace(layers, experts, top_k, batch, steps)  # [L, N, T, k]
    used = torch.zeros(layers, steps, experts)
    for s in range(batch):
        used.scatter_(2, ids[:, s], 1.0)
    use = synthetic_lane_use(layers, experts, top_k, batch, steps).permute(1, 0, 2)  # [L, T, E]
    likely, unlikely = use > 0.3, use < 0.05
    assert float(used[likely].mean()) == pytest.approx(float(use[likely].mean()), abs=0.05)
    assert float(used[unlikely].mean()) < 0.05


@pytest.mark.parametrize("kept", [0, 1])
@pytest.mark.parametrize("lane_moves_on", [3, 0], ids=["lane-expires", "no-lane"])
def test_lanes_evicts_the_expert_no_lane_will_hold(kept, lane_moves_on):
    """One layer, 2 slots, top 1 of 2 lanes: ``kept`` sits on a lane throughout; the other expert's
    lane moves on to expert 3 at position 3 (or no lane ever holds it). Lookup 2 (expert 2) must
    evict, and the next lookup is at position 3: only ``kept`` can be used there, so it stays."""
    positions = 4 + 1 + LANES_LOOKAHEAD
    moving = [1 - kept] * lane_moves_on + [3] * (positions - lane_moves_on)
    use = lane_use_probability(torch.tensor([moving, [kept] * positions]).T.reshape(1, 1, positions, 2), 1, 4)
    assert lanes_hit_rate(single([0, 1, 2, kept]), use, 2) == pytest.approx(1 / 4)
    assert lanes_hit_rate(single([0, 1, 2, 1 - kept]), use, 2) == 0


@pytest.mark.parametrize("batch", [1, 2])
def test_lanes_beats_the_engine_and_never_min(batch):
    layers, experts, top_k, steps, slots = 8, 32, 4, 64, 64  # a 25% cache
    routed = synthetic_steps(layers, experts, top_k, batch, steps)
    lanes = lanes_hit_rate(routed, synthetic_lane_use(layers, experts, top_k, batch, steps + 1 + LANES_LOOKAHEAD),
                           slots)
    engine = max(engine_hit_rate(routed, layers, experts, slots, policy) for policy in ("lru", "lfru"))
    assert engine + 0.03 < lanes <= min_hit_rate(routed, experts, slots)  # MIN is optimal for every online policy


def test_report_rows(tmp_path, capsys):
    out = tmp_path / "rows.json"
    main(["--layers", "4", "--experts", "16", "--top-k", "2", "--steps", "40", "--batch", "2",
          "--fractions", "0.25", "0.5", "--json", str(out)])
    rows = json.loads(out.read_text())
    assert [(r["cache"], r["policy"]) for r in rows] == [(f, p) for f in (0.25, 0.5)
                                                         for p in ("lru", "lfru", "min", "lanes")]
    for fraction in (0.25, 0.5):
        rate = {r["policy"]: r["hit_rate"] for r in rows if r["cache"] == fraction}
        assert 0 < rate["lru"] <= rate["min"] and 0 < rate["lfru"] <= rate["min"] < 1  # MIN is the optimum
        assert 0 < rate["lanes"] <= rate["min"]
    out = capsys.readouterr().out
    assert "lfru/min" in out and "lanes/min" in out


def test_report_rows_of_a_trace_have_no_lanes(tmp_path, capsys):
    ids = torch.randint(0, 4, (20, 3, 2), generator=torch.Generator().manual_seed(0))
    trace = RoutingTrace(4, torch.arange(20), torch.ones(20, dtype=torch.long), torch.arange(20), ids,
                         torch.ones(20, 3, 2))
    trace.save(str(tmp_path / "trace.pt"))
    main(["--trace", str(tmp_path / "trace.pt"), "--fractions", "0.5", "--json", str(tmp_path / "rows.json")])
    assert [r["policy"] for r in json.loads((tmp_path / "rows.json").read_text())] == ["lru", "lfru", "min"]
    assert "lanes" not in capsys.readouterr().out
