"""Time the Triton grouped SwiGLU GEMM against the bounds it chases, on the qwen3-30b geometry.

    python scripts/bench_grouped_gemm.py [--tokens 1,8,64,2048] [--json out.json]

Each size is captured in a CUDA graph and the replay timed with ``triton.testing.do_bench`` (which
flushes L2 between runs), so tiny decode launches are not measured as Python launch overhead; the
"launched" column is the same op called eagerly. HBM bound = bytes of the experts the routing
touches / 4.3e12 B/s; compute bound = 6*T*k*H*I FLOPs / 7.9e14 FLOP/s; ratio = bound / time.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from moe_offload.grouped import grouped_swiglu  # noqa: E402

HBM_BYTES_PER_S = 4.3e12
BF16_FLOPS_PER_S = 7.9e14


def bench_one(num_tokens: int, args: argparse.Namespace, w13: torch.Tensor, w2: torch.Tensor) -> dict:
    from triton.testing import do_bench

    hidden = torch.randn(num_tokens, args.hidden, device="cuda", dtype=torch.bfloat16)
    # Distinct experts per token, as top-k routing gives.
    slots = torch.rand(num_tokens, args.experts, device="cuda").topk(args.top_k, dim=-1).indices
    weights = torch.softmax(torch.randn(num_tokens, args.top_k, device="cuda"), dim=-1)
    launched_ms = do_bench(lambda: grouped_swiglu(hidden, weights, slots, w13, w2))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        grouped_swiglu(hidden, weights, slots, w13, w2)
    graph_ms = do_bench(graph.replay)
    touched = len(torch.unique(slots))
    expert_bytes = (w13[0].numel() + w2[0].numel()) * w13.element_size()
    hbm_s = touched * expert_bytes / HBM_BYTES_PER_S
    compute_s = 6 * num_tokens * args.top_k * args.hidden * args.inter / BF16_FLOPS_PER_S
    time_s = graph_ms * 1e-3
    return {
        "tokens": num_tokens,
        "experts_touched": touched,
        "time_us": time_s * 1e6,
        "launched_us": launched_ms * 1e3,
        "hbm_bound_us": hbm_s * 1e6,
        "compute_bound_us": compute_s * 1e6,
        "ratio": max(hbm_s, compute_s) / time_s,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", default="1,8,32,64,512,2048,8192", help="comma-separated batch sizes")
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--inter", type=int, default=768)
    parser.add_argument("--experts", type=int, default=128)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--json", metavar="PATH", help="also write the rows as JSON")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 1
    torch.manual_seed(0)
    scale = args.hidden**-0.5
    w13 = (torch.randn(args.experts, 2 * args.inter, args.hidden, device="cuda") * scale).bfloat16()
    w2 = (torch.randn(args.experts, args.hidden, args.inter, device="cuda") * args.inter**-0.5).bfloat16()
    rows = [bench_one(int(t), args, w13, w2) for t in args.tokens.split(",")]
    print(f"{'tokens':>7} {'experts':>7} {'graph us':>9} {'launched us':>11} {'HBM us':>8} {'compute us':>10} {'bound/time':>10}")
    for r in rows:
        print(f"{r['tokens']:7d} {r['experts_touched']:7d} {r['time_us']:9.1f} {r['launched_us']:11.1f} "
              f"{r['hbm_bound_us']:8.1f} {r['compute_bound_us']:10.1f} {r['ratio']:10.2f}")
    if args.json:
        geometry = {k: getattr(args, k) for k in ("hidden", "inter", "experts", "top_k")}
        Path(args.json).write_text(json.dumps({"geometry": geometry, "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
