"""Decode under expert offload: tokens/s, expert-cache hit rate and bytes moved per token, against
the PCIe bound (miss bytes / 55 GB/s) and, fully resident, the HBM bound (bytes read / 4.3 TB/s).

    python scripts/bench_decode.py [--model qwen3-30b-geometry | qwen3.5-35b-a3b-geometry] [--fractions 1.0 0.5 0.25]
        [--batch 1 8] [--routing model|synthetic|replay:FILE] [--lent-slots reserve decode] [--prefetch off on wide 1]
        [--fill gemm gather] [--sampling greedy sampled] [--gpus 1 2] [--device cpu]

Runs with ``--dummy-weights`` (seeded random weights in the expert store) unless --model is a
checkpoint directory. Each ``--expert-dtype`` (e.g. ``--expert-dtype bf16 fp8 nvfp4 mxfp4``) gets its
own runner and rows; the bounds count an expert's bytes in its format (fp8: weights plus scales;
4-bit: packed weights, group scales and nvfp4's channel scales), the
misses' bytes as the cache moved them. Dummy weights route nearly the same experts every step; ``--routing
synthetic`` gives them Qwen3-30B-A3B's decode statistics, so that the offloaded rows measure misses.
Each ``--lent-slots`` rule gets its own rows (the prompts' prefill wipes the lent slots once;
``--prefill-every STEPS`` puts another request's prefill of ``--prefill-tokens`` between decode
steps that often, as other sessions' turns would: "tok/s" then includes those prefills, "decode
tok/s" and the ratio leave out the steps that ran one, timed apart).
``--top-kernels N`` lists the N kernels that take the most GPU time in a decode step.
"non-expert ms" is a step's GPU time outside the routed experts' kernels and the gather of their
misses (``EXPERT_GEMM_MODULES``; a fill in the GEMM gathers the misses' scales first, bytes the
PCIe bound counts): attention, projections, norms, router, lookups, lm_head, sampling. A layer's misses are known only
after its router, so they cannot cross PCIe beside that work; an offloaded row without guesses
gets "ceiling", the ratio its step could reach at most with the misses at 55 GB/s after its own
non-expert work, the misses' lookups included (run it ``--pdl off``: under PDL an early-started
kernel's wait counts as its own time); "at peak" is the same with that work at the HBM bound of its
bytes (the dense weights but the shared experts', which can run beside the misses, and the
sequences' KV and state at 4.3 TB/s, no gap between launches): what no kernel work could raise
without guesses.
Each ``--prefetch`` setting gets its own rows (cross-layer expert prefetch off / on; ``wide`` is on
with the guess gathered by ``gather_missing``'s wide grid instead of its few programs; a number N is
on with ``--expert-prefetch-cap N``, at most N guessed experts a layer): "guessed" is
the share of looked-up experts a guess had fetched or marked, "MB moved/tok" counts the misses and
the guesses' bytes, and the PCIe bound is the time those bytes take at 55 GB/s. Each ``--fill``
mode too (how a miss reaches its slot: copied by the expert GEMM as it computes, or gathered first).
``--sampling greedy sampled`` times the same runner with every request greedy or sampled
(temperature 0.8, top-p 0.9): the graph holds both paths, and a sampled row draws by rejection,
a pass over the vocabulary per round (on dummy weights the logits, and so the rounds, are those of
random weights, not a model's).
Each ``--gpus`` count gets its own rows, at the same cache per GPU (expert parallelism: the
aggregate cache grows with the GPUs); the hit rate and bytes are rank 0's, i.e. per link.
The HBM bound reads, each step, the dense weights (a hybrid model's linear-attention and shared-expert
weights included), the distinct experts, and per sequence its KV (full-attention layers) and its
recurrent state (read and written: 64 MB a sequence in qwen3.5-35b-a3b-geometry, as much as ten of
its experts). ``--device cpu`` runs the same steps on the host (the tests'; times mean nothing).
"""
from __future__ import annotations

import argparse
import functools
import importlib
import itertools
import json
import math
import os
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

from moe_offload.choices import EXPERT_DTYPES, FILL_MODES, LENT_SLOT_RULES, POLICIES
from moe_offload import slot_fill
from moe_offload.kernels.triton_support import PDL_ENV
from moe_offload.synthetic_routing import synthetic_trace
from scheduler.engine import Engine, EngineConfig
from scheduler.request import Request
from worker.expert_placement import ExpertOptions
from worker.geometry import GEOMETRIES
from worker.routing_options import RoutingOptions
from worker.distributed.parallel_runner import start_runner
from worker.runner import ModelRunner, RunnerConfig
from worker.runner_config import KV_CACHE_DTYPES
from scheduler.messages.to_scheduler import SamplingParams
from kernel_profile import busy_us, cuda_kernels, print_top_kernels, top_kernels  # beside this script
from report_table import print_table, switches  # beside this script

PCIE_BYTES_PER_S = 55e9
HBM_BYTES_PER_S = 4.3e12


COUNTERS = ("lookups", "hits", "misses", "bytes_h2d", "predicted", "prefetch_bytes")


def cache_totals(runner: ModelRunner) -> dict:
    cache = getattr(runner.experts, "cache", None)
    if cache is None:
        return dict.fromkeys(COUNTERS, 0)
    stats = cache.stats()
    return {**stats["total"], "prefetch_bytes": stats["prefetch"]["bytes_h2d"]}


def expert_bytes(runner: ModelRunner) -> int:
    """One expert's bytes in the runner's format, resident or offloaded."""
    cache = getattr(runner.experts, "cache", None)
    if cache is not None:
        return cache.slot_bytes
    banks = runner.experts.banks  # every bank of the format (4-bit: packed weights and scales)
    return sum(t.nbytes for t in banks.tensors()) // (banks.num_layers * banks.num_experts)


def kernel_profile(engine: Engine, steps: int, top: int = 0) -> dict:
    """Kernels and GPU-busy milliseconds per decode step, over ``steps`` steps (``kernel_profile``
    module: under PDL a kernel's own time includes its wait for the one before); ``top``: also
    the ``top`` kernels by the busy time they add."""
    def run() -> None:
        for _ in range(steps):
            engine.step()

    spans = cuda_kernels(run)
    return dict(kernels=len(spans) / steps, busy_ms=busy_us([span[1:] for span in spans]) / 1e3 / steps,
                non_expert_ms=non_expert_us(spans) / 1e3 / steps, top_kernels=top_kernels(spans, top, steps))


# The modules of the kernels that compute routed experts (their GEMMs, sums and activations'
# quantization): the only part of a decode step that a layer's misses can cross PCIe beside, since
# the misses are known after the layer's router, which waits for its attention and projections.
EXPERT_GEMM_MODULES = ("grouped_gemm", "grouped_gemm_fp8", "grouped_gemm_w4", "grouped_gemm_w4_tiles",
                       "grouped_gemm_decode", "grouped_gemm_decode_fp8", "grouped_gemm_w4_decode", "decode_tiles",
                       "quant_fp8", "gather_missing")


@functools.cache
def expert_gemm_kernels() -> frozenset[str]:
    """The names (as the profiler shows them) of the Triton kernels in ``EXPERT_GEMM_MODULES``: each
    ``triton.runtime`` wrapper (jit, interpreted, autotuned) unwrapped to its function."""
    names = set()
    for module in EXPERT_GEMM_MODULES:
        for value in vars(importlib.import_module(f"moe_offload.kernels.{module}")).values():
            fn = value
            while type(fn).__module__.startswith("triton.runtime") and hasattr(fn, "fn"):  # not the interpreter's
                fn = fn.fn  # builder, which a kernel run interpreted leaves in its module
            if fn is not value:
                names.add(fn.__name__)
    return frozenset(names)


def non_expert_us(kernels: list[tuple[str, float, float]]) -> float:
    """GPU-busy time of every kernel ``(name, start, end)`` but the experts' GEMMs: the union of
    their intervals (exact with ``--pdl off``; under PDL a kernel's early start counts too)."""
    experts = expert_gemm_kernels()
    return busy_us([(start, end) for name, start, end in kernels if name not in experts])


def decode_ceilings(rows: list[dict]) -> None:
    """Each offloaded row without guesses gets ``ceiling``: the most of its misses' PCIe bound a step
    could reach with its misses crossing at 55 GB/s while only experts compute, i.e. one after the
    row's own non-expert work (the lookups that find the misses are part of it):
    ``step_pcie / (step_pcie + non_expert)``; and ``peak_ceiling``, the same with that work at the
    HBM bound of its bytes (dense weights but a shared expert's, which may run beside the misses,
    and the sequences' KV and state); and ``miss_gbps``, the misses' bytes over the rest of the
    timed step (its seconds less the non-expert work; the profiler's busy time runs longer than a
    timed step): the rate the misses crossed at if the experts did nothing else, which the bound
    counts as 55 GB/s. Other rows get nan."""
    for r in rows:
        offloaded = r["fraction"] < 1.0 and r["prefetch"] == "off" and r["step_pcie"] > 0
        serial = r["non_expert_ms"] / 1e3
        at_peak = (r["dense_bytes"] - r["shared_bytes"] + r["sequence_bytes"]) / HBM_BYTES_PER_S
        expert_s = r["batch"] / r["decode_tok_s"] - serial if r["decode_tok_s"] > 0 else 0.0
        r["ceiling"] = r["step_pcie"] / (r["step_pcie"] + serial) if offloaded else math.nan
        r["peak_ceiling"] = r["step_pcie"] / (r["step_pcie"] + at_peak) if offloaded else math.nan
        r["miss_gbps"] = r["step_pcie"] * PCIE_BYTES_PER_S / expert_s / 1e9 if offloaded and expert_s > 0 else math.nan


def sync() -> None:
    """Wait for the GPU (a CPU runner in the tests has nothing to wait for)."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def progress(what: str, since: float) -> None:
    """One line to stderr as each part finishes, so a run cut short still says how far it got."""
    print(f"[{time.perf_counter() - since:7.1f} s] {what}", file=sys.stderr, flush=True)


# what ``--sampling sampled`` asks of every request (a chat client's usual settings)
SAMPLED = SamplingParams(temperature=0.8, top_p=0.9)


def profile_and_finish(engine: Engine, profile_steps: int, top_kernels: int) -> dict:
    profiled = kernel_profile(engine, profile_steps, top_kernels)
    while engine.has_work:  # finish, so the next run finds every page free
        engine.step()
    engine.check_pages()
    return profiled


def decode_run(runner: ModelRunner, batch: int, prompt_tokens: int, decode_tokens: int, seed: int,
               profile_steps: int = 0, top_kernels: int = 0, prefill_every: int = 0, prefill_tokens: int = 0,
               sampling: SamplingParams = SamplingParams()) -> dict:
    """``batch`` requests decode ``decode_tokens`` each after one prefill of their prompts, every
    one sampling as ``sampling`` says (default greedy).
    ``prefill_every``: every that many decode steps, one more request of ``prefill_tokens`` prompt
    tokens and a single output token joins, so its prefill chunk (the expert pipeline's, when
    it is long enough) runs between decode steps as another session's turn would."""
    # every prompt in one chunk where the plan's activations allow; a long prompt in the plan's chunks
    chunk = min(max(prompt_tokens * batch, prefill_tokens), max(runner.plan.prefill_tokens, prefill_tokens))
    engine = Engine(runner, EngineConfig(max_running=batch + bool(prefill_every), prefix_cache=False),
                    plan=replace(runner.plan, prefill_tokens=chunk))
    gen = torch.Generator().manual_seed(seed)
    vocab = runner.model_config.vocab_size

    def request(rid: str, tokens: int, max_tokens: int) -> Request:
        prompt = torch.randint(0, vocab, (tokens,), generator=gen).tolist()
        return Request(rid, prompt, sampling, max_tokens, frozenset(), ignore_eos=True)

    reqs = [request(str(i), prompt_tokens, decode_tokens) for i in range(batch)]
    for r in reqs:
        engine.submit(r)
    # the prefill steps (the first token), not the first decode step: with overlap scheduling a
    # token reaches the host a step after its launch, so waiting for every request's first token
    # would launch decode step 1 before the clock starts while the tokens count all decode_tokens - 1
    while not all(r.prefill_done for r in reqs):
        engine.step()
    sync()
    if profile_steps:
        return profile_and_finish(engine, profile_steps, top_kernels)
    before = cache_totals(runner)
    seconds, prefill_s, prefill_steps = timed_steps(engine, reqs, prefill_every,
                                                    lambda n: request(f"prefill{n}", prefill_tokens, 1))
    after = cache_totals(runner)
    engine.check_pages()
    steps = decode_tokens - 1
    delta = {k: after[k] - before[k] for k in COUNTERS}
    return dict(seconds=seconds, steps=steps, tokens=steps * batch, prefill_s=prefill_s,
                prefill_steps=prefill_steps, **delta)


def timed_steps(engine: Engine, reqs: list[Request], prefill_every: int, extra) -> tuple[float, float, int]:
    """Step ``engine`` until it is done: seconds in all, seconds in the steps that ran a prefill and
    their count. Every ``prefill_every`` steps (0: never) while ``reqs`` decode, ``extra(n)``'s
    request joins and the next step, which prefills it, is timed apart between the benchmark's own
    synchronisations."""
    start, n, prefill_s, prefill_steps = time.perf_counter(), 0, 0.0, 0
    while engine.has_work:
        if prefill_every and n % prefill_every == prefill_every - 1 and not all(r.finished for r in reqs):
            engine.submit(extra(n))
            sync()
            since = time.perf_counter()
            engine.step()
            sync()
            prefill_s, prefill_steps = prefill_s + time.perf_counter() - since, prefill_steps + 1
        else:
            engine.step()
        n += 1
    sync()
    return time.perf_counter() - start, prefill_s, prefill_steps


def runner_for(args: argparse.Namespace, fraction: float, expert_dtype: str, lent: str, prefetch: str, fill: str,
               gpus: int) -> ModelRunner:
    experts = ExpertOptions(cache_fraction=fraction, policy=args.policy, dummy_weights=args.model in GEOMETRIES,
                            expert_dtype=expert_dtype, lent_slots=lent, prefetch=prefetch != "off", fill=fill,
                            prefetch_cap=int(prefetch) if prefetch.isdigit() else 0)
    # a hybrid model's state slots: one per request that runs at once (the largest batch, and a joining
    # prefill); the prefix cache is off, so one snapshot slot, the fewest there can be. KV: the largest
    # batch at the longest prompt, and a joining prefill
    kv_tokens = max(16384, max(args.batch) * (max(args.prompt_tokens) + args.decode_tokens) + args.prefill_tokens)
    runner = start_runner(RunnerConfig(args.model, device=args.device, dtype="auto", kv_tokens=kv_tokens,
                                       kv_cache_dtype=args.kv_cache_dtype,
                                       cuda_graph=not args.no_cuda_graph, gpu_memory_limit=args.gpu_memory_limit,
                                       routing=RoutingOptions(args.routing), experts=experts, gpus=gpus,
                                       state_slots=max(args.batch) + 1, state_snapshots=1))
    slot_fill.MISS_PROGRAMS, slot_fill.SCALE_PROGRAMS = args.gather_programs, args.scale_programs
    if prefetch == "wide" and getattr(runner.experts, "prefetch", None) is not None:
        runner.experts.prefetch.programs = 0  # the guess's gather on gather_missing's wide grid, as before 2026-12-04
    return runner


def bench_runner(args: argparse.Namespace, fraction: float, expert_dtype: str, lent: str, prefetch: str, fill: str,
                 gpus: int) -> list[dict]:
    start = time.perf_counter()
    runner = runner_for(args, fraction, expert_dtype, lent, prefetch, fill, gpus)
    progress(f"runner for {fraction:.0%} cache, {expert_dtype}, lent {lent}, prefetch {prefetch}, fill {fill}", start)
    decode_run(runner, 1, 16, 4, seed=0)  # warm-up: compile kernels
    if args.prefill_every:  # ... and the prefill path those prefills take
        decode_run(runner, 1, 16, 4, seed=0, prefill_every=2, prefill_tokens=args.prefill_tokens)
    progress("warm-up", start)
    if runner.graphs is not None:
        runner.graphs.capture_all()  # capture outside the timed loop
        progress(f"graph capture ({len(runner.graphs.buckets)} batch sizes)", start)
    setup = dict(gpus=gpus, fraction=fraction, experts=runner.expert_format.name, lent_slots=lent, prefetch=prefetch,
                 fill=fill if fraction < 1.0 else "-", prefill_every=args.prefill_every)
    rows = []
    for prompt, batch, sampling in itertools.product(args.prompt_tokens, args.batch, args.sampling):
        rows.append(bench_batch(runner, args, batch, dict(setup, sampling=sampling, prompt=prompt)))
        progress(f"prompt {prompt}, batch {batch}: {rows[-1]['tok_s']:.1f} tok/s, hit rate {rows[-1]['hit_rate']:.3f}, "
                 f"ratio {rows[-1]['ratio']:.3f} of the {rows[-1]['bound']} bound", start)
    runner.close()
    del runner
    torch.cuda.empty_cache()
    return rows


def bench_batch(runner, args: argparse.Namespace, batch: int, setup: dict) -> dict:
    """One row: tokens/s of ``batch`` requests decoding after prompts of ``setup["prompt"]`` tokens,
    beside the PCIe / HBM bound of its step."""
    cfg, fraction, prompt = runner.model_config, setup["fraction"], setup["prompt"]
    dense, one_expert = dense_bytes(runner), expert_bytes(runner)
    # the mean context of a decode step: the prompt and half the answer
    per_sequence = sequence_bytes(runner, prompt + args.decode_tokens // 2)
    sampling = SAMPLED if setup["sampling"] == "sampled" else SamplingParams()
    runs = repeats_for(args, prompt)
    r, spread = median_run([decode_run(runner, batch, prompt, args.decode_tokens, seed=batch + 1009 * i,
                                       prefill_every=args.prefill_every, prefill_tokens=args.prefill_tokens,
                                       sampling=sampling) for i in range(runs)])
    profiled = decode_run(runner, batch, prompt, 16, seed=batch, profile_steps=8,
                          top_kernels=args.top_kernels, sampling=sampling)
    tok_s = r["tokens"] / r["seconds"]
    # with prefills between: the steps that ran one (a decode row may share it) timed apart
    decode_tok_s = (r["steps"] - r["prefill_steps"]) * batch / (r["seconds"] - r["prefill_s"])
    counted, distinct = distinct_experts(cfg, args.routing, batch, fraction, r)
    moved = r["bytes_h2d"] + r["prefetch_bytes"]  # misses and guesses alike cross PCIe
    step_pcie = moved / max(r["steps"], 1) / PCIE_BYTES_PER_S
    step_hbm = (dense + batch * per_sequence + distinct * one_expert) / HBM_BYTES_PER_S
    bound = max(step_pcie, step_hbm)
    return dict(**setup, batch=batch, tok_s=tok_s, runs=runs, spread=spread, decode_tok_s=decode_tok_s,
                prefill_s=r["prefill_s"],
                prefill_steps=r["prefill_steps"],
                hit_rate=r["hits"] / r["lookups"] if r["lookups"] else 1.0,
                guessed=r["predicted"] / r["lookups"] if r["lookups"] else 0.0,
                bytes_per_token=moved / max(r["tokens"], 1),
                prefetch_bytes_per_token=r["prefetch_bytes"] / max(r["tokens"], 1),
                bound_tok_s=batch / bound, bound="pcie" if step_pcie > step_hbm else "hbm",
                ratio=decode_tok_s / (batch / bound), experts_per_layer=distinct / cfg.num_layers,
                distinct=counted, dense_bytes=dense, shared_bytes=shared_expert_bytes(runner),
                sequence_bytes=batch * per_sequence,
                expert_bytes=one_expert, expert_mb=one_expert / 1e6, layers=cfg.num_layers, step_pcie=step_pcie,
                **profiled)


def repeats_for(args: argparse.Namespace, prompt: int) -> int:
    """Timed runs of a row: ``--repeats``, else 5, or 1 over prompts of ``LONG_PROMPT`` tokens or
    more (each run prefills its own prompt)."""
    return args.repeats or (1 if prompt >= LONG_PROMPT else 5)


LONG_PROMPT = 16384


def median_run(runs: list[dict]) -> tuple[dict, float]:
    """The run of the median tokens a second (the upper one of an even count), and the spread of
    all runs' rates: (fastest - slowest) / median."""
    rates = sorted((r["tokens"] / r["seconds"], i) for i, r in enumerate(runs))
    median = rates[len(rates) // 2]
    return runs[median[1]], (rates[-1][0] - rates[0][0]) / median[0]


def distinct_experts(cfg, routing: str, batch: int, fraction: float, run: dict) -> tuple[str, float]:
    """How a step's distinct experts were counted, and how many: looked up behind a cache; resident
    runs look nothing up, so assumed all different, or modelled under synthetic routing."""
    if fraction < 1.0:
        return "looked up", run["lookups"] / max(run["steps"], 1)
    if routing == "synthetic":
        return "modelled", cfg.num_layers * synthetic_distinct(cfg, batch, run["steps"])
    return "assumed", cfg.num_layers * min(cfg.num_experts, batch * cfg.top_k)


def synthetic_distinct(cfg, batch: int, steps: int) -> float:
    """Distinct experts a layer reads per decode step of ``batch`` sequences under the synthetic
    router, from its own process on the host (a resident run looks nothing up to count them)."""
    ids = synthetic_trace(cfg.num_layers, cfg.num_experts, cfg.top_k, sequences=batch, tokens=max(steps, 1))
    used = torch.zeros(cfg.num_layers, ids.shape[2], cfg.num_experts, dtype=torch.bool)
    used.scatter_(2, ids.permute(0, 2, 1, 3).flatten(2), True)  # [L, T, N * k] -> experts used per step
    return float(used.sum(dim=2).float().mean())


def dense_bytes(runner) -> int:
    """Bytes of every weight a decode step reads besides the routed experts (a hybrid layer holds
    its linear attention's and its shared expert's weights in dataclasses of their own)."""
    w = runner.weights
    return sum(tensor_bytes(lw) for lw in w.layers) + w.lm_head.numel() * w.lm_head.element_size()


def shared_expert_bytes(runner) -> int:
    """Bytes of the shared experts' weights (hybrid models): they take the routed experts' input,
    not their output, so they can compute while the misses cross."""
    return sum(tensor_bytes(lw.shared) for lw in runner.weights.layers if getattr(lw, "shared", None) is not None)


def tensor_bytes(weights) -> int:
    """The bytes of every tensor of a weights dataclass, and of the dataclasses it holds."""
    total = 0
    values = weights if isinstance(weights, (tuple, list)) else vars(weights).values()  # gpt-oss: NamedTuples
    for value in values:
        if isinstance(value, torch.Tensor):
            total += value.numel() * value.element_size()
        elif isinstance(value, (tuple, list)) or hasattr(value, "__dict__"):
            total += tensor_bytes(value)
    return total


def sequence_bytes(runner, context: int) -> int:
    """Bytes a decode step moves for each sequence: its KV of ``context`` tokens, read once in each
    full-attention layer, and its recurrent state (hybrid models), read and written."""
    cfg = runner.model_config
    kv = cfg.num_kv_layers * 2 * cfg.kv_size * context * runner.kv_pool.k.element_size()
    states = getattr(runner, "state_pool", None)
    return kv + (2 * states.slot_bytes if states is not None else 0)


def resident_bounds_from_lookups(rows: list[dict]) -> None:
    """A resident run looks nothing up, so its HBM bound first assumes ``min(E, batch * k)``
    distinct experts per layer (an upper bound on the bytes, which overstates the ratio: batch 32
    read more than the HBM ceiling allows), or under synthetic routing models them from the
    router's process (``synthetic_distinct``). Where the same command measured that batch behind a
    cache without prefetch, whose lookups are the distinct experts of the same routing process,
    the resident bound takes that count instead."""
    measured = {(r["gpus"], r["experts"], r["batch"]): r["experts_per_layer"] for r in rows
                if r["fraction"] < 1.0 and r["prefetch"] == "off"}
    for r in rows:
        per_layer = measured.get((r["gpus"], r["experts"], r["batch"]))
        if r["fraction"] < 1.0 or per_layer is None:
            continue
        step_bytes = r["dense_bytes"] + r["sequence_bytes"] + per_layer * r["layers"] * r["expert_bytes"]
        step = max(r["step_pcie"], step_bytes / HBM_BYTES_PER_S)
        r.update(experts_per_layer=per_layer, distinct="from cache", bound_tok_s=r["batch"] / step,
                 ratio=r["tok_s"] * step / r["batch"])


COLUMNS = [("gpus", "gpus", ">4"), ("cache", "fraction", ">6.0%"), ("experts", "experts", ">12"),
           ("lent", "lent_slots", ">7"), ("prefetch", "prefetch", ">8"), ("fill", "fill", ">6"),
           ("pdl", "pdl", ">3"), ("sampling", "sampling", ">8"), ("prompt", "prompt", ">7"),
           ("batch", "batch", ">5"),
           ("tok/s", "tok_s", ">8.1f"), ("runs", "runs", ">4"), ("spread", "spread", ">6.3f"),
           ("decode tok/s", "decode_tok_s", ">12.1f"), ("prefill s", "prefill_s", ">9.2f"),
           ("hit rate", "hit_rate", ">8.3f"), ("guessed", "guessed", ">7.3f"),
           ("MB moved/tok", "mb_per_token", ">12.1f"), ("of which guesses", "guess_mb_per_token", ">16.1f"),
           ("MB/expert", "expert_mb", ">9.2f"), ("experts/layer", "experts_per_layer", ">13.1f"),
           ("counted", "distinct", ">10"),
           ("bound tok/s", "bound_tok_s", ">11.1f"), ("bound", "bound", ">5"), ("ratio", "ratio", ">6.3f"),
           ("kernels/step", "kernels", ">12.0f"), ("GPU ms/step", "busy_ms", ">11.2f"),
           ("non-expert ms", "non_expert_ms", ">13.2f"), ("ceiling", "ceiling", ">7.3f"),
           ("at peak", "peak_ceiling", ">7.3f"), ("miss GB/s", "miss_gbps", ">9.1f")]


def prefetch_choice(text: str) -> str:
    if text not in ("off", "on", "wide") and not (text.isdigit() and int(text) > 0):
        raise argparse.ArgumentTypeError(f"{text!r}: off, on, wide or a count of experts a layer")
    return text


def add_miss_args(p: argparse.ArgumentParser) -> None:
    """How misses and guesses reach their slots."""
    p.add_argument("--prefetch", nargs="+", default=["off"], type=prefetch_choice, metavar="off|on|wide|N",
                   help="cross-layer prefetch (wide: gathered on the wide grid; N: at most N guessed experts a layer)")
    p.add_argument("--gather-programs", type=int, default=slot_fill.MISS_PROGRAMS, metavar="N",
                   help="programs of the gather of a step's own misses (0: gather_missing's wide grid)")
    p.add_argument("--scale-programs", type=int, default=slot_fill.SCALE_PROGRAMS, metavar="N",
                   help="programs of the gather of the misses' scales before a fill in the GEMM (0: the wide grid)")
    p.add_argument("--fill", nargs="+", default=[ExpertOptions.fill], choices=FILL_MODES,
                   help="how decode copies cache misses in (gemm: the GEMM reads and stores them as it computes; "
                        "gather: a copy launch first); several: one row each (resident rows run once)")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="qwen3-30b-geometry")
    p.add_argument("--fractions", type=float, nargs="+", default=[1.0, 0.5, 0.25])
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    p.add_argument("--prompt-tokens", type=int, nargs="+", default=[64],
                   help="tokens of each request's prompt; several: rows each (decode over a long context)")
    p.add_argument("--decode-tokens", type=int, default=48)
    p.add_argument("--repeats", type=int, default=0, metavar="N", help="timed runs a row over new prompts (default "
                   "5, 1 over 16k-token prompts): the median run's row, their spread (fastest - slowest) / median")
    p.add_argument("--kv-cache-dtype", default=RunnerConfig.kv_cache_dtype, choices=KV_CACHE_DTYPES,
                   help="what the KV pool holds (fp8: float8 e4m3, half the bytes a step reads)")
    p.add_argument("--policy", default=ExpertOptions.policy, choices=POLICIES)
    p.add_argument("--no-cuda-graph", action="store_true", help="decode eagerly (one launch at a time)")
    p.add_argument("--gpu-memory-limit", type=float, default=RunnerConfig.gpu_memory_limit, metavar="GiB",
                   help="run as on a card this size")
    p.add_argument("--expert-dtype", nargs="+", default=[ExpertOptions.expert_dtype], choices=EXPERT_DTYPES,
                   help="expert formats to compare, e.g. bf16 fp8 nvfp4 mxfp4 (each its own store and runner)")
    p.add_argument("--routing", default=RoutingOptions.routing, help="model, synthetic (dummy weights) or replay:FILE")
    p.add_argument("--lent-slots", nargs="+", default=[ExpertOptions.lent_slots], choices=LENT_SLOT_RULES,
                   help="what decode does with the prefill pipeline's lent slots; several: one row each")
    add_miss_args(p)
    p.add_argument("--gpus", type=int, nargs="+", default=[1],
                   help="GPU counts to compare by expert parallelism, e.g. 1 2 (the cache fraction is per GPU)")
    p.add_argument("--prefill-every", type=int, default=0, metavar="STEPS",
                   help="every STEPS decode steps another request's prompt is prefilled between them (0: never)")
    p.add_argument("--prefill-tokens", type=int, default=1024, help="that prompt's tokens")
    p.add_argument("--pdl", nargs="+", default=["on"], choices=["on", "off"],
                   help="programmatic dependent launch of the Triton kernels (sm90+; off: SLUICE_PDL=0)")
    p.add_argument("--sampling", nargs="+", default=["greedy"], choices=["greedy", "sampled"],
                   help="how every request samples: greedy, or sampled (temperature 0.8, top-p 0.9; the "
                        "decode graph captures both paths, a sampled row draws by rejection); several: rows each")
    p.add_argument("--top-kernels", type=int, default=0, metavar="N",
                   help="print the N kernels that add the most GPU-busy time per decode step (under PDL the "
                        "part of each past the kernels before it), per row")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"],
                   help="cpu: the same steps on the host, for the tests (times meaningless)")
    p.add_argument("--json")
    return p.parse_args()


def print_top_kernels_of(rows: list[dict]) -> None:
    for r in rows:
        print_top_kernels(f"{r['fraction']:.0%} cache, {r['experts']}, fill {r['fill']}, {r['sampling']}, "
                          f"batch {r['batch']}: {r['kernels']:.0f} kernels, {r['busy_ms']:.2f} ms GPU-busy per step",
                          r["top_kernels"])


def main() -> None:
    args = parse_args()
    rows = []
    for gpus, fraction, expert_dtype, lent in itertools.product(args.gpus, args.fractions, args.expert_dtype,
                                                                args.lent_slots):
        offloaded = fraction < 1.0  # resident rows fetch nothing: one row for any prefetch or fill
        for prefetch, fill, pdl in itertools.product(args.prefetch if offloaded else args.prefetch[:1],
                                                     args.fill if offloaded else args.fill[:1], args.pdl):
            os.environ[PDL_ENV] = "1" if pdl == "on" else "0"  # read at each launch, so at the graphs' capture
            rows += [dict(r, pdl=pdl) for r in bench_runner(args, fraction, expert_dtype, lent, prefetch, fill, gpus)]
            if args.json:  # after every runner: a run cut short keeps its rows
                Path(args.json).write_text(json.dumps(rows, indent=1))
    resident_bounds_from_lookups(rows)
    decode_ceilings(rows)
    device = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    print(f"decode, {args.model}, {device}, "
          f"{args.decode_tokens} tokens (the median run), KV {args.kv_cache_dtype}, "
          f"policy {args.policy}, "
          f"cuda graphs {'off' if args.no_cuda_graph else 'on'}, "
          f"routing {args.routing}, misses gathered by {args.gather_programs or 'the wide grid of'} programs, "
          f"their scales by {args.scale_programs or 'the wide grid of'} programs{switches()}")
    print_table(COLUMNS, [dict(r, mb_per_token=r["bytes_per_token"] / 1e6,
                               guess_mb_per_token=r["prefetch_bytes_per_token"] / 1e6) for r in rows])
    if args.top_kernels:
        print_top_kernels_of(rows)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
