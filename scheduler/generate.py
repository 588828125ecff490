"""Offline generation for tests, benchmarks and ``scripts/generate.py``: one request through the
engine's loop (the one the server drives), without sockets."""
from __future__ import annotations

import time
from dataclasses import dataclass

from scheduler.engine import Engine, EngineConfig
from scheduler.messages.from_scheduler import TokenUpdate
from scheduler.messages.to_scheduler import SamplingParams
from scheduler.request import Request
from worker.runner import ModelRunner


@dataclass
class Generation:
    token_ids: list[int]
    finish_reason: str  # "stop" | "length"
    prefill_seconds: float
    decode_seconds: float


def generate(runner: ModelRunner, prompt_ids: list[int], params: SamplingParams, max_tokens: int,
             eos_ids: tuple[int, ...] = (), max_prefill_tokens: int | None = None) -> Generation:
    """Prefill the prompt in chunks, then decode (greedy or sampled): an engine of one request on
    ``runner``, without a prefix cache, so its pages go back to the pool when it ends."""
    vocab = runner.model_config.vocab_size
    if prompt_ids and not 0 <= min(prompt_ids) <= max(prompt_ids) < vocab:  # on the GPU: a device-side assert
        raise ValueError(f"prompt token ids must lie in [0, {vocab}); got {min(prompt_ids)}..{max(prompt_ids)}")
    config = EngineConfig(max_prefill_tokens=max_prefill_tokens or runner.plan.prefill_tokens, max_running=1,
                          prefix_cache=False)
    engine = Engine(runner, config)
    error = engine.submit(Request("generate", list(prompt_ids), params, max_tokens, frozenset(eos_ids)))
    if error:
        raise ValueError(error)
    tokens, finish, first = [], "length", None
    start = time.perf_counter()
    while engine.has_work:
        for update in _step(engine):
            first = first or time.perf_counter()
            tokens += update.token_ids
            finish = update.finish_reason or finish
    return Generation(tokens, finish, first - start, time.perf_counter() - first)


def _step(engine: Engine) -> list[TokenUpdate]:
    """One engine step; a failed step or a request the pool cannot admit raises here."""
    updates = engine.step()
    failures = engine.take_failures()
    if failures:
        raise RuntimeError(failures[0].message)
    if engine.waiting and not (engine.running or engine.in_flight):
        raise MemoryError("the KV pool has no free pages for the request")
    return updates
