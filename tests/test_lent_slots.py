"""Decode in the prefill pipeline's lent slots (``--lent-slots decode``): decode admits into
``[0, 2E)`` with those slots ranked first as victims; a prefill chunk then invalidates real entries
and leaves none pointing into the buffer. Results equal resident experts either way. CPU with the
eager twins; on a GPU the same under ``set_sync_debug_mode("error")``."""
from __future__ import annotations

import contextlib

import pytest
import torch

from moe_offload.experts import ExpertBanks, ResidentExperts
from moe_offload.kernels import lookup_admit as lookup_mod
from moe_offload.kernels.lookup_admit import LowPriority, Policy
from moe_offload.offloaded import OffloadedExperts
from tests.test_cache_kernels import Config, empty_tables
from tests.test_expert_cache import assert_consistent, make_banks, skewed_routing
from tests.test_prefill_pipeline import DECODE, EXPERTS, LAYERS, PREFILL, TOP_K, lent_slots_are_empty


def points_into_lent(offloaded: OffloadedExperts) -> int:
    table, lent = offloaded.cache.tables.slot_for_id, 2 * offloaded.cache.num_experts
    return int(((table >= 0) & (table < lent)).sum())


def run_rounds(offloaded: OffloadedExperts, resident: ResidentExperts, device: str, guard, rounds: int = 3,
               hidden: int = 16) -> list[int]:
    """Decode steps, then a prefill chunk, per round; returns the entries in the lent range before
    each chunk, and checks that each chunk leaves none. Activations take the experts' dtype (the
    grouped GEMM refuses bf16 banks under fp32 activations)."""
    gen = torch.Generator().manual_seed(0)
    dtype = offloaded.cache.w13.dtype
    bias = torch.randn(LAYERS, EXPERTS, generator=gen)  # mild skew: decode misses often
    before = []
    for _ in range(rounds):
        for tokens in (DECODE,) * 6 + (PREFILL,):
            if tokens == PREFILL:
                before.append(points_into_lent(offloaded))
            inputs = [(torch.randn(tokens, hidden, generator=gen).to(device, dtype),
                       *skewed_routing(gen, tokens, EXPERTS, TOP_K, bias[layer], device)) for layer in range(LAYERS)]
            with guard():
                outs = [offloaded.forward(layer, *inputs[layer]) for layer in range(LAYERS)]
            for layer, out in enumerate(outs):
                torch.testing.assert_close(out.float(), resident.forward(layer, *inputs[layer]).float(),
                                           rtol=2e-2, atol=2e-2)
        assert lent_slots_are_empty(offloaded.cache)
        assert_consistent(offloaded.cache)
    return before


def test_decode_uses_lent_slots_and_a_prefill_clears_them():
    banks = make_banks(LAYERS, EXPERTS, 16, 8)
    resident = ResidentExperts(banks)
    decode = OffloadedExperts.create(banks, 3 * EXPERTS, "cpu", "lfru", pipeline=True, lent_slots="decode")
    assert all(n > 0 for n in run_rounds(decode, resident, "cpu", contextlib.nullcontext))
    reserve = OffloadedExperts.create(banks, 3 * EXPERTS, "cpu", "lfru", pipeline=True, lent_slots="reserve")
    assert run_rounds(reserve, resident, "cpu", contextlib.nullcontext) == [0, 0, 0]


def test_lent_slot_rule_is_checked():
    with pytest.raises(ValueError, match="lent-slot rule"):
        OffloadedExperts.create(make_banks(2, 4, 8, 4), 12, "cpu", pipeline=True, lent_slots="share")


def test_low_priority_slots_go_first_unless_much_older():
    """Slots [0, 2) rank 5 launches older than they are: slot 2 (idle 9 launches) goes first, then
    slot 0 (idle 2, ranked 7) before slot 3 (idle 6), which would go first without the penalty."""
    cfg = Config(1, 8, 4, 0, 4, 2, 1, Policy(0, 0))
    tables = empty_tables(cfg)
    for slot, last in enumerate([8, 8, 1, 4]):  # step 10: slot 2 used 9 launches ago, slot 3 six ago
        tables.id_of_slot[slot], tables.slot_for_id[slot] = slot, slot
        tables.last_use[slot] = tables.score[slot] = last
    tables.step.fill_(10)
    plan, _ = lookup_mod.lookup_admit(torch.tensor([[5], [6]]), 0, 8, tables, 0, 4, cfg.policy, 1, backend="eager",
                                      low=LowPriority(2, 5))
    assert plan.dst_slot.tolist() == [2, 0]  # slots 0 and 1 tie; the lower slot goes first
    with pytest.raises(ValueError, match="end"):
        lookup_mod.lookup_admit(torch.tensor([[5]]), 0, 8, empty_tables(cfg), 0, 4, cfg.policy, 1,
                                low=LowPriority(5, 1))


@pytest.mark.cuda
def test_cuda_decode_in_lent_slots_then_prefill_without_sync():
    from tests.test_prefill_pipeline import sync_errors

    banks = make_banks(LAYERS, EXPERTS, 64, 32)
    banks = ExpertBanks(banks.w13.bfloat16(), banks.w2.bfloat16())
    host = ExpertBanks(banks.w13.pin_memory(), banks.w2.pin_memory())
    offloaded = OffloadedExperts.create(host, 3 * EXPERTS, "cuda", pipeline=True, lent_slots="decode")
    resident = ResidentExperts(ExpertBanks(banks.w13.cuda(), banks.w2.cuda()))
    run_rounds(offloaded, resident, "cuda", contextlib.nullcontext, rounds=1, hidden=64)  # compiles the kernels
    assert all(n > 0 for n in run_rounds(offloaded, resident, "cuda", sync_errors, hidden=64))
