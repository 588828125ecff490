"""Warm start on CPU: the warm-up runs every step kind without taking a page, touching the
counters or changing what the engine then generates."""
from __future__ import annotations

import pytest

from moe_offload.offloaded import OffloadedExperts
from scheduler.engine import Engine
from scheduler.warmup import warm_up
from tests.test_engine import prompts, req, run
from tests.tiny_models import write_tiny
from worker.expert_placement import ExpertOptions
from worker.runner import ModelRunner, RunnerConfig


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-warm")
    write_tiny(path, "mixtral", seed=3, layers=4, experts=8, top_k=2)
    return str(path)


def make_engine(model_dir, device: str) -> Engine:
    # 75% of the experts cached: room for the prefill pipeline's 3E slots; a host KV tier too
    page_size = 16 if device == "cuda" else 4  # as the other CUDA runner tests
    runner = ModelRunner(RunnerConfig(model_dir, device=device, dtype="float32", page_size=page_size, kv_tokens=1024,
                                      max_prefill_tokens=64, experts=ExpertOptions(cache_fraction=0.75),
                                      kv_host_size=0.001))
    return Engine(runner)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_warm_up_takes_no_page_resets_the_counters_and_changes_no_output(model_dir, device):
    cold, warm = make_engine(model_dir, device), make_engine(model_dir, device)
    experts = warm.runner.experts
    assert isinstance(experts, OffloadedExperts) and experts.pipeline is not None
    assert warm.pages.tier is not None
    assert warm_up(warm) >= 0
    assert warm.pages.pool.num_free == warm.pages.pool.capacity
    warm.check_pages()
    assert experts.cache.stats()["total"]["lookups"] == 0
    assert sum(n for k, n in experts.pipeline.stats().items() if k.startswith("chunks_")) == 0
    assert warm.stats()["steps"] == 0
    graphs = warm.runner.graphs
    assert graphs is None or set(graphs.captured) == set(graphs.buckets)  # every bucket captured
    batch = prompts(4, seed=1)
    got = run(warm, [req(f"r{i}", p) for i, p in enumerate(batch)])
    want = run(cold, [req(f"r{i}", p) for i, p in enumerate(batch)])
    assert {k: v[0] for k, v in got.items()} == {k: v[0] for k, v in want.items()}


@pytest.mark.parametrize("top_k", [1, 2, 4, 8])
def test_the_ladder_meets_every_tile_a_token_count_picks(top_k):
    """Every compile-time choice that follows a chunk's token count (the grouped GEMMs' tiles by
    format, the align kernel's sort block, the decode GEMMs' pair block) is made by some chunk of
    the warm-up (its ladder from 8 tokens, the mid and full chunks) for every chunk length from 8
    to 8k tokens: a change to a table that opens a new range fails here until the ladder reaches it."""
    import torch
    import triton

    from moe_offload.kernels import grouped_gemm, grouped_gemm_decode, grouped_gemm_fp8, grouped_gemm_w4
    from scheduler.warmup import LADDER, MID_CHUNK

    def choices(n: int) -> tuple:
        pairs = n * top_k
        tiles = tuple(m.default_config(n, torch.bfloat16) for m in (grouped_gemm, grouped_gemm_fp8, grouped_gemm_w4))
        sort_block = triton.next_power_of_2(pairs) if pairs <= grouped_gemm.IN_KERNEL_SORT_MAX else 0
        decode = pairs <= grouped_gemm_decode.DECODE_MAX_PAIRS  # the decode GEMMs take this chunk
        return tiles, sort_block, grouped_gemm_decode._block_p(pairs) if decode else 0

    full = 8192
    warmed = {choices(n) for n in (*LADDER, MID_CHUNK, full)}
    missed = {n: choices(n) for n in range(8, full + 1) if choices(n) not in warmed}
    assert not missed, f"{len(missed)} chunk lengths make a choice no warm-up chunk makes, e.g. {min(missed)}"
