"""What the cuDNN prefill path's fixed shapes cost (``worker.attention.cudnn_prefill``): a chunk's
queries over a prefix in one cuDNN call against the same keys in calls of a fixed length (the
path's pieces), a new length's first call (the plan cuDNN builds) against its next, and the causal
call over the remainder and the chunk against the chunk alone; as TFLOP/s and the ratio to the
bound FLOPs / 7.86e14.

    python scripts/bench_cudnn_pieces.py [--chunks 2304 8192] [--prefix 131072]
        [--pieces 4096 8192 16384] [--causal 6144] [--json F]

Shapes are qwen3-30b-geometry's attention (32 query heads, 4 KV heads, head dim 128), bf16, keys
contiguous (as gathered). A process's very first cuDNN call starts the library: it is the first
row's "first ms".
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from worker.attention.cudnn_prefill import dense_attention  # noqa: E402
from bench_prefill_attention import first_call, timed  # noqa: E402  (beside this script)
from report_table import bench_parser, print_table, write_json  # noqa: E402

FLOPS_PER_S = 7.86e14
HEADS, KV_HEADS, HEAD_DIM = 32, 4, 128
SCALE = HEAD_DIM ** -0.5
COLUMNS = [("queries", "queries", ">7"), ("keys", "keys", ">7"), ("calls", "calls", ">18"), ("ms", "ms", ">8.3f"),
           ("TFLOP/s", "tflops", ">8.1f"), ("bound ms", "bound_ms", ">8.3f"), ("ratio", "ratio", ">6.3f"),
           ("first ms", "first_ms", ">9")]


def heads_first(n: int, heads: int) -> torch.Tensor:
    """``[1, heads, n, D]`` over a ``[n, heads, D]`` buffer, as the path lays its tensors out."""
    return torch.randn(n, heads, HEAD_DIM, device="cuda", dtype=torch.bfloat16).transpose(0, 1)[None]


def row(queries: int, keys: int, calls: str, seconds: float, flops: float, first: float | None = None) -> dict:
    return dict(queries=queries, keys=keys, calls=calls, ms=seconds * 1e3, tflops=flops / seconds / 1e12,
                bound_ms=flops / FLOPS_PER_S * 1e3, ratio=flops / FLOPS_PER_S / seconds,
                first_ms="" if first is None else f"{first * 1e3:.1f}")


def prefix_rows(queries: int, prefix: int, pieces: list[int]) -> list[dict]:
    """One call over ``prefix`` keys, then the same keys in calls of each length of ``pieces``, and
    two new lengths' first calls."""
    q, k, v = heads_first(queries, HEADS), heads_first(prefix, KV_HEADS), heads_first(prefix, KV_HEADS)
    flops = 4 * HEADS * HEAD_DIM * queries * prefix
    first = first_call(lambda: dense_attention(q, k, v, False, SCALE))
    rows = [row(queries, prefix, "1", timed(lambda: dense_attention(q, k, v, False, SCALE)), flops, first)]
    for length in pieces:
        def calls(length=length):
            for start in range(0, prefix - length + 1, length):
                dense_attention(q, k[:, :, start:start + length], v[:, :, start:start + length], False, SCALE)
        rows.append(row(queries, prefix // length * length, f"{prefix // length} x {length}", timed(calls),
                        4 * HEADS * HEAD_DIM * queries * (prefix // length * length)))
    for keys in (prefix * 3 // 4 | 1, prefix * 3 // 4 + 17):  # lengths no call here has planned
        ks, vs = k[:, :, :keys], v[:, :, :keys]
        first = first_call(lambda: dense_attention(q, ks, vs, False, SCALE))
        rows.append(row(queries, keys, "1, a new length", timed(lambda: dense_attention(q, ks, vs, False, SCALE)),
                        4 * HEADS * HEAD_DIM * queries * keys, first))
    return rows


def causal_row(n: int) -> dict:
    q, k, v = heads_first(n, HEADS), heads_first(n, KV_HEADS), heads_first(n, KV_HEADS)
    seconds = timed(lambda: dense_attention(q, k, v, True, SCALE))
    return row(n, n, "1 causal", seconds, 4 * HEADS * HEAD_DIM * n * (n + 1) / 2)


def main() -> None:
    p = bench_parser(__doc__)
    p.add_argument("--chunks", type=int, nargs="+", default=[2304, 8192], help="query rows (a bucket)")
    p.add_argument("--prefix", type=int, default=131072)
    p.add_argument("--pieces", type=int, nargs="+", default=[4096, 8192, 16384], help="key lengths of the calls")
    p.add_argument("--causal", type=int, nargs="+", default=[6144], help="causal rows besides each chunk's own")
    args = p.parse_args()
    print(f"cuDNN attention in pieces, {torch.cuda.get_device_name()}, ratio = TFLOP/s / 786")
    rows = []
    for queries in args.chunks:
        rows += prefix_rows(queries, args.prefix, args.pieces)
    rows += [causal_row(n) for n in sorted({*args.chunks, *args.causal})]
    print_table(COLUMNS, rows)
    write_json(args.json, rows)


if __name__ == "__main__":
    main()
