"""Time the one-row dense projections of a decode step (``worker/models/linear.py``'s kernel against
torch's ``F.linear``, i.e. cuBLAS) at the models' shapes, against the HBM bound.

    python scripts/bench_linear.py [--shapes gpt-oss-qkv,gpt-oss-o] [--sweep] [--calls 32] [--json out.json]

Each shape is ``N x K`` bf16 rows of ``w`` (the qkv projection runs with the residual add and RMSNorm
before it folded in, as a layer's first projection does). Rows: ``torch`` (``F.linear``), ``ours``
(the kernel's default tiles, ``linear.gemv_tiles``), and with ``--sweep`` the kernel at each forced
``GemvTiles(block_k, warps)``: steps that do not divide K read a masked tail (gpt-oss's K = 2880
has no power-of-two divisor above 64; ``k64 w4`` is the 45 steps it took before the masked ones).

Timing: a CUDA graph of ``--calls`` calls, each on its own copy of the weights (copies enough for
256 MB, past the 50 MB L2), replayed; the kernel's programmatic dependent launch is on in the graph
as in a decode step's. bound = bytes of ``w`` / 4.3 TB/s; ratio = bound / time.
"""
from __future__ import annotations

import itertools
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from worker.models import linear as gemv  # noqa: E402
from report_table import bench_parser, print_table, write_json  # noqa: E402  (beside this script)

HBM_BYTES_S = 4.3e12
L2_PAST = 256 << 20
SHAPES = {  # name: (N, K, norm folded in)
    "gpt-oss-qkv": (5120, 2880, True), "gpt-oss-o": (2880, 4096, False), "gpt-oss-router": (128, 2880, False),
    "qwen3-qkv": (5120, 2048, True), "qwen3-o": (2048, 4096, False),
}
# (64, 4): what a K of 2880 took before the masked steps (its largest dividing step)
SWEEP = [gemv.GemvTiles(64, 4)]
SWEEP += [gemv.GemvTiles(k, w) for k, w in itertools.product((256, 512, 1024, 2048), (4, 8, 16))]


def capture(calls: list) -> torch.cuda.CUDAGraph:
    """A CUDA graph of ``calls`` (run once before, outside the capture, so that they compile), replayed once."""
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        for call in calls:
            call()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    graph.replay()
    return graph


def kernel_times_us(calls: list, replays: int = 5) -> dict[str, float]:
    """Each kernel's GPU microseconds per call, from a CUDA graph of ``calls`` replayed under
    torch.profiler (which sees the kernels inside a graph); under programmatic dependent launch a
    kernel's time includes its wait for the kernel before it."""
    from torch.profiler import ProfilerActivity, profile

    graph = capture(calls)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            graph.replay()
        torch.cuda.synchronize()
    times: dict[str, float] = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            times[e.name] = times.get(e.name, 0.0) + e.device_time / (replays * len(calls))
    return times


def graph_time_us(calls: list, replays: int = 20) -> float:
    """Per call, from a CUDA graph of ``calls`` replayed ``replays`` times."""
    graph = capture(calls)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / (replays * len(calls))


def shape_calls(name: str, ours: bool, num_calls: int) -> list:
    n, k, norm = SHAPES[name]
    copies = max(2, -(-L2_PAST // (n * k * 2)))
    weights = [torch.randn(n, k, device="cuda").mul_(k**-0.5).bfloat16() for _ in range(copies)]
    x, res = torch.randn(1, k, device="cuda").bfloat16(), torch.randn(1, k, device="cuda").bfloat16()
    norm_w = torch.ones(k, device="cuda").bfloat16()
    backend = "triton" if ours else "eager"

    def call(w):
        if norm:
            return lambda: gemv.add_rms_norm_linear(x, res, norm_w, 1e-6, w, backend=backend)
        return lambda: gemv.linear(x, w, backend=backend)
    return [call(weights[i % copies]) for i in range(num_calls)]


def time_shape(name: str, variants: list, num_calls: int) -> list[dict]:
    n, k, _ = SHAPES[name]
    bound_us = n * k * 2 / HBM_BYTES_S * 1e6
    rows = []
    for label, tiles in variants:
        gemv.TILES = tiles
        try:
            time = graph_time_us(shape_calls(name, label != "torch", num_calls))
        finally:
            gemv.TILES = None
        rows.append(dict(shape=name, n=n, k=k, variant=label, time_us=time, bound_us=bound_us,
                         ratio=bound_us / time))
        print(f"[linear] {name} {label}: {time:.1f} us ({bound_us / time:.3f} of the HBM bound)", flush=True)
    return rows


def main() -> int:
    parser = bench_parser(__doc__)
    parser.add_argument("--shapes", default=",".join(SHAPES), help=f"comma-separated, of {list(SHAPES)}")
    parser.add_argument("--sweep", action="store_true", help="also time the kernel at each forced GemvTiles")
    parser.add_argument("--calls", type=int, default=32, help="calls a graph")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 1
    variants = [("torch", None), ("ours", None)]
    variants += [(f"k{t.block_k} w{t.warps}", t) for t in SWEEP] if args.sweep else []
    rows = [r for name in args.shapes.split(",") for r in time_shape(name, variants, args.calls)]
    print_table([("shape", "shape", ">15"), ("N", "n", ">5"), ("K", "k", ">5"), ("variant", "variant", ">10"),
                 ("time us", "time_us", ">8.1f"), ("HBM us", "bound_us", ">7.1f"), ("ratio", "ratio", ">6.3f")], rows)
    write_json(args.json, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
