"""Nothing compiles after warm-up (issue 32).

Triton compiles a kernel again for every new combination of its int arguments' ``== 1`` and
divisibility by 16 and of its pointers' 16-byte alignment; on the H200 a served 4,000-token prompt
compiled three kernels whose token and pair counts the warm-up's chunks had not met. Here a tiny
Qwen3-MoE (bf16, then fp8 experts), offloaded behind an expert cache smaller than its experts, is
warmed as the scheduler warms it; then it prefills prompts of lengths the warm-up never ran, from
position 0 and over cached prefixes of random lengths, in the runner's chunks as the scheduler cuts
them, decodes at every batch size its graphs take, moves pages to the host tier and back, and the
process-wide compile watch must count no compilation (what compiled is printed if any did).
"""
from __future__ import annotations

import dataclasses
import json
import random

import pytest
import torch

from scheduler.engine import Engine
from scheduler.messages.to_scheduler import SamplingParams
from scheduler.warmup import warm_up
from tests.tiny_models import write_tiny
from worker import compile_watch
from worker.batch import SequenceChunk
from worker.runner import ModelRunner, RunnerConfig
from worker.runner_config import ExpertOptions
from worker.token_mask import TokenMask, mask_words

pytestmark = pytest.mark.cuda

MAX_CONTEXT = 16384  # the tiny checkpoint's 512 positions, raised: prompts of thousands and room for the warm-up
CHUNK = 2048  # the runner's full prefill chunk
PROMPTS = (4000, 2064, 3001, 17, 129, 1000)  # from position 0: none is a chunk length of the warm-up
EXPERTS, LAYERS = 8, 4
GREEDY, SAMPLED = SamplingParams(), SamplingParams(temperature=0.7, top_k=20, top_p=0.9, seed=0)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-no-recompile")
    write_tiny(path, "qwen3_moe", seed=5, layers=LAYERS, hidden=128, heads=4, kv_heads=2, head_dim=64,
               experts=EXPERTS, top_k=2, inter=64, vocab=256)
    config = path / "config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "max_position_embeddings": MAX_CONTEXT}))
    return str(path)


@pytest.fixture
def watch(monkeypatch):
    """The process-wide compile watch, hooked into Triton, disarmed and zeroed for the test (another
    test's warm-up may have armed it), restored after; ``watch.late`` lists what compiled once armed."""
    watch = compile_watch.install()
    saved = {f.name: getattr(watch, f.name) for f in dataclasses.fields(watch)}
    fresh = compile_watch.CompileWatch()
    for f in dataclasses.fields(watch):
        setattr(watch, f.name, getattr(fresh, f.name))
    late, on_compile = [], watch.on_compile

    def record(name: str, detail: str = "") -> None:
        if watch.armed:
            late.append(f"{name}: {detail}")
        on_compile(name, detail)

    monkeypatch.setattr(watch, "on_compile", record)
    monkeypatch.setattr(watch, "late", late, raising=False)
    yield watch
    for name, value in saved.items():
        setattr(watch, name, value)


def make_engine(model_dir: str, expert_dtype: str, device: str = "cuda") -> Engine:
    # a cache of 3E slots (the prefill pipeline's double buffer and decode's share) for 4E experts
    options = ExpertOptions(cache_size=3 * EXPERTS, expert_dtype=expert_dtype)
    runner = ModelRunner(RunnerConfig(model_dir, device=device, dtype="bfloat16", page_size=16,
                                      kv_tokens=2 * MAX_CONTEXT, max_prefill_tokens=CHUNK, experts=options,
                                      kv_host_size=0.001))
    return Engine(runner)


@pytest.mark.parametrize("expert_dtype", ["bf16", "fp8"])
def test_nothing_compiles_after_warm_up(model_dir, watch, expert_dtype):
    engine = make_engine(model_dir, expert_dtype)
    assert engine.runner.plan.prefill_tokens == CHUNK and engine.runner.graphs is not None
    assert engine.runner.experts.cache.num_slots < LAYERS * EXPERTS
    warm_up(engine)
    assert watch.armed and watch.compiles_after_warmup == 0
    serve(engine, random.Random(0))
    late = "\n".join(watch.late)
    assert watch.compiles_after_warmup == 0, f"{watch.compiles_after_warmup} kernels compiled after warm-up:\n{late}"


def serve(engine: Engine, rng: random.Random) -> None:
    """Prompts from position 0 and over cached prefixes of random lengths, decode steps at every batch
    size of the decode graphs, and a page move to the host tier and back."""
    runner = engine.runner
    for length in PROMPTS:
        prompt(runner, rng, 0, length)
    prompt(runner, rng, 0, 333, constrained=True)  # a grammar's mask on the prompt's last token
    for _ in range(6):
        prefix = rng.randrange(1, 4000)
        prompt(runner, rng, prefix, rng.randrange(1, min(3000, MAX_CONTEXT - prefix - 8)))
    largest = max(runner.graphs.buckets) if runner.graphs is not None else 8
    for batch in range(1, largest + 1):
        decode(runner, rng, batch)
    move_pages(engine)


def prompt(runner: ModelRunner, rng: random.Random, prefix: int, length: int, constrained: bool = False) -> None:
    """Prefill ``prefix`` tokens (the cached prefix), then ``length`` more over them, each in chunks of
    the runner's full chunk; then one decode step."""
    pool = runner.kv_pool
    pages = pool.allocate(pool.pages_for(prefix + length + 1))
    tokens = [rng.randrange(1, runner.model_config.vocab_size - 1) for _ in range(prefix + length + 1)]
    end = prefix + length
    for start, stop in ((0, prefix), (prefix, end)):
        for first in range(start, stop, CHUNK):
            last = min(first + CHUNK, stop)
            mask = TokenMask(allow_all(runner, 1), [0]) if constrained and last == end else None
            runner.forward([SequenceChunk(tokens[first:last], first, pages)], [GREEDY], [0], mask=mask)
    runner.forward([SequenceChunk(tokens[-1:], end, pages)], [SAMPLED], [1])
    pool.free(pages)


def decode(runner: ModelRunner, rng: random.Random, batch: int) -> None:
    """One decode step of ``batch`` sequences of random lengths (long ones in small batches), greedy,
    sampled and grammar-masked by turns."""
    pool, longest = runner.kv_pool, 6000 if batch <= 4 else 200
    lengths = [rng.randrange(1, longest) for _ in range(batch)]
    pages = [pool.allocate(pool.pages_for(n + 1)) for n in lengths]
    chunks = [SequenceChunk([rng.randrange(1, 100)], n, p) for n, p in zip(lengths, pages)]
    sampling = [SAMPLED if (batch + b) % 2 else GREEDY for b in range(batch)]
    mask = TokenMask(allow_all(runner, 2), [b % 3 - 1 for b in range(batch)]) if batch % 3 == 0 else None
    runner.forward(chunks, sampling, [n % 7 for n in lengths], mask=mask)
    for p in pages:
        pool.free(p)


def allow_all(runner: ModelRunner, rows: int) -> torch.Tensor:
    return torch.full((rows, mask_words(runner.model_config.vocab_size)), -1, dtype=torch.int32,
                      device=runner.device)


def move_pages(engine: Engine) -> None:
    """Five pages to the host tier and back with its copy kernels (the warm-up moved one)."""
    tier = engine.pages.tier
    if tier is None or tier.method == "memcpy":
        return
    pages = engine.runner.kv_pool.allocate(5)
    tier.host.write_from(tier.pool, pages, list(range(5)))
    tier.host.load_into(tier.pool, list(range(5)), pages)
    engine.runner.kv_pool.free(pages)
