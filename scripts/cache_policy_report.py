"""Expert-cache hit rates of the engine's policies against Belady's offline optimum (MIN).

    python scripts/cache_policy_report.py [--trace FILE] [--fractions 0.1 0.25 0.5] [--json OUT]
        [--batch 1] [--steps 256] [--layers 48 --experts 128 --top-k 8]   (synthetic, without --trace: adds lanes)
        [--lent-slots none|reserve|decode] [--prefill-every N] [--lfru-credit Q --lfru-pair-credit Q --lfru-cap STEPS]

Replays the decode lookups of a routing trace (``--record-routing``; steps big enough for the
prefill pipeline are chunks, which do not look up) or, without one, of the synthetic router
(``--batch`` sequences decoding ``--steps`` tokens), one lookup per layer per step, as the engine
does. lru and lfru run the engine's own code: ``ExpertCache.lookup`` (the ``lookup_admit`` eager
twin, the kernel's parity oracle) on CPU tables. MIN evicts the expert used farthest in the future
among those the step's layer does not use, and admits every miss (as the engine must).
With synthetic routing, lanes is a reference between them: a policy that knows the router's
hidden lane state (which expert each lane holds at every position, the lanes' next draws included)
but not which lanes a token will pick, so the gap from lanes to MIN is what seeing the picks is
worth, and the gap from lfru to lanes what the lane state is. The engine cannot run it: a model
has no lanes, and its routing history does not show them.

``--lent-slots`` models a prefill pipeline lending ``2E`` slots: reserve (decode never uses them),
decode (decode uses them as first victims); each chunk (a trace's, or one every ``--prefill-every``
synthetic steps) wipes them. MIN and lanes always have the whole cache: MIN is the bound either way.
``--lfru-credit`` / ``--lfru-pair-credit`` / ``--lfru-cap`` replay lfru with other parameters than the
engine's. A lookup holds every routed (token, choice) pair, repeats included: lfru credits an expert
by how many pairs chose it.
"""
from __future__ import annotations

import argparse
import heapq
import json
import math
from pathlib import Path

import torch

from moe_offload.choices import LENT_SLOT_RULES
from moe_offload.expert_cache import (LFRU_CAP_STEPS, LFRU_CREDIT_QUARTER_STEPS, LFRU_PAIR_CREDIT_QUARTER_STEPS,
                                     ExpertCache, policy_for)
from moe_offload.offloaded import PIPELINE_PAIRS_PER_EXPERT, decode_slots
from moe_offload.routing_trace import RoutingTrace
from moe_offload.synthetic_routing import DRAW_BITS, SyntheticRouter, TokenKeys, synthetic_trace

POLICIES = ("lru", "lfru", "min")
LANES_LOOKAHEAD = 64  # positions: the farthest the lanes reference looks
Steps = list  # per step: a list of L tensors (each layer's routed experts, repeats kept), or None for a prefill chunk


def synthetic_steps(layers: int, experts: int, top_k: int, batch: int, steps: int, seed: int = 0,
                    prefill_every: int = 0) -> Steps:
    ids = synthetic_trace(layers, experts, top_k, batch, steps, seed)  # [L, N, T, k]
    out: Steps = []
    for t in range(steps):
        if prefill_every and t and t % prefill_every == 0:
            out.append(None)
        out.append([ids[layer, :, t].reshape(-1) for layer in range(layers)])
    return out


def trace_steps(trace: RoutingTrace) -> Steps:
    """A trace's steps; those the engine sends through the prefill pipeline become chunks (None)."""
    order = torch.argsort(trace.step, stable=True)
    counts = torch.unique_consecutive(trace.step[order], return_counts=True)[1].tolist()
    threshold = PIPELINE_PAIRS_PER_EXPERT * trace.num_experts
    return [None if rows.shape[0] * trace.top_k >= threshold else
            [rows[:, layer].reshape(-1) for layer in range(trace.num_layers)]
            for rows in torch.split(trace.ids[order], counts)]


def engine_hit_rate(steps: Steps, num_layers: int, num_experts: int, slots: int, policy: str,
                    lent_slots: str = "none", lfru: dict | None = None) -> float:
    """Hit rate of the engine's cache code over ``steps`` (CPU tables, eager twin); ``lfru``: other
    parameters of ``policy_for`` to replay (credit_quarter_steps, cap_steps)."""
    cache = ExpertCache(num_layers, num_experts, (1, 1), (1, 1), slots, torch.float32, "cpu", policy)
    if policy == "lfru" and lfru:
        cache.policy = policy_for(policy, num_layers, **lfru)
    lent = 0 if lent_slots == "none" else 2 * num_experts
    if lent and slots < 3 * num_experts:
        raise ValueError(f"a pipeline lends 2x{num_experts} slots and needs {3 * num_experts}; the cache has {slots}")
    start, low = decode_slots(lent_slots, lent, num_layers)
    for step in steps:
        if step is None:
            if lent:
                cache.invalidate(0, lent)
            continue
        for layer, ids in enumerate(step):
            cache.lookup(layer, ids.view(-1, 1), start, low=low)
    total = cache.stats()["total"]
    return total["hits"] / max(total["lookups"], 1)


def min_hit_rate(steps: Steps, num_experts: int, slots: int) -> float:
    """Belady's MIN over the lookups of ``steps`` (chunks ignored): on a miss with the cache full,
    evict the resident expert whose next use is farthest (never one of this lookup's)."""
    requests = [list(dict.fromkeys(layer * num_experts + int(e) for e in ids))  # a lookup's distinct experts
                for step in steps if step is not None for layer, ids in enumerate(step)]
    next_use, upcoming = [], {}
    for r in range(len(requests) - 1, -1, -1):  # next_use[r][i]: the next request of requests[r][i]
        next_use.append([upcoming.get(x, math.inf) for x in requests[r]])
        for x in requests[r]:
            upcoming[x] = r
    next_use.reverse()
    resident: dict[int, float] = {}  # expert -> its next use
    heap: list[tuple[float, int]] = []  # (-next use, expert), stale entries skipped
    hits = lookups = 0
    for r, request in enumerate(requests):
        now = set(request)
        for x in request:
            lookups += 1
            if x in resident:
                hits += 1
                continue
            while len(resident) >= slots:
                far, victim = heapq.heappop(heap)
                if resident.get(victim) == -far and victim not in now:  # else stale, or in use
                    del resident[victim]
            resident[x] = r
        for x, nxt in zip(request, next_use[r]):
            resident[x] = nxt
            heapq.heappush(heap, (-nxt, x))
    return hits / max(lookups, 1)


def synthetic_lane_use(layers: int, experts: int, top_k: int, batch: int, positions: int, seed: int = 0
                       ) -> torch.Tensor:
    """``lane_use_probability`` of ``synthetic_steps``' sequences at positions ``[0, positions)``."""
    router = SyntheticRouter(layers, experts, top_k, "cpu", seed)
    seq = torch.arange(1, batch + 1).repeat_interleave(positions)
    pos = torch.arange(positions).repeat(batch)
    lanes = router._lanes(slice(None), router._hashes(TokenKeys(seq, pos, torch.zeros_like(pos)))[0], pos)
    popularity = torch.diff(router.cdf, dim=1, prepend=torch.zeros_like(router.cdf[:, :1])) / (1 << DRAW_BITS)
    return lane_use_probability(lanes.view(layers, batch, positions, -1), top_k, experts, popularity)


def lane_use_probability(lanes: torch.Tensor, top_k: int, num_experts: int,
                         popularity: torch.Tensor | None = None) -> torch.Tensor:
    """``[P, L, E]``: the probability that some sequence routes to each expert at each position,
    knowing only the experts its lanes ``[L, N, P, W]`` hold. A token picks ``top_k`` of its ``W``
    lanes as if at random, so an expert on ``n`` of them is missed with probability
    ``C(W - n, k) / C(W, k)``; with ``popularity [L, E]``, the fresh draws that replace duplicate
    picks add their share."""
    L, N, P, W = lanes.shape
    counts = torch.zeros(L, N, P, num_experts, dtype=torch.long).scatter_add_(3, lanes, torch.ones_like(lanes))
    missed = torch.tensor([math.comb(W - n, top_k) / math.comb(W, top_k) for n in range(W + 1)], dtype=torch.float64)
    picked = 1 - missed[counts]
    if popularity is not None:
        duplicates = top_k - picked.sum(3, keepdim=True)  # expected: k minus the expected distinct picks
        fresh = -torch.expm1(duplicates * torch.log1p(-popularity.double()[:, None, None, :]))
        picked = picked + (1 - picked) * fresh
    return (1 - torch.prod(1 - picked, dim=1)).permute(1, 0, 2).contiguous()


def lanes_hit_rate(steps: Steps, use: torch.Tensor, slots: int) -> float:
    """The lanes reference over the lookups of ``steps`` (chunks ignored), given the use
    probabilities ``use [P, L, E]`` of the decode positions (``P > steps + LANES_LOOKAHEAD``): admit
    every miss and, with the cache full, evict the resident experts (never this lookup's) whose next
    use is expected latest, counting up to the cache's turnover time (its slots over the misses of
    the last L lookups), since a later use finds the expert evicted anyway. Fixed horizons,
    discounted uses and the chance of a use within a few positions did no better at any of the
    report's points; the turnover time needs no horizon chosen."""
    L, E = use.shape[1:]
    resident = torch.zeros(L * E, dtype=torch.bool)
    recent = [0] * L  # misses of each layer's last lookup
    held = hits = lookups = 0
    for t, step in enumerate(s for s in steps if s is not None):
        for layer, ids in enumerate(step):
            request = torch.unique(ids) + layer * E
            misses = request.numel() - int(resident[request].sum())
            hits, lookups = hits + request.numel() - misses, lookups + request.numel()
            if held + misses > slots:
                horizon = max(1, min(LANES_LOOKAHEAD, round(slots / max(sum(recent), 1))))
                wait = expected_wait(use, t, layer, horizon).flatten().masked_fill(~resident, -math.inf)
                wait[request] = -math.inf
                resident[torch.topk(wait, held + misses - slots).indices] = False
                held = slots - misses
            resident[request] = True
            held += misses
            recent[layer] = misses
    return hits / max(lookups, 1)


def expected_wait(use: torch.Tensor, t: int, layer: int, horizon: int) -> torch.Tensor:
    """``[L, E]``: the expected steps from the lookup of ``layer`` at step ``t`` to each expert's
    next use, counting ``horizon`` lookups of its layer at most, if uses at different positions
    are independent (the picks are). Layers after ``layer`` are looked up next at ``t``, the others
    at ``t + 1``."""
    L = use.shape[1]
    later = torch.arange(L) > layer
    ahead = torch.where(later[None, :, None], use[t:t + horizon], use[t + 1:t + 1 + horizon])
    first = (torch.arange(L) - layer) / L + (~later).double()  # steps to the layer's next lookup
    return first[:, None] + torch.cumprod(1 - ahead, 0).sum(0)


def report(steps: Steps, num_layers: int, num_experts: int, fractions: list[float],
           lent_slots: str = "none", lfru: dict | None = None, lane_use: torch.Tensor | None = None) -> list[dict]:
    """Rows of hit rates, and the lanes reference's with ``lane_use`` (``lanes_hit_rate``); a cache
    too small for one lookup's experts is skipped with a note."""
    rows = []
    largest = max((ids.numel() for step in steps if step is not None for ids in step), default=0)
    for fraction in fractions:
        slots = max(1, int(fraction * num_layers * num_experts))
        if slots < largest:
            print(f"cache {fraction:.0%}: {slots} slots cannot hold one lookup's {largest} experts; skipped")
            continue
        for policy in POLICIES:
            rate = (min_hit_rate(steps, num_experts, slots) if policy == "min" else
                    engine_hit_rate(steps, num_layers, num_experts, slots, policy, lent_slots, lfru))
            rows.append({"cache": fraction, "policy": policy, "hit_rate": rate})
        if lane_use is not None:
            rows.append({"cache": fraction, "policy": "lanes", "hit_rate": lanes_hit_rate(steps, lane_use, slots)})
    return rows


def print_table(rows: list[dict], title: str) -> None:
    rates = [p for p in ("lru", "lfru", "lanes", "min") if any(r["policy"] == p for r in rows)]
    ratios = [p for p in ("lfru", "lanes") if p in rates]
    print(title)
    print(f"{'cache':>6}" + "".join(f" {p:>7}" for p in rates) + "".join(f" {p + '/min':>9}" for p in ratios))
    for fraction in sorted({r["cache"] for r in rows}):
        rate = {r["policy"]: r["hit_rate"] for r in rows if r["cache"] == fraction}
        print(f"{fraction:>6.0%}" + "".join(f" {rate[p]:>7.3f}" for p in rates)
              + "".join(f" {rate[p] / rate['min'] if rate['min'] else float('nan'):>9.3f}" for p in ratios))


def workload(args: argparse.Namespace) -> tuple[int, int, list, object, str]:
    """Layers, experts, steps, lane use (synthetic only) and a title, from a trace or synthetic."""
    if args.trace:
        trace = RoutingTrace.load(args.trace)
        title = f"trace {args.trace}: {trace.num_layers} layers, {trace.num_experts} experts, top {trace.top_k}"
        return trace.num_layers, trace.num_experts, trace_steps(trace), None, title
    layers, experts = args.layers, args.experts
    steps = synthetic_steps(layers, experts, args.top_k, args.batch, args.steps, args.seed, args.prefill_every)
    lane_use = synthetic_lane_use(layers, experts, args.top_k, args.batch, args.steps + 1 + LANES_LOOKAHEAD, args.seed)
    title = (f"synthetic routing: {layers} layers, {experts} experts, top {args.top_k}, batch {args.batch}, "
             f"{args.steps} steps")
    return layers, experts, steps, lane_use, title


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--trace", help="a routing trace written by --record-routing (default: the synthetic router)")
    p.add_argument("--fractions", type=float, nargs="+", default=[0.1, 0.25, 0.5])
    p.add_argument("--batch", type=int, default=1, help="synthetic: sequences decoding together")
    p.add_argument("--steps", type=int, default=256, help="synthetic: decode steps")
    p.add_argument("--layers", type=int, default=48)
    p.add_argument("--experts", type=int, default=128)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--lent-slots", default="none", choices=["none", *LENT_SLOT_RULES],
                   help="model a prefill pipeline lending 2E slots (see --lent-slots of the engine)")
    p.add_argument("--prefill-every", type=int, default=0, help="synthetic: a prefill chunk every N steps")
    p.add_argument("--lfru-credit", type=int, default=LFRU_CREDIT_QUARTER_STEPS, metavar="QUARTER_STEPS",
                   help="lfru's credit a use, in quarter steps (default: the engine's)")
    p.add_argument("--lfru-cap", type=int, default=LFRU_CAP_STEPS, metavar="STEPS",
                   help="lfru's cap on banked credit, in steps (default: the engine's)")
    p.add_argument("--lfru-pair-credit", type=int, default=LFRU_PAIR_CREDIT_QUARTER_STEPS, metavar="QUARTER_STEPS",
                   help="lfru's credit a use for each routed pair past the first, in quarter steps "
                        "(default: the engine's)")
    p.add_argument("--json", help="write [{cache, policy, hit_rate}, ...] here")
    args = p.parse_args(argv)
    layers, experts, steps, lane_use, title = workload(args)
    chunks = sum(step is None for step in steps)
    lfru = dict(credit_quarter_steps=args.lfru_credit, cap_steps=args.lfru_cap,
                pair_credit_quarter_steps=args.lfru_pair_credit)
    rows = report(steps, layers, experts, args.fractions, args.lent_slots, lfru, lane_use)
    print_table(rows, f"{title}, {len(steps) - chunks} decode steps, {chunks} prefill chunks, "
                      f"lent slots {args.lent_slots}, lfru credit {args.lfru_credit}/4 + {args.lfru_pair_credit}/4 "
                      f"a pair past the first, cap {args.lfru_cap} steps")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
