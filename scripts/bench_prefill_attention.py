"""Prefill attention of one layer over the paged KV pool: the Triton kernel (a few tiles), and
without a cached prefix SDPA's causal kernel over the new K/V (what the "triton" backend runs
then), against the torch reference backend (gather the pages, expand GQA heads, SDPA with a
bottom-right causal mask), as TFLOP/s and the ratio to the bound FLOPs / 7.9e14 (the measured bf16
matmul ceiling).

    python scripts/bench_prefill_attention.py [--chunks 8192 32768] [--prefixes 0 65536] [--sweep] [--json F]

Shapes are qwen3-30b-geometry's attention (32 query heads, 4 KV heads, head dim 128), bf16,
pages of 16 tokens in shuffled order, one sequence per step.
"""
from __future__ import annotations

import argparse
import json

import torch

from worker.attention.torch_backend import TorchAttention
from worker.attention.triton_backend import causal_self_attention
from worker.attention.triton_prefill import TILE, PrefillTile, paged_prefill_attention, prefill_block_table
from worker.batch import SequenceChunk, build_batch
from worker.kv.gpu_pool import KVPool

FLOPS_PER_S = 7.9e14
HEADS, KV_HEADS, HEAD_DIM, PAGE = 32, 4, 128, 16
SWEEP = [PrefillTile(128, 64, 8, 3), PrefillTile(128, 128, 8, 2), PrefillTile(256, 64, 8, 3),
         PrefillTile(256, 64, 8, 2), PrefillTile(256, 32, 8, 3), PrefillTile(256, 128, 8, 2),
         PrefillTile(256, 64, 16, 2), PrefillTile(256, 64, 16, 3), PrefillTile(512, 64, 16, 2)]


def attention_flops(tokens: int, prefix: int) -> float:
    return 4 * HEADS * HEAD_DIM * (tokens * prefix + tokens * (tokens + 1) / 2)


def timed(fn, reps: int = 5) -> float:
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / reps


def run_case(tokens: int, prefix: int, tiles: list[PrefillTile], reference: bool) -> list[dict]:
    seq_len = prefix + tokens
    pool = KVPool(1, seq_len // PAGE + 2, PAGE, KV_HEADS, HEAD_DIM, torch.bfloat16, torch.device("cuda"))
    pool.k.normal_()
    pool.v.normal_()
    gen = torch.Generator().manual_seed(0)
    pages = (torch.randperm(pool.capacity, generator=gen) + 1)[:-(-seq_len // PAGE)].tolist()
    batch = build_batch([SequenceChunk([0] * tokens, prefix, pages)], PAGE, pool.k.device)
    q = torch.randn(tokens, HEADS, HEAD_DIM, dtype=torch.bfloat16, device="cuda")
    k_cache, v_cache = pool.k[0], pool.v[0]
    flops = attention_flops(tokens, prefix)
    rows = []

    def row(method: str, seconds: float) -> dict:
        bound = flops / FLOPS_PER_S
        return dict(tokens=tokens, prefix=prefix, method=method, ms=seconds * 1e3, tflops=flops / seconds / 1e12,
                    bound_ms=bound * 1e3, ratio=bound / seconds)

    for tile in tiles:
        blocks = prefill_block_table(batch.q_lens, HEADS // KV_HEADS, q.device, tile, [prefix])
        try:
            seconds = timed(lambda: paged_prefill_attention(q, k_cache, v_cache, batch.page_table, batch.seq_lens,
                                                            batch.q_lens, HEAD_DIM ** -0.5, blocks=blocks,
                                                            tile=tile))
        except Exception as e:  # a tile that needs more shared memory than the SM has
            print(f"  tile {tuple(tile)}: {type(e).__name__}: {str(e)[:80]}")
            continue
        rows.append(row(f"triton {tuple(tile)}", seconds))
    k_new = torch.randn(tokens, KV_HEADS, HEAD_DIM, dtype=torch.bfloat16, device="cuda")
    if prefix == 0:
        seconds = timed(lambda: causal_self_attention(q, k_new, k_new, batch.q_lens, HEAD_DIM ** -0.5))
        rows.append(row("sdpa causal (enable_gqa)", seconds))
    if reference:
        torch_attn = TorchAttention(pool, HEAD_DIM ** -0.5)
        try:
            seconds = timed(lambda: torch_attn.forward(0, q, k_new, k_new, batch))
            rows.append(row("torch reference", seconds))
        except torch.OutOfMemoryError:
            print(f"  torch reference: out of memory at {tokens} x {seq_len}")
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--chunks", type=int, nargs="+", default=[8192, 16384, 32768])
    ap.add_argument("--prefixes", type=int, nargs="+", default=[0, 65536])
    ap.add_argument("--sweep", action="store_true", help="time several tiles, not just the default")
    ap.add_argument("--no-reference", action="store_true", help="skip the torch reference backend")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    print(f"prefill attention, one layer of qwen3-30b-geometry, {torch.cuda.get_device_name()}, "
          f"bound = FLOPs / {FLOPS_PER_S:.1e}")
    print(f"{'tokens':>6} {'prefix':>6} {'method':<32} {'ms':>8} {'TFLOP/s':>8} {'bound ms':>8} {'ratio':>6}")
    rows = []
    for prefix in args.prefixes:
        for tokens in args.chunks:
            for r in run_case(tokens, prefix, SWEEP if args.sweep else [TILE], not args.no_reference):
                rows.append(r)
                print(f"{r['tokens']:>6} {r['prefix']:>6} {r['method']:<32} {r['ms']:>8.2f} {r['tflops']:>8.1f} "
                      f"{r['bound_ms']:>8.2f} {r['ratio']:>6.3f}")
            torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
