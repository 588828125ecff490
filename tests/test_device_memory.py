"""--gpu-memory-limit: the engine sizes the expert cache, the KV pool and the prefill chunk as if the
card had only the limit (the memory plan under it: tests/test_memory_plan.py), and caps torch's
allocator there. On CPU against a simulated H200; the real allocator's peak is checked by the cuda
test at the end."""
from __future__ import annotations

import pytest
import torch

from worker.device_memory import GIB, DeviceMemory
from worker.expert_placement import ExpertOptions
from worker.runner import ModelRunner, RunnerConfig

from tests.fresh_process import run_fresh

CUDA = torch.device("cuda")


class FakeCard:
    """torch.cuda's memory queries for one card with ``total`` bytes; ``reserve`` models an allocation."""

    def __init__(self, monkeypatch, total: int, reserved: int):
        self.total, self.reserved, self.fraction = total, reserved, None
        monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (self.total - self.reserved, self.total))
        monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: self.reserved)
        monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: self.reserved - GIB // 2)
        monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device=None: type("P", (), {"total_memory": total}))
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "fake H200")
        monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction", lambda f, device=None: setattr(self, "fraction", f))

    def reserve(self, nbytes: int) -> None:
        self.reserved += nbytes


@pytest.fixture
def card(monkeypatch):
    return FakeCard(monkeypatch, total=140 * GIB, reserved=3 * GIB)  # 3 GiB of dense weights loaded


def test_free_is_the_limit_less_what_torch_reserved(card):
    assert DeviceMemory.of(CUDA, None).free() == 137 * GIB
    assert DeviceMemory.of(CUDA, 32).free() == 29 * GIB
    assert DeviceMemory.of(CUDA, 32).reusable() == GIB // 2
    card.reserve(135 * GIB)  # the card itself is fuller than the limit would allow
    assert DeviceMemory.of(CUDA, 200).free() == 2 * GIB
    card.reserve(2 * GIB)
    assert DeviceMemory.of(CUDA, 32).free() == 0


def test_cap_sets_the_allocator_fraction_and_refuses_more_than_the_card(card):
    DeviceMemory.of(CUDA, 32).cap()
    assert card.fraction == pytest.approx(32 / 140)
    with pytest.raises(ValueError, match="more than the 140.0 GiB"):
        DeviceMemory.of(CUDA, 141).cap()
    DeviceMemory.of(CUDA, None).cap()
    assert card.fraction == pytest.approx(32 / 140)  # no limit: untouched


@pytest.mark.parametrize("limit, device", [(0, CUDA), (-1, CUDA), (16, torch.device("cpu"))])
def test_bad_limits_are_refused(limit, device):
    with pytest.raises(ValueError, match="--gpu-memory-limit"):
        DeviceMemory.of(device, limit)


@pytest.mark.cuda
def test_the_allocator_stays_under_a_small_limit():
    """A real runner sized from free memory (expert cache auto, KV pool auto, prefill chunk auto)
    under a 4 GiB limit: torch's peak stays under it, and an allocation past it is refused. Without
    the limit the KV pool alone would take 80% of the card. In a fresh process (tests/fresh_process.py),
    with the card's free memory read as the whole card: the GPU suite's other workers hold some of it
    at any moment, and the plan is to be the limit's, not theirs (the limit binding is what this test
    is about)."""
    run_fresh("tests.test_device_memory:allocator_under_a_small_limit")


def allocator_under_a_small_limit() -> None:
    from scheduler.generate import generate
    from scheduler.messages.to_scheduler import SamplingParams

    limit = 4
    total = torch.cuda.mem_get_info()[1]
    assert total > 4 * limit * GIB, "a card the limit makes a difference on"
    torch.cuda.mem_get_info = lambda device=None: (total, total)  # this process only
    runner = ModelRunner(RunnerConfig("small-geometry", device="cuda", gpu_memory_limit=limit,
                                      experts=ExpertOptions(cache_auto=True, dummy_weights=True,
                                                            kv_reserve_tokens=4096)))
    pool = runner.kv_pool.capacity * runner.kv_pool.page_bytes
    assert pool > GIB, f"a KV pool of {pool} bytes: sized from the limit, not fixed"
    generate(runner, [10 + i % 500 for i in range(4990)], SamplingParams(), 16)  # vocab 512
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_reserved()
    assert 0 < peak <= limit * GIB, f"peak reserved {peak} bytes under a {limit} GiB limit"
    with pytest.raises(torch.cuda.OutOfMemoryError):
        torch.empty(limit * GIB, dtype=torch.uint8, device="cuda")


def test_offline_generate_refuses_ids_outside_the_vocabulary():
    """On a GPU an out-of-vocabulary id is a device-side assert that poisons the context; the
    offline entry point refuses it on the host (the served path refuses it in the scheduler)."""
    from scheduler.generate import generate
    from scheduler.messages.to_scheduler import SamplingParams

    runner = ModelRunner(RunnerConfig("tiny-geometry", device="cpu", dtype="float32", page_size=4, kv_tokens=64,
                                      experts=ExpertOptions(dummy_weights=True)))
    vocab = runner.model_config.vocab_size
    for bad in ([1, vocab], [-1, 2]):
        with pytest.raises(ValueError, match="token ids must lie in"):
            generate(runner, bad, SamplingParams(), 2)
    assert runner.kv_pool.num_free == runner.kv_pool.capacity  # nothing allocated before the refusal


def test_a_fresh_process_body_fails_its_caller():
    """tests/fresh_process.py: a body that returns passes, one that dies fails the caller with its output."""
    run_fresh("os:getpid")
    with pytest.raises(AssertionError, match="os:abort failed in a fresh process"):
        run_fresh("os:abort")
