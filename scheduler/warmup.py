"""Warm start: before the scheduler reports ready, run every kind of step it will run, so that
Triton compiles its kernels and the decode graphs are captured now rather than inside the first
request (measured on the H200: a cold first turn of a 16k-token prompt took 11.6–16.4 s against
2.5 s warm).

The steps write KV into pages that no request owns yet (all are free before Ready) and leave the
allocator untouched; the expert cache keeps what they loaded, and its counters are reset."""
from __future__ import annotations

import logging
import time

import torch

from scheduler.engine import Engine
from worker import compile_watch
from worker.batch import SequenceChunk
from worker.runner import ModelRunner
from worker.token_mask import TokenMask, mask_words
from scheduler.messages.to_scheduler import SamplingParams

log = logging.getLogger("sluice.scheduler")

MID_CHUNK = 1024  # a chunk that still streams experts but chooses the stage kernel under "auto"
SMALL_CHUNK = 7  # below the pipeline threshold, and a length that is no multiple of 16
# The warm-up's chunks on the GPU: a full chunk, a second one over it (the long-prefix attention
# path once the chunk's prefix work reaches cudnn_prefill.MIN_PREFIX_WORK), a mid and a small chunk
# over prefixes that are multiples of 16, then a mid and a small one over prefixes that are not:
# Triton specialises integer arguments by divisibility by 16, and serving meets every combination.
# Then, from position 0, chunks at both ends of every token-count range that picks a kernel's tiles
# at compile time: the grouped GEMMs' tile tables (up to 32, 128, 512 tokens, then any), the align
# kernel's sort block (the next power of two of tokens x top-k, up to 1,024) and the decode GEMMs'
# block of pairs; every other integer that follows a batch's lengths is left unspecialised.
LADDER = (8, 15, 16, 31, 32, 63, 64, 127, 128, 255, 256, 511, 512)
# Hybrid models: a prompt's chunk snapshots its state at the prompt's last page boundary, so the
# linear layers' second pass runs over 1 to a page of tokens: one token, a page, and neither.
SNAPSHOT_TAILS = (1, 15, 16)
CPU_FULL_CHUNK = 16  # nothing compiles on the CPU: keep the warm-up a formality there
GREEDY, SAMPLED = SamplingParams(), SamplingParams(temperature=0.7, top_k=20, top_p=0.9, seed=0)


def warm_up(engine: Engine) -> float:
    """Warm every path of ``engine``; returns the seconds it took and logs them."""
    start = time.perf_counter()
    runner = engine.runner
    graphs = _warm_runner(runner)
    shapes = runner.warm_attention_plans()
    _warm_kv_tier(engine)
    if runner.device.type == "cuda":
        torch.cuda.synchronize(runner.device)  # start-up, not a step: wait so the time is true
    runner.reset_stats()  # the experts' counters count served requests only
    runner.clear_routing_record()  # warm-up tokens sit on real pages: a replay would route requests by them
    seconds = time.perf_counter() - start
    compile_watch.arm()  # from here a compilation or a new plan is a slow step: count and log it
    log.info("warm-up: prefill chunks, decode, sampling and page copies compiled, %d decode graphs "
             "captured, %d long-prefix attention shapes planned, in %.1f s", graphs, shapes, seconds)
    return seconds


def _warm_runner(runner: ModelRunner) -> int:
    """One sequence through the warm-up's prefill chunks (above) over its cached prefix, then decode
    steps (greedy, sampled, under a grammar mask); then every decode graph bucket."""
    room = min(runner.model_config.max_context, (runner.kv_pool.num_pages - 1) * runner.page_size) - 3
    on_gpu = runner.device.type == "cuda"
    full = runner.plan.prefill_tokens
    sizes = (full, full, MID_CHUNK, SMALL_CHUNK, MID_CHUNK, SMALL_CHUNK) if on_gpu else (CPU_FULL_CHUNK, SMALL_CHUNK)
    pages = list(range(1, runner.kv_pool.num_pages))  # page 0 is the scratch page
    state = runner.state_pool.running_slot(0) if runner.state_pool is not None else -1  # hybrid models
    done = 0
    for n in sizes:
        if done + n + 2 > room:
            continue
        runner.forward([_chunk(n, done, pages, runner.page_size, state)], [GREEDY], [0])
        done += n
    for n in LADDER if on_gpu else ():
        if n <= room:  # over the sequence's first pages again: nothing reads what the chunks wrote
            runner.forward([_chunk(n, 0, pages, runner.page_size, state)], [GREEDY], [0])
    split_chunk = 2 * SNAPSHOT_TAILS[-1]
    for tail in SNAPSHOT_TAILS if on_gpu and state >= 0 and split_chunk <= room else ():  # into scratch slot 0
        chunk = _chunk(split_chunk, 0, pages, runner.page_size, state)
        runner.forward([chunk._replace(state_snapshot=(len(chunk.token_ids) - tail, 0))], [GREEDY], [0])
    allow_all = torch.full((1, mask_words(runner.model_config.vocab_size)), -1, dtype=torch.int32,
                           device=runner.device)
    for params, mask in ((GREEDY, None), (SAMPLED, None), (SAMPLED, TokenMask(allow_all, [0]))):  # grammars' too
        runner.forward([_chunk(1, done, pages, runner.page_size, state)], [params], [1], mask=mask)
        done += 1
    if runner.graphs is None:
        return 0
    runner.graphs.capture_all()
    return len(runner.graphs.captured)


def _chunk(n: int, prefix: int, pages: list[int], page_size: int, state_slot: int) -> SequenceChunk:
    return SequenceChunk([1] * n, prefix, pages[:-(-(prefix + n) // page_size)], state_slot=state_slot)


def _warm_kv_tier(engine: Engine) -> None:
    """One page to the host and back with the tier's copy kernels (page 1 and host page 0 are
    free: nothing is cached before Ready)."""
    tier = engine.pages.tier
    if tier is None or tier.method == "memcpy":
        return
    tier.host.write_from(tier.pool, [1], [0])
    tier.host.load_into(tier.pool, [0], [1])
