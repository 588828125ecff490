"""A step that raises fails only the requests in it, frees their pages (none go to the prefix
cache: their KV may be half written) and the engine serves on; an error that poisons the device is
raised. In-process on a tiny model; the served path is in test_reliability.py."""
from __future__ import annotations

import pytest

from scheduler.faults import Fault, FaultHooks, poisons_device
from tests.test_engine import EOS, make_engine, model_dir, prompts, req, run  # noqa: F401 (fixture)

RAISE, CUDA = 120, 121  # first prompt tokens that make the fault hooks fire


def test_a_request_failing_in_preparation_fails_alone(model_dir):
    engine = make_engine(model_dir, max_prefill_tokens=16)
    engine.faults = FaultHooks([Fault("raise", RAISE, 0.0)])
    good = [req(f"g{i}", p, max_tokens=10, ignore_eos=True) for i, p in enumerate(prompts(3, seed=3))]
    alone = run(make_engine(model_dir, max_prefill_tokens=16), [req(r.rid, r.prompt, 10, ignore_eos=True)
                                                                  for r in good])
    bad = req("bad", [RAISE] + prompts(1, seed=4)[0], max_tokens=10)
    results = run(engine, [good[0], bad, *good[1:]])
    assert [f.rid for f in engine.take_failures()] == ["bad"]
    assert results["bad"][0] == [] and engine.counters["requests_failed"] == 1
    assert {rid: r[0] for rid, r in results.items() if rid != "bad"} == {rid: r[0] for rid, r in alone.items()}
    pool = engine.pages.pool
    assert pool.num_free + engine.pages.radix.num_pages == pool.capacity


@pytest.mark.parametrize("overlap", [True, False])
def test_a_step_that_raises_fails_its_requests_and_the_engine_serves_on(model_dir, overlap, monkeypatch):
    engine = make_engine(model_dir, overlap=overlap)
    launch = engine.runner.launch  # the engine launches a step, then samples it
    calls = {"n": 0}

    def flaky(*args, **kw):
        calls["n"] += 1
        if calls["n"] == 3:  # a decode step of both requests, with the previous step in flight
            raise IndexError("a bug in a step")
        return launch(*args, **kw)

    monkeypatch.setattr(engine.runner, "launch", flaky)
    first = [req("a", prompts(1, seed=5)[0], 20, ignore_eos=True), req("b", prompts(1, seed=6)[0], 20, ignore_eos=True)]
    results = run(engine, first)
    failed = engine.take_failures()
    assert sorted(f.rid for f in failed) == ["a", "b"] and "IndexError: a bug in a step" in failed[0].message
    assert all(r[1] is None for r in results.values())
    assert engine.pages.radix.num_pages == 0  # nothing of a failed request reached the prefix cache
    later = run(engine, [req("c", prompts(1, seed=7)[0], 6, ignore_eos=True)])
    assert later["c"][1] == "length" and len(later["c"][0]) == 6


def test_device_poisoning_errors_are_raised_not_contained(model_dir):
    engine = make_engine(model_dir)
    engine.faults = FaultHooks([Fault("cuda", CUDA, 0.0)])
    assert engine.submit(req("x", [CUDA, 1, 2], 4)) is None
    with pytest.raises(RuntimeError, match="illegal memory access"):
        engine.step()
    assert poisons_device(RuntimeError("CUDA error: device-side assert triggered"))
    assert not poisons_device(ValueError("Overflow when unpacking long long"))


def test_shutdown_says_the_expert_store_stays_in_shared_memory(caplog):
    from types import SimpleNamespace

    from scheduler.process import _note_expert_store

    store = SimpleNamespace(path="/dev/shm/sluice-experts-0123", nbytes=3_500_000_000, name="sluice-experts-0123")
    with caplog.at_level("INFO", logger="sluice.scheduler"):
        _note_expert_store(SimpleNamespace(experts=SimpleNamespace(store=store)))
        _note_expert_store(SimpleNamespace(experts=SimpleNamespace()))  # resident experts: nothing to say
    assert len(caplog.records) == 1
    line = caplog.records[0].getMessage()
    assert "/dev/shm/sluice-experts-0123 (3.50 GB of RAM)" in line
    assert "python scripts/expert_store.py remove sluice-experts-0123" in line
