"""The GPU expert cache behind ``OffloadedExperts``: same outputs as resident experts, policy
behaviour (LRU vs LFRU), statistics, lent slots and sizing. CPU with the eager twins; on a GPU a
sync-free decode step and a CUDA-graph replay with changing routing."""
from __future__ import annotations

import math

import pytest
import torch

from moe_offload.expert_cache import ExpertCache
from moe_offload.experts import ExpertBanks, ResidentExperts
from moe_offload.grouped import grouped_swiglu
from moe_offload.offloaded import OffloadedExperts
from moe_offload.routing import route
from worker.memory_plan import expert_slots
from worker.runner_config import ExpertOptions


def make_banks(layers: int, experts: int, hidden: int, inter: int, seed: int = 0) -> ExpertBanks:
    gen = torch.Generator().manual_seed(seed)
    w13 = torch.randn(layers, experts, 2 * inter, hidden, generator=gen) / math.sqrt(hidden)
    w2 = torch.randn(layers, experts, hidden, inter, generator=gen) / math.sqrt(inter)
    return ExpertBanks(w13, w2)


def skewed_routing(gen: torch.Generator, tokens: int, experts: int, top_k: int, bias: torch.Tensor, device="cpu"):
    """Router logits with a fixed per-layer preference, so some experts recur and hit."""
    logits = torch.randn(tokens, experts, generator=gen) + bias
    weights, ids = route(logits, top_k, renormalize=True)
    return weights.to(device), ids.to(device)


def assert_consistent(cache: ExpertCache) -> None:
    tables = cache.tables
    resident = torch.nonzero(tables.slot_for_id >= 0).squeeze(-1)
    assert torch.equal(tables.id_of_slot[tables.slot_for_id[resident].long()].long(), resident)
    assert int((tables.id_of_slot >= 0).sum()) == resident.numel()


def assert_stats_consistent(cache: ExpertCache) -> dict:
    stats = cache.stats()
    for row in [*stats["layers"], stats["total"]]:
        assert row["hits"] + row["misses"] == row["lookups"]
        assert row["bytes_h2d"] == row["misses"] * cache.slot_bytes
        assert row["evictions"] <= row["misses"]
    return stats


# ==== parity with resident experts ====

STEPS = 25


@pytest.mark.parametrize("policy", ["lru", "lfru"])
def test_offloaded_matches_resident(policy):
    layers, experts, hidden, inter, top_k = 4, 8, 16, 8, 2
    banks = make_banks(layers, experts, hidden, inter)
    slot_bytes = (banks.w13[0, 0].nbytes + banks.w2[0, 0].nbytes)
    num_slots = expert_slots(ExpertOptions(cache_fraction=0.25), layers * experts, slot_bytes, None)
    assert num_slots == 8
    offloaded = OffloadedExperts.create(banks, num_slots, "cpu", policy)
    resident = ResidentExperts(banks)
    gen = torch.Generator().manual_seed(1)
    bias = 2 * torch.randn(layers, experts, generator=gen)
    for _ in range(STEPS):
        tokens = int(torch.randint(1, 5, (1,), generator=gen))
        for layer in range(layers):
            x = torch.randn(tokens, hidden, generator=gen)
            weights, ids = skewed_routing(gen, tokens, experts, top_k, bias[layer])
            torch.testing.assert_close(offloaded.forward(layer, x, weights, ids),
                                       resident.forward(layer, x, weights, ids), rtol=1e-5, atol=1e-5)
    assert_consistent(offloaded.cache)
    total = assert_stats_consistent(offloaded.cache)["total"]
    assert total["hits"] > 0 and total["evictions"] > 0 and offloaded.cache.tables.step.item() == 1 + STEPS * layers


def test_offloaded_rejects_mismatched_cache():
    banks = make_banks(2, 4, 8, 4)
    with pytest.raises(ValueError, match="experts"):
        OffloadedExperts(banks, ExpertCache.for_banks(make_banks(3, 4, 8, 4), 4, "cpu"))


def test_cache_smaller_than_one_step_raises():
    cache = ExpertCache(1, 8, (4, 4), (4, 2), num_slots=4, dtype=torch.float32, device="cpu")
    with pytest.raises(ValueError, match="distinct"):
        cache.lookup(0, torch.zeros(8, 2, dtype=torch.int64))


# ==== policies ====

def lookup(cache: ExpertCache, experts: list[int], layer: int = 0):
    plan, slots = cache.lookup(layer, torch.tensor([experts]))
    return int(plan.count[0]), slots


def resident_ids(cache: ExpertCache) -> set[int]:
    return set(torch.nonzero(cache.tables.slot_for_id >= 0).squeeze(-1).tolist())


@pytest.mark.parametrize("policy", ["lru", "lfru"])
def test_evicts_least_recent_among_equals(policy):
    """Experts used once each: both policies evict the oldest."""
    cache = ExpertCache(1, 32, (2, 2), (2, 1), num_slots=4, dtype=torch.float32, device="cpu", policy=policy)
    for expert in range(4):
        lookup(cache, [expert])
    lookup(cache, [0])  # 0 is now the newest
    assert lookup(cache, [8])[0] == 1
    assert resident_ids(cache) == {0, 2, 3, 8}
    lookup(cache, [9])
    assert resident_ids(cache) == {0, 3, 8, 9}


def run_burst(policy: str, burst_steps: int) -> int:
    """Four layers, 8 slots each: a hot set of 4 experts a layer used for ten steps, ``burst_steps``
    steps of one-off experts, then the hot set again; returns the misses of that last step."""
    layers = 4
    cache = ExpertCache(layers, 32, (2, 2), (2, 1), num_slots=8 * layers, dtype=torch.float32, device="cpu",
                        policy=policy)
    hot = [0, 1, 2, 3]
    for _ in range(10):
        for layer in range(layers):
            lookup(cache, hot, layer)
    for step in range(burst_steps):
        for layer in range(layers):
            lookup(cache, [4 + 4 * step + i for i in range(4)], layer)
    misses = sum(lookup(cache, hot, layer)[0] for layer in range(layers))
    assert_stats_consistent(cache)
    return misses


def test_lfru_keeps_hot_set_through_burst():
    """Ten steps of use bank 10 x 1/4 step of credit over one-off experts: a 2-step burst (which
    fills the 8 slots of a layer) leaves the hot set; LRU gives it up."""
    assert run_burst("lfru", burst_steps=2) == 0
    assert run_burst("lru", burst_steps=2) == 4 * 4


def test_a_burst_longer_than_the_banked_credit_takes_the_hot_set():
    assert run_burst("lfru", burst_steps=4) == 4 * 4


# ==== lent slots, stats, sizing ====

def test_lent_slots_are_invalidated_and_avoided():
    layers, experts = 2, 4
    banks = make_banks(layers, experts, 8, 4)
    offloaded = OffloadedExperts.create(banks, 2 * experts + 4, "cpu")
    cache, resident = offloaded.cache, ResidentExperts(banks)
    gen = torch.Generator().manual_seed(0)
    for _ in range(6):
        for layer in range(layers):
            x = torch.randn(3, 8, generator=gen)
            weights, ids = skewed_routing(gen, 3, experts, 2, torch.zeros(experts))
            offloaded.forward(layer, x, weights, ids)
    held = cache.tables.id_of_slot[:2 * experts].clone()
    assert (held >= 0).any()
    cache.invalidate(0, 2 * experts)
    assert (cache.tables.id_of_slot[:2 * experts] == -1).all()
    assert (cache.tables.slot_for_id[held[held >= 0].long()] == -1).all()
    assert_consistent(cache)
    for _ in range(4):  # the prefill pipeline owns [0, 2E): decode-side lookups stay above it
        for layer in range(layers):
            ids = torch.randint(experts, (3, 2), generator=gen)
            plan, slots = cache.lookup(layer, ids, slot_start=2 * experts)
            cache.fill(plan, offloaded.host_w13, offloaded.host_w2)
            assert (slots >= 2 * experts).all()
            x, weights = torch.randn(3, 8, generator=gen), torch.rand(3, 2, generator=gen)
            torch.testing.assert_close(grouped_swiglu(x, weights, slots, cache.w13, cache.w2),
                                       resident.forward(layer, x, weights, ids))
    assert_stats_consistent(cache)
    cache.reset_stats()
    assert cache.stats()["total"]["lookups"] == 0


# ==== GPU ====

def cuda_setup(layers=4, experts=16, hidden=128, inter=64):
    banks = make_banks(layers, experts, hidden, inter)
    banks = ExpertBanks(banks.w13.bfloat16(), banks.w2.bfloat16())
    host = ExpertBanks(banks.w13.pin_memory(), banks.w2.pin_memory())
    device = ExpertBanks(banks.w13.cuda(), banks.w2.cuda())
    num_slots = expert_slots(ExpertOptions(cache_fraction=0.25), layers * experts, 1, None)  # = E: one step's least
    return OffloadedExperts.create(host, num_slots, "cuda"), ResidentExperts(device)


@pytest.mark.cuda
def test_decode_step_without_sync():
    offloaded, resident = cuda_setup()
    layers, experts, hidden = 4, 16, 128
    gen = torch.Generator().manual_seed(0)
    bias = torch.randn(layers, experts, generator=gen)
    for checked in (False, True, True):  # the first step compiles the kernels
        inputs = [(torch.randn(8, hidden, generator=gen).bfloat16().cuda(),
                   *skewed_routing(gen, 8, experts, 4, bias[layer], "cuda")) for layer in range(layers)]
        torch.cuda.set_sync_debug_mode("error" if checked else "default")
        try:
            outs = [offloaded.forward(layer, *inputs[layer]) for layer in range(layers)]
        finally:
            torch.cuda.set_sync_debug_mode("default")
        for layer in range(layers):
            torch.testing.assert_close(outs[layer], resident.forward(layer, *inputs[layer]), rtol=2e-2, atol=2e-2)
    assert_stats_consistent(offloaded.cache)


@pytest.mark.cuda
def test_cuda_graph_replay_with_changing_routing(capture_graph):
    offloaded, resident = cuda_setup()
    layers, experts, hidden, tokens, top_k = 4, 16, 128, 8, 4
    x = torch.zeros(tokens, hidden, dtype=torch.bfloat16, device="cuda")
    weights = torch.full((layers, tokens, top_k), 1.0 / top_k, device="cuda")
    ids = torch.arange(top_k, device="cuda").repeat(layers, tokens, 1)
    graph, outs = capture_graph(lambda: [offloaded.forward(layer, x, weights[layer], ids[layer])
                                         for layer in range(layers)])
    gen = torch.Generator().manual_seed(0)
    for _ in range(12):
        x.copy_(torch.randn(tokens, hidden, generator=gen).bfloat16())
        for layer in range(layers):
            new_weights, new_ids = skewed_routing(gen, tokens, experts, top_k, torch.zeros(experts))
            weights[layer].copy_(new_weights)
            ids[layer].copy_(new_ids)
        graph.replay()
        for layer in range(layers):
            torch.testing.assert_close(outs[layer], resident.forward(layer, x, weights[layer], ids[layer]),
                                       rtol=2e-2, atol=2e-2)
    stats = assert_stats_consistent(offloaded.cache)
    assert stats["total"]["misses"] > 0 and stats["total"]["hits"] > 0
