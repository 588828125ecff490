"""Time the 4-bit W4A16 grouped SwiGLU GEMM (nvfp4, mxfp4) beside the bf16 and fp8 kernels, same
shapes and routing, against the bounds they chase.

    python scripts/bench_grouped_gemm_w4.py [--geometry qwen3-30b,gpt-oss] [--tokens 1,8,2048,8192]
                                            [--dtypes bf16,fp8,nvfp4,mxfp4] [--sweep] [--decode-sweep]
                                            [--json out.json]

Each op is captured in a CUDA graph and the replay timed with ``triton.testing.do_bench`` (which
flushes L2 between runs, so decode reads its experts from HBM). Rows: bf16 and fp8 through
``grouped_swiglu`` (fp8 picks weight-only below 64 tokens, fp8 x fp8 above, as served: the
row says which), nvfp4 and mxfp4 through ``grouped_swiglu_w4`` (decode path up to 64 pairs,
prefill path above). Banks are random bytes and scales (timing does not depend on the values).

HBM bound = bytes of the experts the routing touches (weights in their format, plus scales) /
4.3e12 B/s; compute bound = 6*T*k*H*I FLOPs / 7.86e14 FLOP/s (bf16 matmul, measured; the fp8a8
rows assume twice that, unmeasured); ratio = max(bounds) / time (1 = at the bound). "vs bf16" and
"vs fp8" are those rows' times over this row's (above 1: faster). ``--sweep`` times 4-bit prefill
tiles (block_m, block_n, block_k, group_m, warps, stages) at the prefill sizes, ``--decode-sweep``
the decode tiles (fields of the format's ``decode_tiles`` changed) at the decode sizes; a swept
config whose output differs from the default tiles' stops the sweep (``check_same``).
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from moe_offload.fp8 import BLOCK_128, quantize, quantize_w13  # noqa: E402
from moe_offload.grouped import ExpertScales, fp8_activations_for, grouped_swiglu  # noqa: E402
from moe_offload.kernels.grouped_gemm import BlockConfig  # noqa: E402
from moe_offload.kernels.grouped_gemm_w4 import (DECODE_MAX_PAIRS, GROUP, W4Bank, default_config,  # noqa: E402
                                                 fused_grouped_swiglu_w4, grouped_swiglu_w4)
from moe_offload.kernels.grouped_gemm_w4_decode import decode_grouped_swiglu_w4, decode_tiles  # noqa: E402
from scripts.report_table import print_sweep, switches  # noqa: E402

HBM_BYTES_PER_S = 4.3e12
BF16_FLOPS_PER_S = 7.86e14
GEOMETRIES = {"qwen3-30b": dict(hidden=2048, inter=768, experts=128, top_k=8),
              "gpt-oss": dict(hidden=2880, inter=2880, experts=128, top_k=4)}
SWEEP = [(16, 64, 64, 1, 4, 3), (16, 128, 128, 16, 4, 3), (32, 128, 128, 8, 4, 4), (64, 128, 128, 16, 4, 3),
         (64, 128, 64, 8, 4, 4), (128, 128, 64, 8, 8, 3), (128, 256, 64, 8, 8, 3), (128, 128, 128, 8, 8, 3),
         # smaller weight tiles a step (the decode of a tile in registers), fewer warps, deeper pipelines
         (64, 256, 64, 8, 8, 3), (128, 128, 64, 8, 4, 3), (128, 128, 32, 8, 4, 4), (128, 64, 64, 8, 4, 4),
         (64, 64, 128, 8, 4, 3), (64, 128, 32, 8, 4, 5), (128, 256, 32, 8, 8, 4), (64, 128, 64, 8, 8, 4)]
# changes from the format's decode_tiles (mxfp4: the down in longer steps): the one-token gate_up (pair_*),
# the per-token down (down_*), the slot path's gate_up and down (gate_up_*, slot_down_*), their warps; one
# token's gate_up with its registers
# capped (nvfp4's takes 134 at 4 warps, three programs an SM, in scripts/kernel_sass.py's sm90 build)
DECODE_SWEEP = [dict(), dict(pair_n=4), dict(pair_n=16), dict(pair_warps=2), dict(pair_warps=8), dict(pair_k=512),
                dict(pair_k=128, pair_n=4), dict(down_warps=8), dict(down_n=8, down_warps=4), dict(down_k=512),
                dict(gate_up_n=32, gate_up_k=128), dict(gate_up_n=128, gate_up_k=64), dict(slot_down_n=64),
                dict(slot_down_k=128), dict(num_warps=8), dict(pair_regs=128), dict(pair_regs=96), dict(pair_regs=64),
                # the per-token down at fewer warps: 16 warps over its 16 x 256 tile load 4 bytes a thread (sm90
                # SASS at gpt-oss's shapes: one program an SM, 180 programs); 4 warps load 16
                dict(down_warps=4), dict(down_warps=2), dict(down_n=32, down_warps=4), dict(down_n=8, down_warps=2),
                dict(down_k=128, down_warps=4), dict(down_n=8, down_warps=1), dict(down_n=4, down_warps=1),
                dict(down_n=4, down_k=512, down_warps=2), dict(down_k=512, down_warps=8),
                # fewer, longer steps (gpt-oss: 12 steps of 256 took 77.0 us a layer, 6 of 512 53.7)
                dict(down_k=1024), dict(down_k=2048), dict(down_k=1024, down_n=8, down_warps=8),
                dict(down_k=512, down_n=8, down_warps=4), dict(down_k=4096, down_n=8), dict(down_k=2048, down_n=8),
                dict(down_k=256, down_n=16, down_warps=16)]  # W4_DECODE_TILES' down, where the format's is the long one
SWEEP_KEYS = (("geometry", ">10"), ("variant", ">13"), ("tokens", "6d"))  # a sweep's groups, as print_sweep prints them


def float_banks(geo: dict) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator(device="cuda").manual_seed(0)
    e, h, i = geo["experts"], geo["hidden"], geo["inter"]
    w13 = (torch.randn(e, 2 * i, h, device="cuda", generator=gen) * h**-0.5).bfloat16()
    w2 = (torch.randn(e, h, i, device="cuda", generator=gen) * i**-0.5).bfloat16()
    return w13, w2


def fp8_banks(w13: torch.Tensor, w2: torch.Tensor) -> tuple:
    q13, s13 = quantize_w13(w13, BLOCK_128)
    q2, s2 = quantize(w2, BLOCK_128)
    return q13, q2, ExpertScales(s13, s2, BLOCK_128)


def w4_banks(geo: dict, fmt: str) -> tuple[W4Bank, W4Bank]:
    """``w13`` and ``w2`` as the 4-bit ops take them: random codes and scales."""
    gen = torch.Generator(device="cuda").manual_seed(1)
    e = geo["experts"]

    def bank(rows, k):
        packed = torch.randint(0, 256, (e, rows, k // 2), device="cuda", generator=gen, dtype=torch.uint8)
        groups = (e, rows, k // GROUP[fmt])
        if fmt == "mxfp4":
            return packed, torch.randint(116, 122, groups, device="cuda", generator=gen, dtype=torch.uint8), None
        scale = (torch.rand(groups, device="cuda", generator=gen) + 0.5).to(torch.float8_e4m3fn)
        return packed, scale, torch.full((e, rows), 1 / (3 * math.sqrt(k)), device="cuda")

    return W4Bank(*bank(2 * geo["inter"], geo["hidden"])), W4Bank(*bank(geo["hidden"], geo["inter"]))


def bytes_per_expert(banks: tuple) -> int:
    return sum(t[0].numel() * t.element_size() for t in banks if isinstance(t, torch.Tensor))


def routing(num_tokens: int, geo: dict) -> tuple[torch.Tensor, ...]:
    """Seeded by size, so every dtype and tile config sees the same routing: distinct experts
    per token, as top-k routing gives."""
    gen = torch.Generator(device="cuda").manual_seed(num_tokens)
    hidden = torch.randn(num_tokens, geo["hidden"], device="cuda", generator=gen).bfloat16()
    logits = torch.rand(num_tokens, geo["experts"], device="cuda", generator=gen)
    slots = logits.topk(geo["top_k"], dim=-1).indices
    weights = torch.softmax(torch.randn(num_tokens, geo["top_k"], device="cuda", generator=gen), dim=-1)
    return hidden, weights, slots


def time_us(fn) -> float:
    """CUDA-graph replay time of ``fn`` in microseconds (compiled and warmed first)."""
    from triton.testing import do_bench

    fn()  # compile outside the capture (which runs on a side stream of its own)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return do_bench(graph.replay) * 1e3


def op_for(dtype: str, banks: tuple, hidden: torch.Tensor, weights: torch.Tensor, slots: torch.Tensor):
    """The served op for a dtype, and its row label (fp8 says whether it quantized activations)."""
    if dtype == "bf16":
        return lambda: grouped_swiglu(hidden, weights, slots, *banks), "bf16"
    if dtype == "fp8":
        q13, q2, scales = banks
        label = "fp8a8" if fp8_activations_for(hidden, scales) else "fp8"
        return lambda: grouped_swiglu(hidden, weights, slots, q13, q2, scales=scales), label
    return lambda: grouped_swiglu_w4(hidden, weights, slots, *banks, fmt=dtype), dtype


def bench_one(geo_name: str, geo: dict, num_tokens: int, dtype: str, banks: tuple) -> dict:
    hidden, weights, slots = routing(num_tokens, geo)
    fn, label = op_for(dtype, banks, hidden, weights, slots)
    time = time_us(fn)
    touched = len(torch.unique(slots))
    hbm_us = touched * bytes_per_expert(banks[:2] if dtype == "bf16" else _flat(banks)) / HBM_BYTES_PER_S * 1e6
    peak = BF16_FLOPS_PER_S * (2 if label == "fp8a8" else 1)
    compute_us = 6 * num_tokens * geo["top_k"] * geo["hidden"] * geo["inter"] / peak * 1e6
    return {"geometry": geo_name, "dtype": label, "tokens": num_tokens, "experts_touched": touched, "time_us": time,
            "hbm_bound_us": hbm_us, "compute_bound_us": compute_us, "ratio": max(hbm_us, compute_us) / time}


def _flat(banks: tuple) -> tuple:
    """fp8 banks are ``(q13, q2, ExpertScales)``: weights and their scale grids; 4-bit ones two
    ``W4Bank``s."""
    if isinstance(banks[-1], ExpertScales):
        return banks[0], banks[1], banks[2].w13, banks[2].w2
    return (*banks[0], *banks[1])


def sweep(geo_name: str, geo: dict, num_tokens: int, fmt: str, banks: tuple) -> list[dict]:
    hidden, weights, slots = routing(num_tokens, geo)
    rows, reference = [], fused_grouped_swiglu_w4(hidden, weights, slots, *banks, fmt=fmt)
    for tiles in SWEEP:
        config = BlockConfig(*tiles)
        try:
            out = fused_grouped_swiglu_w4(hidden, weights, slots, *banks, fmt=fmt, config=config)
        except triton.runtime.errors.OutOfResources as e:  # shared memory or registers: not a candidate
            print(f"[sweep] {geo_name} {fmt} tokens {num_tokens} {list(tiles)}: does not fit ({e})", flush=True)
            continue
        check_same(reference, out, tiles)
        time = time_us(lambda: fused_grouped_swiglu_w4(hidden, weights, slots, *banks, fmt=fmt, config=config))
        rows.append({"geometry": geo_name, "variant": fmt, "tokens": num_tokens, "config": list(tiles),
                     "default": config == default_config(num_tokens, hidden.dtype), "time_us": time})
        progress(rows[-1])
    return rows


def check_same(reference: torch.Tensor, out: torch.Tensor, tiles: object) -> None:
    """A swept config is timed only if it computes what the default tiles do (the sums' order
    differs: within 1e-2 of the largest output); otherwise the sweep stops with one line."""
    err = (out.float() - reference.float()).abs().max().item() / max(reference.float().abs().max().item(), 1e-6)
    if not err <= 1e-2:
        sys.exit(f"tiles {tiles or 'default'} compute something else than the default tiles "
                 f"(largest difference {err:.2e} of the largest output)")


def progress(row: dict) -> None:
    """One sweep row as soon as it is timed (a run cut off by a time limit keeps what it measured)."""
    print(f"[sweep] {row['geometry']} {row['variant']} tokens {row['tokens']} {row['config'] or 'default'}: "
          f"{row['time_us']:.1f} us", flush=True)


def _matches(change: dict, token: str) -> bool:
    """``FIELD`` matches a change of that field, ``FIELD=N`` one that sets it to N."""
    field, _, value = token.partition("=")
    return field in change and (not value or change[field] == int(value))


def decode_sweep(geo_name: str, geo: dict, num_tokens: int, fmt: str, banks: tuple, only: list[str]) -> list[dict]:
    hidden, weights, slots = routing(num_tokens, geo)
    rows, reference = [], decode_grouped_swiglu_w4(hidden, weights, slots, *banks, fmt=fmt)
    for change in DECODE_SWEEP:
        if only and change and not any(_matches(change, token) for token in only):
            continue  # the default always, then only the changes asked for
        config = decode_tiles(fmt, geo["inter"])._replace(**change)
        check_same(reference, decode_grouped_swiglu_w4(hidden, weights, slots, *banks, fmt=fmt, config=config), change)
        time = time_us(lambda: decode_grouped_swiglu_w4(hidden, weights, slots, *banks, fmt=fmt, config=config))
        rows.append({"geometry": geo_name, "variant": f"{fmt}-decode", "tokens": num_tokens, "config": change,
                     "default": not change, "time_us": time})
        progress(rows[-1])
    return rows


def print_rows(rows: list[dict]) -> None:
    base = {(r["geometry"], r["tokens"], r["dtype"]): r["time_us"] for r in rows}
    print(f"grouped SwiGLU GEMM, {torch.cuda.get_device_name()}{switches()}")
    print(f"{'geometry':>10} {'dtype':>6} {'tokens':>6} {'experts':>7} {'time us':>9} {'HBM us':>8} {'compute us':>10} "
          f"{'bound/time':>10} {'vs bf16':>8} {'vs fp8':>7}")
    for r in sorted(rows, key=lambda r: (r["geometry"], r["tokens"], r["dtype"])):
        key = (r["geometry"], r["tokens"])
        vs = [base.get((*key, d)) for d in ("bf16", "fp8a8" if (*key, "fp8a8") in base else "fp8")]
        vs = [f"{v / r['time_us']:.2f}" if v and r["dtype"] not in ("bf16", "fp8", "fp8a8") else "" for v in vs]
        print(f"{r['geometry']:>10} {r['dtype']:>6} {r['tokens']:6d} {r['experts_touched']:7d} {r['time_us']:9.1f} "
              f"{r['hbm_bound_us']:8.1f} {r['compute_bound_us']:10.1f} {r['ratio']:10.2f} {vs[0]:>8} {vs[1]:>7}")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--geometry", default="qwen3-30b,gpt-oss", help=f"comma-separated, of {list(GEOMETRIES)}")
    parser.add_argument("--tokens", default="1,8,2048,8192", help="comma-separated batch sizes")
    parser.add_argument("--dtypes", default="bf16,fp8,nvfp4,mxfp4", help="comma-separated expert formats")
    parser.add_argument("--sweep", action="store_true", help="also time 4-bit prefill tiles at prefill sizes")
    parser.add_argument("--decode-sweep", nargs="*", metavar="FIELD[=N]",
                        help="also time 4-bit decode tiles at decode sizes (given FIELD or FIELD=N: only the changes "
                             "of that DecodeConfig field, or setting it to N, e.g. down_warps down_k=1024)")
    parser.add_argument("--json", metavar="PATH", help="also write the rows as JSON")
    return parser.parse_args()


def run_geometry(name: str, args: argparse.Namespace) -> tuple[list[dict], list[dict]]:
    geo, tokens = GEOMETRIES[name], [int(t) for t in args.tokens.split(",")]
    dtypes = args.dtypes.split(",")
    rows, sweeps = [], []
    if {"bf16", "fp8"} & set(dtypes):
        w13, w2 = float_banks(geo)
        for dtype, banks in (("bf16", (w13, w2)), ("fp8", None)):
            if dtype in dtypes:
                banks = banks or fp8_banks(w13, w2)
                rows += [bench_one(name, geo, t, dtype, banks) for t in tokens]
        del w13, w2
    for fmt in (d for d in dtypes if d in GROUP):
        banks = w4_banks(geo, fmt)
        rows += [bench_one(name, geo, t, fmt, banks) for t in tokens]
        decode_sizes = [t for t in tokens if t * geo["top_k"] <= DECODE_MAX_PAIRS]
        if args.sweep:
            sweeps += [r for t in tokens if t not in decode_sizes for r in sweep(name, geo, t, fmt, banks)]
        if args.decode_sweep is not None:
            sweeps += [r for t in decode_sizes for r in decode_sweep(name, geo, t, fmt, banks, args.decode_sweep)]
    torch.cuda.empty_cache()
    return rows, sweeps


def main() -> int:
    args = parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 1
    rows, sweeps = [], []
    for name in args.geometry.split(","):
        more_rows, more_sweeps = run_geometry(name, args)
        rows, sweeps = rows + more_rows, sweeps + more_sweeps
    print_rows(rows)
    if sweeps:
        print_sweep(sweeps, "4-bit tile sweep (prefill: block_m, block_n, block_k, group_m, warps, stages; "
                            "decode: changes of the format's decode_tiles)", SWEEP_KEYS, 44)
    if args.json:
        Path(args.json).write_text(json.dumps({"geometries": GEOMETRIES, "rows": rows, "sweep": sweeps}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
