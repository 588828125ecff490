"""Prefill by expert parallelism, 1 GPU against N: seconds per chunk, PCIe GB per link and the
ratio to the N-link bound, at the same expert cache per GPU.

    python scripts/bench_expert_parallel.py [--model qwen3-30b-geometry] [--gpus 1 2] [--fraction 0.25]
        [--chunk 8192] [--turn 2048] [--prefix 131072] [--routing model|synthetic] [--json FILE]

Two cases, as in issue 17: a fresh chunk of ``--chunk`` tokens, and a turn of ``--turn`` tokens
over a cached prefix of ``--prefix`` tokens (prefilled untimed). Everything goes through
``runner.forward``, so every rank runs the same steps; each case runs once untimed, then timed. The
PCIe bytes are rank 0's (its link: each rank stages only its share of a layer); the bound is those
bytes at 55 GB/s, and ``speedup`` is against the first ``--gpus`` count. Decode at batch 1 and 8 is
``scripts/bench_decode.py --gpus 1 2``.
"""
from __future__ import annotations

import argparse
import time

import torch

from worker.batch import SequenceChunk
from worker.distributed.parallel_runner import start_runner
from worker.expert_placement import ExpertOptions
from worker.geometry import GEOMETRIES
from worker.routing_options import RoutingOptions
from worker.runner import ModelRunner, RunnerConfig
from scheduler.messages.to_scheduler import SamplingParams
from report_table import bench_parser, print_table, write_json  # beside this script

PCIE_BYTES_PER_S = 55e9


def timed_chunk(runner: ModelRunner, tokens: list[int], prefix: int, pages: list[int]) -> tuple[float, int]:
    """Seconds of one chunk and the bytes rank 0's pipeline staged from the host meanwhile."""
    pipeline = runner.experts.pipeline
    before = pipeline.stats()["bytes_h2d"]
    torch.cuda.synchronize()
    start = time.perf_counter()
    runner.forward([SequenceChunk(tokens, prefix, pages)], [SamplingParams()], [0])
    torch.cuda.synchronize()
    return time.perf_counter() - start, pipeline.stats()["bytes_h2d"] - before


def bench_gpus(args: argparse.Namespace, gpus: int) -> list[dict]:
    longest = max(args.chunk, args.turn)
    experts = ExpertOptions(cache_fraction=args.fraction, dummy_weights=args.model in GEOMETRIES)
    runner = start_runner(RunnerConfig(args.model, device="cuda", dtype="bfloat16",
                                       kv_tokens=args.prefix + longest + 16, max_prefill_tokens=longest, experts=experts,
                                       routing=RoutingOptions(args.routing), gpus=gpus))
    try:
        if getattr(runner.experts, "pipeline", None) is None:
            raise SystemExit(f"cache fraction {args.fraction}: no prefill pipeline (fully resident, or below 3E slots)")
        vocab = runner.model_config.vocab_size
        prompt = torch.randint(0, vocab, (args.prefix + longest,), generator=torch.Generator().manual_seed(0)).tolist()
        pages = runner.kv_pool.allocate(runner.kv_pool.pages_for(len(prompt)))
        cases = [("chunk", args.chunk, 0), ("turn", args.turn, args.prefix)]
        rows = []
        for name, tokens, prefix in cases:
            for pos in range(0, prefix, longest):  # the cached prefix, untimed
                runner.forward([SequenceChunk(prompt[pos:min(pos + longest, prefix)], pos, pages)],
                               [SamplingParams()], [0])
            timed_chunk(runner, prompt[prefix:prefix + tokens], prefix, pages)  # warm-up
            seconds, link_bytes = timed_chunk(runner, prompt[prefix:prefix + tokens], prefix, pages)
            bound = link_bytes / PCIE_BYTES_PER_S
            rows.append(dict(gpus=gpus, case=name, tokens=tokens, prefix=prefix, seconds=seconds,
                             link_gb=link_bytes / 1e9, bound_s=bound, ratio=bound / seconds))
        return rows
    finally:
        runner.close()
        del runner
        torch.cuda.empty_cache()


def main() -> None:
    p = bench_parser(__doc__)
    p.add_argument("--model", default="qwen3-30b-geometry")
    p.add_argument("--gpus", type=int, nargs="+", default=[1, 2])
    p.add_argument("--fraction", type=float, default=0.25, help="expert cache per GPU, as a fraction of all experts")
    p.add_argument("--chunk", type=int, default=8192)
    p.add_argument("--turn", type=int, default=2048)
    p.add_argument("--prefix", type=int, default=131072)
    p.add_argument("--routing", default="model", help="model, synthetic (dummy weights) or replay:FILE")
    args = p.parse_args()
    rows = [row for gpus in args.gpus for row in bench_gpus(args, gpus)]
    base = {r["case"]: r["seconds"] for r in rows if r["gpus"] == args.gpus[0]}
    print(f"prefill by expert parallelism, {args.model}, {torch.cuda.get_device_name()}, cache {args.fraction:.0%} "
          f"per GPU, routing {args.routing}, bound = rank 0's PCIe bytes / 55 GB/s")
    for r in rows:
        r["speedup"] = base[r["case"]] / r["seconds"]
    print_table([("gpus", "gpus", ">4"), ("case", "case", ">6"), ("tokens", "tokens", ">6"), ("prefix", "prefix", ">7"),
                 ("s", "seconds", ">7.3f"), ("link GB", "link_gb", ">8.2f"), ("bound s", "bound_s", ">8.3f"),
                 ("ratio", "ratio", ">6.3f"), ("speedup", "speedup", ">7.2f")], rows)
    write_json(args.json, rows)


if __name__ == "__main__":
    main()
