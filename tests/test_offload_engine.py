"""Offloaded experts (expert store + cache of 25%) generate exactly what resident experts do."""
from __future__ import annotations

import pytest

from moe_offload.offloaded import OffloadedExperts
from tests.tiny_models import write_tiny
from worker.expert_placement import ExpertOptions
from scheduler.generate import generate
from worker.runner import ModelRunner, RunnerConfig
from scheduler.messages.to_scheduler import SamplingParams


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-offload")
    write_tiny(path, "mixtral", seed=9, layers=4, experts=8, top_k=2)
    return str(path)


def runner(model_dir, **experts):
    return ModelRunner(RunnerConfig(model_dir, device="cpu", dtype="float32", page_size=4, kv_tokens=512,
                                    experts=ExpertOptions(**experts)))


def test_offloaded_generation_equals_resident(model_dir):
    resident = runner(model_dir)
    offloaded = runner(model_dir, cache_fraction=0.25)
    assert isinstance(offloaded.experts, OffloadedExperts)
    assert offloaded.experts.cache.num_slots == 8  # 25% of 4 layers x 8 experts
    for prompt in ([5, 9, 11, 3], list(range(1, 40)), [77] * 13):
        want = generate(resident, prompt, SamplingParams(), 16).token_ids
        assert generate(offloaded, prompt, SamplingParams(), 16).token_ids == want
    stats = offloaded.experts.cache.stats()
    assert stats["total"]["misses"] > 0 and stats["total"]["hits"] > 0


def test_runner_stats_report_the_cache_and_the_pipeline(model_dir):
    """What the scheduler's stats reply carries about the experts comes from the runner, flat."""
    # resident experts report nothing; what the compile watch counts is there for every runner
    assert set(runner(model_dir).stats()) == {"compiles_total", "compiles_after_warmup", "plans_total",
                                              "plans_after_warmup"}
    piped = runner(model_dir, cache_fraction=0.8, prefill_pipeline=True)
    assert piped.experts.pipeline is not None
    generate(piped, list(range(1, 40)), SamplingParams(), 2)
    stats, cache = piped.stats(), piped.experts.cache.stats()
    assert stats["moe_lookups"] == cache["total"]["lookups"] > 0
    assert (stats["moe_hit_rate"], stats["moe_cache_slots"], stats["moe_policy"]) == \
        (cache["hit_rate"], cache["slots"], cache["policy"])
    assert {k: stats[f"prefill_{k}"] for k in ("from_host", "bytes_h2d")} == \
        {k: piped.experts.pipeline.stats()[k] for k in ("from_host", "bytes_h2d")}
    assert sum(n for k, n in stats.items() if k.startswith("prefill_chunks_")) > 0


def test_whole_cache_runs_resident_without_lookups(model_dir):
    r = runner(model_dir, cache_fraction=1.0)
    assert not isinstance(r.experts, OffloadedExperts)


def test_cache_options_are_exclusive(model_dir):
    with pytest.raises(ValueError, match="mutually exclusive"):
        runner(model_dir, cache_size=4, cache_fraction=0.5)
    with pytest.raises(ValueError, match="needs at least one layer's 8"):
        runner(model_dir, cache_size=7)


def test_dummy_geometry_runs(tmp_path):
    r = ModelRunner(RunnerConfig("tiny-geometry", device="cpu", dtype="float32", page_size=4, kv_tokens=256,
                                 experts=ExpertOptions(cache_fraction=0.5, dummy_weights=True)))
    out = generate(r, [1, 2, 3, 4, 5], SamplingParams(), 4)
    assert len(out.token_ids) == 4
