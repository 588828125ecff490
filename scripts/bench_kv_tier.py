"""Time to first token of returning agent sessions with the host KV tier against recomputing them,
and the host->GPU page bandwidth against PCIe (55.3 GB/s measured on the reference H200).

    python scripts/bench_kv_tier.py [--model DIR|qwen3-30b-geometry --dummy-weights --moe-cache-fraction 0.25]
                                    [--kv-tokens 16384] [--sessions 6] [--rounds 3] [--json PATH]

N sessions whose contexts add up to 3x the GPU KV pool take turns round-robin, so each returning
session finds its prefix evicted: restored from the host (writeback / writethrough) or recomputed
(host tier disabled). A copy micro-benchmark compares the two page-move paths: the zero-copy Triton
kernel and one cudaMemcpyAsync per layer and contiguous run, over contiguous and scattered pages.
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from dataclasses import replace
from pathlib import Path

import torch

from scheduler.engine import Engine, EngineConfig
from scheduler.request import Request
from worker.cli_options import add_runner_args, resolve_model, runner_config
from worker.kv.host_pool import HostKVPool
from worker.kv.gpu_pool import KVPool
from worker.kv.page_copy import COPY_METHODS
from worker.runner import ModelRunner
from scheduler.messages.to_scheduler import SamplingParams
from report_table import print_table  # beside this script

PCIE_BYTES_PER_S = 55.3e9
MODES = {  # name -> (host tier on, mode, copy method)
    "recompute": (False, "writeback", "kernel"),
    "writeback": (True, "writeback", "kernel"),
    "writethrough": (True, "writethrough", "kernel"),
    "writeback-memcpy": (True, "writeback", "memcpy"),
}


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ==== page-move micro-benchmark ====

def time_copy(device: torch.device, fn, repeats: int = 5) -> float:
    fn()  # warm-up (compiles the kernel)
    sync(device)
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    sync(device)
    return (time.perf_counter() - start) / repeats


def copy_rows(runner: ModelRunner, num_pages: int) -> list[dict]:
    if num_pages == 0:
        return []
    pool = runner.kv_pool
    host = HostKVPool.like(pool, num_pages * pool.page_bytes)
    num_pages = min(num_pages, pool.capacity, host.capacity)
    rows = []
    for layout in ("contiguous", "scattered"):
        src = list(range(num_pages))
        dst = list(range(1, num_pages + 1))
        if layout == "scattered":
            random.Random(0).shuffle(src)
            random.Random(1).shuffle(dst)

        for method in COPY_METHODS:
            seconds = time_copy(runner.device, lambda: host.load_into(pool, src, dst, method))
            gbps = num_pages * pool.page_bytes / seconds / 1e9
            rows.append(dict(layout=layout, method=method, pages=num_pages, ms=seconds * 1e3, gb_per_s=gbps,
                             bound_gb_per_s=PCIE_BYTES_PER_S / 1e9, ratio=gbps * 1e9 / PCIE_BYTES_PER_S))
    return rows


def kernel_move(pool: KVPool, host: HostKVPool, direction: str, src: list[int], dst: list[int]) -> None:
    """Pages by the zero-copy kernels, as the tier moves them: ``write`` GPU -> host, ``load`` back."""
    if direction == "write":
        host.write_from(pool, src, dst)
    else:
        host.load_into(pool, src, dst)


def first_touch_rows(runner: ModelRunner, num_pages: int) -> list[dict]:
    """Each kernel once on host pages no kernel has touched yet, then again on the same pages: a gap
    is a cost that the first eviction or restore through fresh host pages pays."""
    pool = runner.kv_pool
    num_pages = min(num_pages, pool.capacity)
    compile_pool = HostKVPool.like(pool, 2 * pool.page_bytes)
    kernel_move(pool, compile_pool, "write", [1, 2], [0, 1])
    kernel_move(pool, compile_pool, "load", [0, 1], [1, 2])
    host = HostKVPool.like(pool, num_pages * pool.page_bytes)
    gpu_pages, host_pages = list(range(1, num_pages + 1)), list(range(num_pages))
    rows = []
    for direction in ("write", "load"):
        src, dst = (gpu_pages, host_pages) if direction == "write" else (host_pages, gpu_pages)
        for touch in ("first", "again"):
            sync(runner.device)
            start = time.perf_counter()
            kernel_move(pool, host, direction, src, dst)
            sync(runner.device)
            gbps = num_pages * pool.page_bytes / (time.perf_counter() - start) / 1e9
            rows.append(dict(direction=direction, touch=touch, pages=num_pages, gb_per_s=gbps,
                             ratio=gbps * 1e9 / PCIE_BYTES_PER_S))
    return rows


# ==== returning sessions ====

def run_turn(engine: Engine, req: Request) -> float:
    """Seconds from submitting ``req`` to its first token on the host (it then runs to the end)."""
    sync(engine.device)
    start = time.perf_counter()
    assert engine.submit(req) is None
    first = None
    while engine.has_work:
        engine.step()
        if first is None and req.output:
            first = time.perf_counter() - start
    return first


def drain(engine: Engine) -> None:
    """Hand every cached page back to the pool, so the next engine starts from an empty one."""
    pages = engine.pages
    freed, _ = pages.radix.evict(pages.pool.capacity, lambda node: None)
    pages.pool.free(freed)


def warm_up(runner: ModelRunner, args: argparse.Namespace) -> None:
    """Compile every kernel a turn uses before any is timed: a prompt, then a turn over its cached
    prefix (the paged prefill attention), each decoding, so no mode pays the first compilation."""
    engine = Engine(runner, plan=replace(runner.plan, host_kv_bytes=0))
    prompt = random.Random(3).choices(range(runner.model_config.vocab_size), k=4 * runner.page_size)
    for rid, tokens in (("warm-up", prompt), ("warm-up 2", prompt + prompt[:args.new_tokens])):
        run_turn(engine, Request(rid, tokens, SamplingParams(), args.decode_tokens, frozenset(), ignore_eos=True))
    drain(engine)


def session_rows(runner: ModelRunner, args: argparse.Namespace) -> list[dict]:
    pool, vocab = runner.kv_pool, runner.model_config.vocab_size
    pool_tokens = pool.capacity * pool.page_size
    context = 3 * pool_tokens // args.sessions - args.rounds * (args.new_tokens + args.decode_tokens)
    if context < pool.page_size or context + args.rounds * (args.new_tokens + args.decode_tokens) > pool_tokens:
        raise SystemExit(f"{args.sessions} sessions of 3x{pool_tokens}/{args.sessions} tokens do not fit the "
                         "pool one at a time: use more sessions or fewer rounds")
    host_gib = 4 * pool.capacity * pool.page_bytes / 2**30  # room for every session
    warm_up(runner, args)
    rows = []
    for name in args.modes:
        tier_on, mode, method = MODES[name]
        engine = Engine(runner, EngineConfig(kv_tier_mode=mode, kv_tier_copy=method),
                        plan=replace(runner.plan, host_kv_bytes=int(host_gib * 2**30) if tier_on else 0))
        gen = random.Random(7)
        history = [[gen.randrange(vocab) for _ in range(context)] for _ in range(args.sessions)]
        ttft: list[float] = []
        for rnd in range(args.rounds):
            for s in range(args.sessions):
                prompt = history[s] + [gen.randrange(vocab) for _ in range(args.new_tokens)]
                req = Request(f"{s}.{rnd}", prompt, SamplingParams(), args.decode_tokens, frozenset(), ignore_eos=True)
                seconds = run_turn(engine, req)
                if rnd > 0:  # round 0 fills the caches
                    ttft.append(seconds)
                history[s] = prompt + req.output
        engine.check_pages()
        rows.append(session_row(name, ttft, engine.stats()))
        drain(engine)
    base = next((r["ttft_ms"] for r in rows if r["mode"] == "recompute"), None)
    for r in rows:
        r["speedup"] = base / r["ttft_ms"] if base else float("nan")
    return rows


COPY_COLUMNS = [("layout", "layout", ">10"), ("method", "method", ">7"), ("pages", "pages", ">6"),
                ("ms", "ms", ">8.2f"), ("GB/s", "gb_per_s", ">7.1f"), ("bound", "bound_gb_per_s", ">6.1f"),
                ("ratio", "ratio", ">6.3f")]
TOUCH_COLUMNS = [("kernel", "direction", ">10"), ("host pages", "touch", ">10"), ("pages", "pages", ">6"),
                 ("GB/s", "gb_per_s", ">7.1f"), ("ratio", "ratio", ">6.3f")]
SESSION_COLUMNS = [("mode", "mode", ">16"), ("TTFT ms", "ttft_ms", ">9.1f"), ("speedup", "speedup", ">8.2f"),
                   ("cached", "cached_share", ">7.2f"), ("restored", "pages_restored", ">9"),
                   ("written", "pages_written", ">8"), ("write GB/s", "write_gb_per_s", ">10.1f"),
                   ("restore GB/s", "restore_gb_per_s", ">12.1f"), ("bound", "bound_gb_per_s", ">6.1f"),
                   ("ratio", "ratio", ">6.3f")]


def session_row(mode: str, ttft: list[float], stats: dict) -> dict:
    """One mode's timed turns and what its KV tier moved (speedup is filled in against recompute)."""
    restore = stats.get("kv_host_restore_gb_per_s", 0.0)
    return dict(mode=mode, turns=len(ttft), ttft_ms=statistics.mean(ttft) * 1e3,
                turn_ms=[round(t * 1e3, 1) for t in ttft], write_gb_per_s=stats.get("kv_host_write_gb_per_s", 0.0),
                cached_share=stats["cached_prompt_tokens"] / max(stats["prompt_tokens"], 1),
                pages_restored=stats.get("kv_host_pages_restored", 0),
                pages_written=stats.get("kv_host_pages_written", 0), restore_gb_per_s=restore,
                bound_gb_per_s=PCIE_BYTES_PER_S / 1e9, ratio=restore * 1e9 / PCIE_BYTES_PER_S)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    add_runner_args(p)
    p.set_defaults(kv_tokens=16384)  # a small GPU pool: the sessions are sized from it
    p.add_argument("--sessions", type=int, default=6, help="sessions; their contexts add up to 3x the GPU pool")
    p.add_argument("--rounds", type=int, default=3, help="round-robin rounds (the first one warms the caches)")
    p.add_argument("--new-tokens", type=int, default=64, help="new prompt tokens per turn")
    p.add_argument("--decode-tokens", type=int, default=8, help="tokens generated per turn")
    p.add_argument("--copy-pages", type=int, default=2048, help="pages moved by the copy micro-benchmark (0: skip it)")
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    p.add_argument("--json", help="also write the rows to this file")
    args = p.parse_args()
    model_dir = resolve_model(args.model)
    runner = ModelRunner(runner_config(args, model_dir))
    copies = copy_rows(runner, args.copy_pages)
    touches = first_touch_rows(runner, args.copy_pages) if args.copy_pages else []
    turns = session_rows(runner, args)
    device = torch.cuda.get_device_name() if runner.device.type == "cuda" else "cpu"
    pool = runner.kv_pool
    print(f"model {model_dir} on {device}, {runner.dtype}; GPU pool {pool.capacity} pages of {pool.page_size} tokens "
          f"({pool.page_bytes / 1e6:.2f} MB/page); {args.sessions} sessions x {args.rounds} rounds")
    print_table(COPY_COLUMNS, copies, gap=True)
    if touches:
        print_table(TOUCH_COLUMNS, touches, gap=True)
    print_table(SESSION_COLUMNS, turns, gap=True)
    for r in turns:
        print(f"{r['mode']:>16} TTFT per timed turn (ms): {r['turn_ms']}")
    if args.json:
        Path(args.json).write_text(json.dumps(dict(copy=copies, first_touch=touches, sessions=turns), indent=1))


if __name__ == "__main__":
    main()
