"""Prefill under expert offload through the prefill-overlap pipeline: seconds per chunk, tokens/s,
bytes over PCIe and HBM, and the ratio to the bound max(PCIe bytes / 55 GB/s, FLOPs / 7.9e14),
for each chunk size, cache fraction, invalidation mode, with and without a cached prefix.

    python scripts/bench_prefill.py [--model qwen3-30b-geometry | qwen3.5-35b-a3b-geometry] [--fractions 0.25 0.5]
        [--chunks 8192 16384 32768] [--prefix 65536] [--invalidate fixed eager] [--memcpy] [--misses] [--mirror] [--auto]
        [--expert-dtype bf16 fp8 nvfp4 mxfp4] [--json FILE] [--device cpu]

Runs with ``--dummy-weights`` unless --model is a checkpoint directory. Before timing, the decode
part of the cache (slots [2E, S)) is filled evenly across layers, as a decode phase would leave it;
its experts reach the buffer device-to-device, the rest cross PCIe. With --prefix, a prefix of that
many tokens is prefilled once (untimed), then each timed chunk attends over it; a combination that
does not fit in memory is reported as "oom". ``--attention torch`` times the reference attention
backend instead of the paged Triton kernel. Rows "fixed"/"eager" stage through the kernel (hits on
the GPU, misses over PCIe); "memcpy" moves whole layers by the copy engine; "misses" moves only the
misses by the copy engine (a conditional copy per expert, hits read in place); "mirror" moves the
misses by the copy engine as the host's mirror of the cache table plans them (hits read in place,
the mirror's errors repaired by a gather); "auto" is what serving does (the choice per chunk, shown
as auto-kernel, auto-memcpy, ...). First a short table compares the
stage kernel (zero-copy reads of the mapped store, all misses) with a copy-engine copy of a layer.
Each ``--expert-dtype`` gets its own runner and rows (fp8: the experts quantized 128x128, half the
slot bytes, so the same fraction of experts takes half the cache memory); the PCIe bound counts
the bytes actually staged, fp8 weights plus their scales (4-bit: nvfp4 / mxfp4 quantized at fill,
packed weights plus group scales, about 3.6x fewer bytes than bf16). A hybrid model (qwen3.5-35b-a3b-geometry)
prefills its one sequence in a recurrent-state slot; a chunk after the cached prefix starts from a
copy of the prefix's state, restored (untimed) before each run. ``--device cpu`` runs the same steps
on the host (the tests' end-to-end check; its times mean nothing).
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import NamedTuple

import torch

from moe_offload.choices import EXPERT_DTYPES, INVALIDATE_MODES
from moe_offload.expert_records import whole_records
from moe_offload.kernels.stage_experts import stage_experts
from moe_offload.offloaded import OffloadedExperts
from moe_offload.prefill_pipeline import PrefillPipeline
from worker.batch import SequenceChunk
from worker.expert_placement import ExpertOptions
from worker.geometry import GEOMETRIES
from worker.runner import ModelRunner, RunnerConfig
from worker.runner_config import ATTENTION_BACKENDS, KV_CACHE_DTYPES
from scheduler.messages.to_scheduler import SamplingParams
from kernel_profile import busy_us, cuda_kernels, print_top_kernels, top_kernels  # beside this script
from report_table import print_table, switches

PCIE_BYTES_PER_S = 55e9
FLOPS_PER_S = 7.9e14
PREFIX_CHUNK = 16384  # writes the cached prefix; keeps the reference attention's [q, k] mask small if chosen


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def warm_cache(experts: OffloadedExperts, seed: int) -> None:
    """Fill the decode slots [2E, S) with experts spread evenly over the layers."""
    cache, lent = experts.cache, experts.pipeline.lent
    gen = torch.Generator().manual_seed(seed)
    usable, layers = cache.num_slots - lent, cache.num_layers
    for layer in range(layers):
        count = usable // layers + (layer < usable % layers)
        ids = torch.randperm(cache.num_experts, generator=gen)[:count].view(-1, 1).to(cache.w13.device)
        plan, _ = cache.lookup(layer, ids, slot_start=lent)
        cache.fill(plan, experts.host_w13, experts.host_w2, experts.host_scales)
    cache.reset_stats()


def stage_bandwidth(experts: OffloadedExperts, programs: list[int], reps: int = 4) -> list[dict]:
    """GB/s of staging whole layers from the host: the stage kernel with every expert a miss (lent
    = S), and the copy engine moving the layer's records (its banks one by one where not records)."""
    cache, num_experts = experts.cache, experts.cache.num_experts
    host = experts.store.host_banks()  # pinned (registered) CPU views: what cudaMemcpyAsync reads
    host_banks = [b.view(-1, *b.shape[2:]) for b in host.tensors()]
    pools = [cache.w13, cache.w2, *(cache.scales.tensors() if cache.scales is not None else ())]
    device_host = [experts.host_w13, experts.host_w2,
                   *(experts.host_scales.tensors() if experts.host_scales is not None else ())]
    scratch = torch.zeros(cache.num_layers, 2, dtype=torch.int64, device="cuda")
    layer_bytes = num_experts * cache.slot_bytes

    def timed(fn) -> float:
        fn(0)
        torch.cuda.synchronize()
        start = time.perf_counter()
        for rep in range(reps):
            fn(1 + rep % (cache.num_layers - 1))
        torch.cuda.synchronize()
        return reps * layer_bytes / (time.perf_counter() - start) / 1e9

    scales = [(pool, bank, pool[:num_experts]) for pool, bank in zip(pools[2:], device_host[2:])]  # quantized only
    rows = []
    for n in programs:
        gbs = timed(lambda layer: stage_experts(layer, num_experts, cache.num_slots, cache.tables.slot_for_id,
                                                cache.w13, cache.w2, experts.host_w13, experts.host_w2,
                                                cache.w13[:num_experts], cache.w2[:num_experts], scratch, programs=n,
                                                scales=scales))
        rows.append({"method": f"stage kernel, {n} CTAs", "GB/s": gbs})

    # the store's and the cache's expert records: a layer in one copy
    pairs = whole_records(list(zip(host_banks, (pool[:num_experts] for pool in pools))))

    def memcpy(layer: int) -> None:
        ids = slice(layer * num_experts, (layer + 1) * num_experts)
        for bank, pool in pairs:
            pool.copy_(bank[ids], non_blocking=True)

    rows.append({"method": "cudaMemcpyAsync, whole layer", "GB/s": timed(memcpy)})
    return rows


def hbm_bytes(runner: ModelRunner, staged: dict, tokens: int, prefix: int) -> float:
    """Expert traffic (the buffer's writes, reads of the hits copied into it, one GEMM read of every
    expert: the "misses" stage writes only its misses and reads hits in place), one read of the KV
    the chunk attends over (full-attention layers only), and one read and write of the sequence's
    recurrent state (hybrid models); activations are not counted."""
    cfg, cache = runner.model_config, runner.experts.cache
    experts = cfg.num_layers * cfg.num_experts * cache.slot_bytes
    kv = cfg.num_kv_layers * 2 * (prefix + tokens) * cfg.kv_size * runner.dtype.itemsize
    state = 2 * runner.state_pool.slot_bytes if runner.state_pool is not None else 0
    written = staged["from_cache"] + staged["from_host"]
    return experts + (written + staged["from_cache"]) * cache.slot_bytes + kv + state


class Sequence(NamedTuple):
    """The one sequence the benchmark prefills: its KV pages and, in a hybrid model, its state slot
    and a snapshot slot that keeps the state after the cached prefix (-1: none)."""

    pages: list[int]
    slot: int = -1
    snapshot: int = -1

    @classmethod
    def allocate(cls, runner: ModelRunner, tokens: int) -> Sequence:
        pool, states = runner.kv_pool, runner.state_pool
        pages = pool.allocate(pool.pages_for(tokens))
        if states is None:
            return cls(pages)
        return cls(pages, states.running_slot(0), states.allocate(1)[0])

    def save_state(self, runner: ModelRunner) -> None:
        if self.slot >= 0:
            runner.state_pool.copy([self.slot], [self.snapshot])

    def restore_state(self, runner: ModelRunner) -> None:
        """The state after the prefix again (the last run advanced it past its chunk)."""
        if self.slot >= 0:
            runner.state_pool.copy([self.snapshot], [self.slot])


def window_pages(runner: ModelRunner, pages: list[int]) -> list[int] | None:
    """gpt-oss's sliding layers: the sequence's logical pages folded into the window pool in order
    (a ring), so the pages a chunk and its window use stay apart however long the prefix."""
    pool = runner.window_pool
    return None if pool is None else [1 + i % (pool.num_pages - 1) for i in range(len(pages))]


def run_chunk(runner: ModelRunner, tokens: list[int], prefix: int, seq: Sequence) -> float:
    sync()
    start = time.perf_counter()
    chunk = SequenceChunk(tokens, prefix, seq.pages, state_slot=seq.slot, window_pages=window_pages(runner, seq.pages))
    runner.forward([chunk], [SamplingParams()], [0])
    sync()
    return time.perf_counter() - start


def measure(runner: ModelRunner, pipelines: dict[str, PrefillPipeline], chunk: int, prefix: int,
            prompt: list[int], seq: Sequence, warmup: int, fraction: float, top: int = 0) -> list[dict]:
    """A row per staging way: one timed run of the chunk after a run that compiles its kernels;
    ``top``: then one more under the profiler, for its ``top`` kernels by the busy time they add."""
    experts, default = runner.experts, runner.experts.pipeline
    rows = []

    def run() -> float:
        if prefix:  # each run starts after the prefix, not after the last run's chunk
            seq.restore_state(runner)
        return run_chunk(runner, prompt[prefix:prefix + chunk], prefix, seq)

    try:
        for _ in range(warmup):
            run()
        for mode, pipeline in pipelines.items():
            experts.pipeline = pipeline
            run()  # each way's own kernel specialisations compile outside the clock
            before = pipeline.stats()
            seconds = run()
            staged = {k: v - before[k] for k, v in pipeline.stats().items()}
            rows.append(chunk_row(runner, mode, staged, seconds, chunk, prefix, fraction))
            if top:
                spans = cuda_kernels(run)
                rows[-1].update(busy_s=busy_us([span[1:] for span in spans]) / 1e6,
                                top_kernels=top_kernels(spans, top))
    except torch.OutOfMemoryError:
        torch.cuda.empty_cache()
        rows.append(dict(fraction=fraction, experts=runner.expert_format.name, invalidate="-", chunk=chunk,
                         prefix=prefix, oom=True))
    finally:
        experts.pipeline = default
    return rows


def chunk_row(runner: ModelRunner, mode: str, staged: dict, seconds: float, chunk: int, prefix: int,
              fraction: float) -> dict:
    """A timed chunk's row: its time and rate, what it staged, and its bound."""
    pcie_s = staged["bytes_h2d"] / PCIE_BYTES_PER_S
    flops_s = runner.model_config.forward_flops([chunk], [prefix]) / FLOPS_PER_S
    hits = staged["from_cache"] + staged["in_place"]
    if mode == "auto":  # which way it went
        mode = next(f"auto-{m}" for m in ("misses", "mirror", "memcpy", "kernel") if staged[f"chunks_{m}"])
    return dict(fraction=fraction, experts=runner.expert_format.name, expert_mb=runner.experts.cache.slot_bytes / 1e6,
                invalidate=mode, chunk=chunk, prefix=prefix,
                seconds=seconds, tok_s=chunk / seconds, hit_rate=hits / max(hits + staged["from_host"], 1),
                pcie_gb=staged["bytes_h2d"] / 1e9, hbm_gb=hbm_bytes(runner, staged, chunk, prefix) / 1e9,
                copies=staged.get("mirror_copies", 0) / runner.model_config.num_layers,
                bound_s=max(pcie_s, flops_s), bound="pcie" if pcie_s >= flops_s else "flops",
                ratio=max(pcie_s, flops_s) / seconds)


def bench_pipelines(args: argparse.Namespace, experts: OffloadedExperts) -> dict[str, PrefillPipeline]:
    """The staging ways to time, by row name: the kernel under each invalidation mode, and the
    copy engine (``--memcpy``, ``--misses``) and the serving choice (``--auto``) when asked."""
    banks, scales = (experts.cache, experts.host_w13, experts.host_w2), experts.host_scales
    pipelines = {mode: PrefillPipeline(*banks, mode, stage="kernel", host_scales=scales) for mode in args.invalidate}
    for programs in args.pipeline_programs:  # the stage kernel on fewer or more SMs than its default
        pipelines[f"fixed-p{programs}"] = PrefillPipeline(*banks, stage="kernel", host_scales=scales, programs=programs)
    if args.memcpy:  # the whole layer by the copy engine, hits included
        pipelines["memcpy"] = PrefillPipeline(*banks, stage="memcpy", host_scales=scales)
    if args.misses:  # the misses alone by the copy engine, hits read in place
        pipelines["misses"] = PrefillPipeline(*banks, stage="misses", host_scales=scales)
    if args.mirror:  # the same, planned on the host from the mirror of the table
        pipelines["mirror"] = PrefillPipeline(*banks, stage="mirror", host_scales=scales)
    if args.auto:  # the serving default: kernel or copy engine per chunk
        pipelines["auto"] = PrefillPipeline(*banks, stage="auto", host_scales=scales)
    return pipelines


def bench_fraction(args: argparse.Namespace, fraction: float, expert_dtype: str, stage_rows: list[dict]) -> list[dict]:
    longest = max(args.chunks)
    experts = ExpertOptions(cache_fraction=fraction, dummy_weights=args.model in GEOMETRIES, expert_dtype=expert_dtype)
    # one sequence: a hybrid model's state pool needs one running slot and one snapshot (the prefix's)
    runner = ModelRunner(RunnerConfig(args.model, device=args.device, dtype="auto",
                                      kv_tokens=args.prefix + longest + 16, max_prefill_tokens=longest,
                                      experts=experts, attention=args.attention, kv_cache_dtype=args.kv_cache_dtype,
                                      gpu_memory_limit=args.gpu_memory_limit, state_slots=1, state_snapshots=1))
    experts = runner.experts
    if not isinstance(experts, OffloadedExperts) or experts.pipeline is None:
        raise SystemExit(f"cache fraction {fraction}: no prefill pipeline (fully resident, or below 3E slots)")
    pipelines = bench_pipelines(args, experts)
    warm_cache(experts, seed=1)
    vocab = runner.model_config.vocab_size
    prompt = torch.randint(0, vocab, (args.prefix + longest,), generator=torch.Generator().manual_seed(0)).tolist()
    seq = Sequence.allocate(runner, len(prompt))
    run_chunk(runner, prompt[:1024], 0, seq)  # compile the kernels
    staged_before = any(r["experts"] == runner.expert_format.name for r in stage_rows)
    if args.stage_programs and args.device == "cuda" and not staged_before:
        # after a chunk has touched every layer: run before any chunk on an H200 it gave 7-9 GB/s,
        # while the pipeline's chunks imply >= 50 GB/s; a slow first touch of the registered
        # segment is the suspected cause (not yet confirmed)
        fmt = runner.expert_format.name
        stage_rows += [{"experts": fmt, **r} for r in stage_bandwidth(experts, args.stage_programs)]
    rows = []
    for chunk in args.chunks:
        rows += measure(runner, pipelines, chunk, 0, prompt, seq, args.warmup, fraction, args.top_kernels)
    if args.prefix:
        for pos in range(0, args.prefix, PREFIX_CHUNK):  # the cached prefix, untimed
            run_chunk(runner, prompt[pos:min(pos + PREFIX_CHUNK, args.prefix)], pos, seq)
        seq.save_state(runner)
        for chunk in args.chunks:
            rows += measure(runner, pipelines, chunk, args.prefix, prompt, seq, args.warmup, fraction,
                            args.top_kernels)
    del runner, experts, pipelines
    torch.cuda.empty_cache()
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="qwen3-30b-geometry")
    p.add_argument("--fractions", type=float, nargs="+", default=[0.25, 0.5])
    p.add_argument("--chunks", type=int, nargs="+", default=[8192, 16384, 32768])
    p.add_argument("--prefix", type=int, default=65536, help="cached prefix tokens (0: none)")
    p.add_argument("--invalidate", nargs="+", default=list(INVALIDATE_MODES), choices=INVALIDATE_MODES)
    p.add_argument("--attention", default=RunnerConfig.attention, choices=["auto", *ATTENTION_BACKENDS])
    p.add_argument("--memcpy", action="store_true", help="also stage whole layers with the copy engine (row 'memcpy')")
    p.add_argument("--pipeline-programs", type=int, nargs="*", default=[],
                   help="also rows 'fixed-pN': the chunk staged by the kernel on N CTAs (default 32)")
    p.add_argument("--mirror", action="store_true",
                   help="also stage the misses by the copy engine as the host's mirror of the table plans them "
                        "(row 'mirror')")
    p.add_argument("--misses", action="store_true",
                   help="also stage only the misses with the copy engine (row 'misses': conditional copy graphs)")
    p.add_argument("--auto", action="store_true", help="also the per-chunk choice serving uses (row 'auto')")
    p.add_argument("--warmup", type=int, default=1, help="untimed runs per chunk size and prefix")
    p.add_argument("--stage-programs", type=int, nargs="*", default=[16, 32, 64, 132],
                   help="CTA counts of the stage-kernel bandwidth table (none: skip it)")
    p.add_argument("--expert-dtype", nargs="+", default=["auto"], choices=EXPERT_DTYPES,
                   help="expert formats to compare, e.g. bf16 fp8 nvfp4 mxfp4 (each its own store and runner)")
    p.add_argument("--kv-cache-dtype", default=RunnerConfig.kv_cache_dtype, choices=KV_CACHE_DTYPES,
                   help="what the KV pool holds (fp8: float8 e4m3; the cached prefix is cast as it is read)")
    p.add_argument("--gpu-memory-limit", type=float, default=RunnerConfig.gpu_memory_limit, metavar="GiB",
                   help="run as on a card this size")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"],
                   help="cpu: the same steps on the host, for the tests (no stage table, times meaningless)")
    p.add_argument("--top-kernels", type=int, default=0, metavar="N",
                   help="also profile each row's chunk once more: its N kernels by the GPU-busy time they add")
    p.add_argument("--json")
    args = p.parse_args()
    stage_rows: list[dict] = []
    rows = []
    for fraction in args.fractions:
        for expert_dtype in args.expert_dtype:
            rows += bench_fraction(args, fraction, expert_dtype, stage_rows)
    print_report(args, stage_rows, rows)
    if args.json:
        Path(args.json).write_text(json.dumps({"stage": stage_rows, "chunks": rows}, indent=1))


STAGE_COLUMNS = [("experts", "experts", ">12"), ("staging one layer from the host", "method", "<32"),
                 ("GB/s", "GB/s", ">6.1f")]


def print_report(args: argparse.Namespace, stage_rows: list[dict], rows: list[dict]) -> None:
    device = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    sizes = ", ".join(sorted({f"{r['experts']} {r['expert_mb']:.3g} MB" for r in rows if "expert_mb" in r}))
    print(f"prefill, {args.model}, {device}, attention {args.attention}, KV {args.kv_cache_dtype}, experts of {sizes} each, "
          f"bound = max(PCIe / 55 GB/s, FLOPs / 7.9e14){switches()}")
    if stage_rows:
        print_table(STAGE_COLUMNS, stage_rows)
    print(f"{'cache':>6} {'experts':>12} {'inval':>6} {'chunk':>6} {'prefix':>6} {'s/chunk':>8} {'tok/s':>8} "
          f"{'hits':>5} {'PCIe GB':>8} {'HBM GB':>7} {'copies':>6} {'bound s':>8} {'bound':>5} {'ratio':>6}")
    for r in rows:
        head = f"{r['fraction']:>6.0%} {r['experts']:>12} {r['invalidate']:>6} {r['chunk']:>6} {r['prefix']:>6}"
        if r.get("oom"):
            print(f"{head} {'out of memory':>40}")
            continue
        print(f"{head} {r['seconds']:>8.3f} {r['tok_s']:>8.0f} {r['hit_rate']:>5.2f} {r['pcie_gb']:>8.1f} "
              f"{r['hbm_gb']:>7.1f} {r['copies']:>6.1f} {r['bound_s']:>8.3f} {r['bound']:>5} {r['ratio']:>6.3f}")
    for r in rows:
        if r.get("top_kernels"):
            print_top_kernels(f"{r['fraction']:.0%} cache, {r['experts']}, {r['invalidate']}, {r['chunk']} over "
                              f"{r['prefix']}: {r['busy_s']:.3f} s GPU-busy (profiled)", r["top_kernels"])


if __name__ == "__main__":
    main()
