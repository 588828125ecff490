"""Time the Triton grouped SwiGLU GEMM against the bounds it chases, on the qwen3-30b geometry.

    python scripts/bench_grouped_gemm.py [--tokens 1,8,64,2048] [--expert-dtype bf16|fp8|both]
                                         [--scale-block b128|channel] [--fp8-activations] [--sweep]
                                         [--decode-sweep] [--json out.json]

Each size is captured in a CUDA graph and the replay timed with ``triton.testing.do_bench`` (which
flushes L2 between runs), so tiny decode launches are not measured as Python launch overhead; the
"launched" column is the same op called eagerly. HBM bound = bytes the kernel must read for the
experts the routing touches (weights in their dtype, plus fp8 scales) / 4.3e12 B/s; compute bound
= 6*T*k*H*I FLOPs / 7.86e14 FLOP/s (bf16 matmul, measured; fp8a8 rows assume twice that, the
fp8 tensor-core peak, unmeasured); ratio = bound / time. Rows "fp8" dequantize the weights in the
GEMM (weight-only); "fp8a8" rows (``--fp8-activations``) quantize activations per token-group
and multiply fp8 x fp8. With ``both``, "vs bf16" is the bf16 time over the row's time at the same
routing (above 1: faster than bf16). ``--sweep`` times fp8 tile configs (block_m, block_n,
block_k, group_m, warps, stages) per size, for each fp8 variant asked for.

Bf16 batches of up to ``DECODE_MAX_PAIRS`` (token, expert) pairs take the decode path
(``grouped_gemm_decode``, two or three launches); rows "bf16-align" time the general four-launch
path at the same sizes ("vs bf16" below 1: the decode path is faster). Fp8 rows time the public op,
which takes the fp8 decode path (``grouped_gemm_decode_fp8``) up to ``RESIDENT_MAX_PAIRS`` pairs
here (no fill); rows "fp8-decode" time that path and "fp8-align" the general fp8 path at every
decode size, the measurements that set the limit. ``--decode-sweep`` times
the decode path's tiles (gate_up n, gate_up k, down n, down k, warps, stages; the per-slot down's
tiles stay at their defaults). ``--fp8-decode-sweep`` times one token's fp8 path
(``grouped_gemm_decode_fp8``) over its tiles: the gate_up's (columns, k step, warps) with the
down at its defaults, then the down's (columns, k step, warps) with the gate_up at its defaults
(``--fp8-decode-sweep down``: the down's alone).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from moe_offload.fp8 import BLOCK_128, PER_CHANNEL, quantize, quantize_w13  # noqa: E402
from moe_offload.grouped import ExpertScales, grouped_swiglu  # noqa: E402
from moe_offload.kernels.grouped_gemm_decode import DECODE_MAX_PAIRS, DecodeConfig  # noqa: E402
from report_table import print_sweep  # noqa: E402  (beside this script)

HBM_BYTES_PER_S = 4.3e12
BF16_FLOPS_PER_S = 7.86e14
SCALE_BLOCKS = {"b128": BLOCK_128, "channel": PER_CHANNEL}
# vLLM's H200 fp8 table (E=128, N=768) around our defaults, plus the bf16 file's big tile.
SWEEP = [(16, 64, 128, 1, 4, 3), (16, 128, 128, 1, 4, 3), (16, 128, 128, 16, 4, 5), (32, 128, 128, 8, 4, 4),
         (64, 64, 128, 1, 4, 3), (64, 128, 128, 16, 4, 4), (64, 128, 64, 8, 4, 4), (128, 128, 128, 8, 8, 3),
         (128, 256, 64, 8, 8, 3)]
SWEEP_KEYS = (("variant", ">5"), ("tokens", "7d"))  # a sweep's groups, as print_sweep prints them
DECODE_SWEEP = [(32, 128, 16, 256, 4, 3), (16, 128, 16, 256, 4, 3), (32, 256, 16, 256, 4, 3), (64, 128, 32, 256, 4, 3),
                (32, 128, 8, 256, 4, 3), (32, 128, 16, 128, 4, 4), (16, 256, 16, 128, 4, 4), (32, 128, 32, 128, 8, 3),
                (16, 128, 8, 256, 4, 4), (32, 64, 16, 256, 4, 5)]
# 16 and 32 warps: the down's fastest tiles ran 16, and the tiles' instruction counts do not predict
# their times (kernel_sass.py --against), so the gate_up tries more warps too (all compile unspilled)
FP8_PAIR_SWEEP = [(n, k, w) for n in (8, 16, 32) for k in (128, 256, 512) for w in (4, 8, 16)]
FP8_PAIR_SWEEP += [(n, 256, 32) for n in (16, 32)]
FP8_DOWN_SWEEP = [(n, k, w) for n in (8, 16, 32) for k in (128, 256, 512) for w in (4, 8, 16)]
FP8_DOWN_SWEEP += [(n, 256, 32) for n in (8, 16)]
# one step over the whole intermediate size (768 of 1024, masked): fewer, longer steps took gpt-oss's
# 4-bit down from 12 steps to 3 and its layer from 77.1 to 47.8 us (bench_grouped_gemm_w4.py)
FP8_DOWN_SWEEP += [(n, 1024, w) for n in (8, 16) for w in (4, 8, 16)]
# one token's gate_up with its registers capped (ptxas maxnreg), the default tiles otherwise: compiled for
# sm90 (scripts/kernel_sass.py), fp8's gate_up takes 136 registers at 8 warps, one program an SM; at 128
# the same code fits two. bf16's takes 182 at 4 warps (two programs; 128: four)
PAIR_REGS_SWEEP = (128, 96, 64)


def make_banks(args: argparse.Namespace) -> dict[str, tuple]:
    """``{variant: (w13, w2, scales)}``: bf16 banks and, when asked, their fp8 quantization (the
    fp8a8 variant runs on the same fp8 banks)."""
    torch.manual_seed(0)
    w13 = (torch.randn(args.experts, 2 * args.inter, args.hidden, device="cuda") * args.hidden**-0.5).bfloat16()
    w2 = (torch.randn(args.experts, args.hidden, args.inter, device="cuda") * args.inter**-0.5).bfloat16()
    banks = {"bf16": (w13, w2, None)}
    if args.expert_dtype != "bf16":
        block = SCALE_BLOCKS[args.scale_block]
        q13, s13 = quantize_w13(w13, block)
        q2, s2 = quantize(w2, block)
        banks["fp8"] = (q13, q2, ExpertScales(s13, s2, block))
        if args.fp8_activations:
            banks["fp8a8"] = banks["fp8"]
    if args.expert_dtype == "fp8":
        del banks["bf16"]
    return banks


def expert_bytes(w13: torch.Tensor, w2: torch.Tensor, scales: ExpertScales | None) -> int:
    """Bytes of one expert as the kernel reads them: weights in their dtype, plus scales."""
    size = (w13[0].numel() + w2[0].numel()) * w13.element_size()
    if scales is not None:
        size += (scales.w13[0].numel() + scales.w2[0].numel()) * scales.w13.element_size()
    return size


def routing(num_tokens: int, args: argparse.Namespace) -> tuple[torch.Tensor, ...]:
    """Seeded by size, so every dtype and tile config sees the same routing: distinct experts
    per token, as top-k routing gives."""
    gen = torch.Generator(device="cuda").manual_seed(num_tokens)
    hidden = torch.randn(num_tokens, args.hidden, device="cuda", generator=gen).bfloat16()
    slots = torch.rand(num_tokens, args.experts, device="cuda", generator=gen).topk(args.top_k, dim=-1).indices
    weights = torch.softmax(torch.randn(num_tokens, args.top_k, device="cuda", generator=gen), dim=-1)
    return hidden, weights, slots


def time_us(fn) -> tuple[float, float]:
    """(CUDA-graph replay, eager launch) times of ``fn`` in microseconds."""
    from triton.testing import do_bench

    launched_ms = do_bench(fn)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return do_bench(graph.replay) * 1e3, launched_ms * 1e3


def bench_one(num_tokens: int, args: argparse.Namespace, dtype: str, banks: tuple) -> dict:
    w13, w2, scales = banks
    hidden, weights, slots = routing(num_tokens, args)
    fp8_acts = dtype == "fp8a8"
    if dtype == "bf16-align":
        from moe_offload.kernels.grouped_gemm import fused_grouped_swiglu

        graph_us, launched_us = time_us(lambda: fused_grouped_swiglu(hidden, weights, slots, w13, w2))
    elif dtype == "fp8-decode":
        from moe_offload.kernels.grouped_gemm_decode_fp8 import decode_grouped_swiglu_fp8

        graph_us, launched_us = time_us(lambda: decode_grouped_swiglu_fp8(hidden, weights, slots, w13, w2, scales))
    elif dtype == "fp8-align":
        from moe_offload.kernels.grouped_gemm_fp8 import fused_grouped_swiglu_fp8

        graph_us, launched_us = time_us(lambda: fused_grouped_swiglu_fp8(hidden, weights, slots, w13, w2, scales))
    else:
        graph_us, launched_us = time_us(lambda: grouped_swiglu(hidden, weights, slots, w13, w2, scales=scales,
                                                               fp8_activations=fp8_acts))
    touched = len(torch.unique(slots))
    hbm_us = touched * expert_bytes(w13, w2, scales) / HBM_BYTES_PER_S * 1e6
    peak = BF16_FLOPS_PER_S * (2 if fp8_acts else 1)
    compute_us = 6 * num_tokens * args.top_k * args.hidden * args.inter / peak * 1e6
    return {"dtype": dtype, "tokens": num_tokens, "experts_touched": touched, "time_us": graph_us,
            "launched_us": launched_us, "hbm_bound_us": hbm_us, "compute_bound_us": compute_us,
            "ratio": max(hbm_us, compute_us) / graph_us}


def sweep(num_tokens: int, args: argparse.Namespace, banks: tuple, fp8_acts: bool) -> list[dict]:
    from moe_offload.kernels.grouped_gemm import BlockConfig
    from moe_offload.kernels.grouped_gemm_fp8 import default_config, fit_block_k, fused_grouped_swiglu_fp8

    w13, w2, scales = banks
    hidden, weights, slots = routing(num_tokens, args)
    default = fit_block_k(default_config(num_tokens, hidden.dtype), scales.block)
    rows = []
    for tiles in SWEEP:
        config = BlockConfig(*tiles)
        graph_us, _ = time_us(lambda: fused_grouped_swiglu_fp8(hidden, weights, slots, w13, w2, scales, config,
                                                               fp8_acts))
        rows.append({"variant": "fp8a8" if fp8_acts else "fp8", "tokens": num_tokens, "config": tiles,
                     "default": config == default, "time_us": graph_us})
    return rows


def decode_sweep(num_tokens: int, args: argparse.Namespace, banks: tuple) -> list[dict]:
    from moe_offload.kernels.grouped_gemm_decode import decode_grouped_swiglu

    w13, w2, _ = banks
    hidden, weights, slots = routing(num_tokens, args)
    configs = [DecodeConfig(*tiles) for tiles in DECODE_SWEEP]
    if num_tokens == 1:  # one token's gate_up, its registers capped
        configs += [DecodeConfig(pair_regs=r) for r in PAIR_REGS_SWEEP]
    rows = []
    for config in configs:
        graph_us, _ = time_us(lambda: decode_grouped_swiglu(hidden, weights, slots, w13, w2, config))
        tiles = tuple(config)[:6] if not config.pair_regs else f"pair_regs={config.pair_regs}"
        rows.append({"variant": "decode", "tokens": num_tokens, "config": tiles,
                     "default": config == DecodeConfig(), "time_us": graph_us})
    return rows


def fp8_decode_sweep(args: argparse.Namespace, banks: tuple) -> list[dict]:
    """One token over fp8 banks: each gate_up tile with the default down, each down tile with the
    default gate_up (``FP8_DECODE_TILES``)."""
    from moe_offload.kernels.grouped_gemm_decode_fp8 import FP8_DECODE_TILES, decode_grouped_swiglu_fp8

    w13, w2, scales = banks
    hidden, weights, slots = routing(1, args)
    configs = [("gate_up", FP8_DECODE_TILES._replace(pair_n=n, pair_k=k, pair_warps=w)) for n, k, w in FP8_PAIR_SWEEP]
    configs += [("gate_up", FP8_DECODE_TILES._replace(pair_regs=r)) for r in PAIR_REGS_SWEEP]
    configs += [("down", FP8_DECODE_TILES._replace(down_n=n, down_k=k, down_warps=w)) for n, k, w in FP8_DOWN_SWEEP]
    parts = args.fp8_decode_sweep or ("gate_up", "down")  # the flag alone: both
    configs = [(part, config) for part, config in configs if part in parts]
    rows = []
    for part, config in configs:
        graph_us, _ = time_us(lambda: decode_grouped_swiglu_fp8(hidden, weights, slots, w13, w2, scales, config))
        tiles = ((config.pair_n, config.pair_k, config.pair_warps, config.pair_regs) if part == "gate_up"
                 else (config.down_n, config.down_k, config.down_warps))
        rows.append({"variant": part, "tokens": 1, "config": tiles, "default": config == FP8_DECODE_TILES,
                     "time_us": graph_us})
        print(f"[fp8 sweep] {part} {tiles}: {graph_us:.1f} us", flush=True)  # a run cut off keeps these
    return rows


def print_rows(rows: list[dict]) -> None:
    bf16 = {r["tokens"]: r["time_us"] for r in rows if r["dtype"] == "bf16"}
    print(f"{'dtype':>10} {'tokens':>7} {'experts':>7} {'graph us':>9} {'launched us':>11} {'HBM us':>8} "
          f"{'compute us':>10} {'bound/time':>10} {'vs bf16':>8}")
    for r in sorted(rows, key=lambda r: (r["tokens"], r["dtype"])):
        speedup = f"{bf16[r['tokens']] / r['time_us']:8.2f}" if r["dtype"] != "bf16" and r["tokens"] in bf16 else ""
        print(f"{r['dtype']:>10} {r['tokens']:7d} {r['experts_touched']:7d} {r['time_us']:9.1f} {r['launched_us']:11.1f} "
              f"{r['hbm_bound_us']:8.1f} {r['compute_bound_us']:10.1f} {r['ratio']:10.2f} {speedup:>8}")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", default="1,8,32,64,512,2048,8192", help="comma-separated batch sizes")
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--inter", type=int, default=768)
    parser.add_argument("--experts", type=int, default=128)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--expert-dtype", choices=("bf16", "fp8", "both"), default="bf16")
    parser.add_argument("--scale-block", choices=tuple(SCALE_BLOCKS), default="b128", help="fp8 scales")
    parser.add_argument("--fp8-activations", action="store_true",
                        help="also time the fp8 x fp8 variant (activations quantized per token-group)")
    parser.add_argument("--sweep", action="store_true", help="also time fp8 tile configs per size")
    parser.add_argument("--decode-sweep", action="store_true",
                        help=f"also time the bf16 decode path's tiles at sizes up to {DECODE_MAX_PAIRS} pairs")
    parser.add_argument("--fp8-decode-sweep", nargs="*", choices=("gate_up", "down"),
                        help="also time one token's fp8 path over its gate_up and down tiles (or those named)")
    parser.add_argument("--json", metavar="PATH", help="also write the rows as JSON")
    return parser.parse_args()


def main() -> int:
    args = parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 1
    if args.sweep and args.expert_dtype == "bf16":
        print("--sweep times fp8 tiles: give --expert-dtype fp8 or both", file=sys.stderr)
        return 2
    banks = make_banks(args)
    tokens = [int(t) for t in args.tokens.split(",")]
    rows = [bench_one(t, args, dtype, bank) for dtype, bank in banks.items() for t in tokens]
    if "bf16" in banks:
        rows += [bench_one(t, args, "bf16-align", banks["bf16"]) for t in tokens if t * args.top_k <= DECODE_MAX_PAIRS]
    if "fp8" in banks:
        rows += [bench_one(t, args, variant, banks["fp8"]) for variant in ("fp8-decode", "fp8-align") for t in tokens
                 if t * args.top_k <= DECODE_MAX_PAIRS]
    print_rows(rows)
    variants = [False, True] if args.fp8_activations else [False]
    sweep_rows = [r for a8 in variants for t in tokens for r in sweep(t, args, banks["fp8"], a8)] if args.sweep else []
    if sweep_rows:
        print_sweep(sweep_rows, "fp8 tile sweep (block_m, block_n, block_k, group_m, warps, stages)",
                    SWEEP_KEYS, 28)
    if args.decode_sweep and "bf16" in banks:
        decode_rows = [r for t in tokens if t * args.top_k <= DECODE_MAX_PAIRS for r in decode_sweep(t, args, banks["bf16"])]
        print_sweep(decode_rows, "bf16 decode tile sweep (gate_up n, gate_up k, down n, down k, warps, stages)",
                    SWEEP_KEYS, 28)
        sweep_rows += decode_rows
    if args.fp8_decode_sweep is not None and "fp8" in banks:
        fp8_rows = fp8_decode_sweep(args, banks["fp8"])
        print_sweep(fp8_rows, "fp8 one-token tile sweep (columns, k step, warps[, register cap])", SWEEP_KEYS, 28)
        sweep_rows += fp8_rows
    if args.json:
        geometry = {k: getattr(args, k) for k in ("hidden", "inter", "experts", "top_k", "scale_block")}
        Path(args.json).write_text(json.dumps({"geometry": geometry, "rows": rows, "sweep": sweep_rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
