"""Time copying a decode layer's cache misses from mapped host memory into their slots, against the
PCIe bound, on the qwen3-30b geometry (bf16 experts, 9.4 MB each).

    python scripts/bench_expert_fill.py [--misses 1 2 4 8] [--reps 12] [--sweep] [--json out.json]

Per count of misses m (of a batch-1 layer's k = 8 experts), each way of filling them:

- ``memcpy``: the copy engine, ``m`` host-to-device copies per bank (what a host-driven engine
  pays; not capturable without the host knowing the misses),
- ``gather``: ``gather_missing``, one launch per bank reading the host banks zero-copy,
- ``gemm``: the decode GEMM with the fill (``grouped_swiglu(fill=...)``): its gate_up launch copies
  the misses as it computes the hits; "GEMM alone" is the same GEMM with every expert a hit
  (replayed from a CUDA graph: launched from Python it would time the host; its slots stay in L2
  in part), so "fill us" (the row's time less it) is what the misses add.

``--sweep`` adds "gemm" rows for other tiles of the fill, each named by the ``DecodeConfig`` field it
changes: ``fill_k`` (the columns of a w13 copy step), ``fill_rows`` (the w2 rows of a copy program)
and ``pair_n`` (one token's gate_up columns: a missed expert's w13 is copied by ``I / pair_n``
programs).

Every rep copies other host experts (a host bank of 64 experts, 600 MB, pinned), so no read is
served by L2. Time per rep from CUDA events around ``--reps`` reps; bound = bytes / 55 GB/s
(pinned host-to-device, measured in DESIGN.md); ratio = bound / time.
"""
from __future__ import annotations

import sys
from pathlib import Path
from typing import NamedTuple

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from moe_offload.grouped import SlotFill, grouped_swiglu  # noqa: E402
from moe_offload.kernels.grouped_gemm_decode import DecodeConfig, decode_grouped_swiglu  # noqa: E402
from moe_offload.kernels.gather_missing import gather_missing  # noqa: E402
from moe_offload.kernels.lookup_admit import CopyPlan  # noqa: E402
from report_table import bench_parser, print_table, write_json  # noqa: E402  (beside this script)

PCIE_BYTES_PER_S = 55e9
HOST_EXPERTS = 64
SLOTS = 16
TOP_K = 8
SWEEP = [dict(fill_k=128), dict(fill_k=512), dict(fill_rows=8), dict(fill_rows=32), dict(pair_n=8), dict(pair_n=32)]


def plans(misses: int, reps: int) -> list[CopyPlan]:
    """A plan per rep: ``misses`` host experts (new ones every rep) into slots ``[0, misses)``."""
    out = []
    for rep in range(reps):
        src = torch.full((TOP_K,), -1, dtype=torch.int32)
        dst = src.clone()
        src[:misses] = torch.arange(rep * misses, (rep + 1) * misses, dtype=torch.int32) % HOST_EXPERTS
        dst[:misses] = torch.arange(misses, dtype=torch.int32)
        out.append(CopyPlan(src.cuda(), dst.cuda(), torch.tensor([misses], dtype=torch.int32, device="cuda")))
    return out


def timed(run, reps: int) -> float:
    """Microseconds per rep of ``run(rep)``, after an untimed ``run(reps)`` (other experts)."""
    run(reps)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for rep in range(reps):
        run(rep)
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / reps


def graph_timed(run, reps: int) -> float:
    """Microseconds per call of ``run()`` replayed from a CUDA graph of ``reps`` calls: a launch
    whose GPU time is shorter than the host's time to launch it is timed on the GPU."""
    run()  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            run()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / reps


class Banks(NamedTuple):
    """Host banks (pinned), the GPU slots they fill, and a batch-1 decode step's inputs."""
    host_w13: torch.Tensor
    host_w2: torch.Tensor
    w13: torch.Tensor
    w2: torch.Tensor
    hidden: torch.Tensor
    weights: torch.Tensor
    slots: torch.Tensor

    @property
    def expert_bytes(self) -> int:
        return (self.host_w13[0].numel() + self.host_w2[0].numel()) * self.host_w13.element_size()


def make_banks(dim: int, inter: int) -> Banks:
    gen = torch.Generator().manual_seed(0)
    host_w13 = (torch.randn(HOST_EXPERTS, 2 * inter, dim, generator=gen) * dim**-0.5).bfloat16().pin_memory()
    host_w2 = (torch.randn(HOST_EXPERTS, dim, inter, generator=gen) * inter**-0.5).bfloat16().pin_memory()
    w13 = torch.zeros(SLOTS, 2 * inter, dim, dtype=torch.bfloat16, device="cuda")
    w2 = torch.zeros(SLOTS, dim, inter, dtype=torch.bfloat16, device="cuda")
    slots = torch.arange(TOP_K, device="cuda").view(1, TOP_K)  # misses take slots [0, m), hits the rest
    return Banks(host_w13, host_w2, w13, w2, torch.randn(1, dim, device="cuda").bfloat16(),
                 torch.rand(1, TOP_K, device="cuda"), slots)


def fill_ways(b: Banks, misses: int, plan: list, sweep: bool) -> dict:
    """Each way of bringing ``misses`` experts in, as a function of the repetition."""
    def memcpy(rep: int) -> None:
        for j, src in enumerate(range(rep * misses, (rep + 1) * misses)):
            b.w13[j].copy_(b.host_w13[src % HOST_EXPERTS], non_blocking=True)
            b.w2[j].copy_(b.host_w2[src % HOST_EXPERTS], non_blocking=True)

    def gemm(cfg: DecodeConfig | None):
        return lambda rep: decode_grouped_swiglu(b.hidden, b.weights, b.slots, b.w13, b.w2, cfg,
                                                 fill=SlotFill(plan[rep], b.host_w13, b.host_w2))

    ways = {"memcpy": memcpy,
            "gather": lambda rep: gather_missing(*plan[rep], b.host_w13, b.host_w2, b.w13, b.w2),
            "gemm": lambda rep: grouped_swiglu(b.hidden, b.weights, b.slots, b.w13, b.w2,
                                               fill=SlotFill(plan[rep], b.host_w13, b.host_w2))}
    for tiles in SWEEP if sweep else []:
        ways["gemm " + " ".join(f"{k}={v}" for k, v in tiles.items())] = gemm(DecodeConfig(**tiles))
    return ways


def time_ways(b: Banks, misses: int, alone: float, reps: int, sweep: bool) -> list[dict]:
    plan = plans(misses, reps + 1)
    mb, bound = misses * b.expert_bytes / 1e6, misses * b.expert_bytes / PCIE_BYTES_PER_S * 1e6
    rows = []
    for way, run in fill_ways(b, misses, plan, sweep).items():
        us = timed(run, reps)
        fill_us = us - alone if way.startswith("gemm") else us
        rows.append(dict(misses=misses, way=way, mb=mb, us=us, alone=alone, fill_us=fill_us,
                         gb_s=mb / fill_us * 1e3, bound_us=bound, ratio=bound / us))
    return rows


def main() -> None:
    p = bench_parser(__doc__)
    p.add_argument("--misses", type=int, nargs="+", default=[1, 2, 4, 8])
    p.add_argument("--reps", type=int, default=12)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--inter", type=int, default=768)
    p.add_argument("--sweep", action="store_true", help="also time other tiles of the GEMM's fill")
    args = p.parse_args()
    b = make_banks(args.hidden, args.inter)
    alone = graph_timed(lambda: grouped_swiglu(b.hidden, b.weights, b.slots, b.w13, b.w2), args.reps)
    rows = [row for misses in args.misses for row in time_ways(b, misses, alone, args.reps, args.sweep)]
    print(f"{torch.cuda.get_device_name()}, experts {2 * args.inter}x{args.hidden} + {args.hidden}x{args.inter} "
          f"bf16, {b.expert_bytes / 1e6:.2f} MB each; the batch-1 GEMM alone (8 hits): {alone:.1f} us")
    print_table([("misses", "misses", ">6"), ("way", "way", ">16"), ("MB", "mb", ">6.1f"), ("us", "us", ">8.1f"),
                 ("fill us", "fill_us", ">8.1f"), ("GB/s", "gb_s", ">6.1f"), ("bound us", "bound_us", ">8.1f"),
                 ("ratio", "ratio", ">6.3f")], rows)
    write_json(args.json, rows)


if __name__ == "__main__":
    main()
