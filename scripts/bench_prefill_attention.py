"""Prefill attention of one layer over the paged KV pool: the Triton kernel (its table's tile with
the launch's split-KV choice, or a sweep of tiles and split counts), the cuDNN path (gather the
prefix's pages, cuDNN's fused kernel over prefix and chunk, merge: everything the backend launches,
timed together; "first ms" is its first call at a new length, which builds cuDNN's plans), SDPA's flash kernel beside it
(causal over the chunk when there is no prefix; over the same keys laid out contiguously and
unmasked when there is one: the dense ceiling), and optionally the torch reference backend (gather
the pages, expand GQA heads, SDPA with a bottom-right causal mask); as TFLOP/s and the ratio to the
bound FLOPs / 7.86e14 (the measured bf16 matmul ceiling).

    python scripts/bench_prefill_attention.py [--quick] [--sweep] [--splits auto 1 4] [--reference] [--kv-bucket N]
        [--json F]

Shapes are qwen3-30b-geometry's attention (32 query heads, 4 KV heads, head dim 128), bf16,
pages of 16 tokens in shuffled order, one sequence per step. The default grid is chunks of
1k/2k/8k/32k tokens over prefixes of 0/32k/64k/128k; ``--quick`` times 2k and 8k over 0 and 128k.
"""
from __future__ import annotations

import argparse
import json
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from worker.attention.cudnn_prefill import cached_prefix_attention
from worker.attention.split_kv import multiprocessors, split_count
from worker.attention.torch_backend import TorchAttention
from worker.attention.triton_backend import causal_self_attention
from worker.attention.triton_prefill import PrefillTile, paged_prefill_attention, prefill_block_table, tile_for
from worker.batch import SequenceChunk, build_batch
from worker.kv.gpu_pool import KVPool

FLOPS_PER_S = 7.86e14
HEADS, KV_HEADS, HEAD_DIM, PAGE = 32, 4, 128, 16
CHUNKS, PREFIXES = [1024, 2048, 8192, 32768], [0, 32768, 65536, 131072]
QUICK_CHUNKS, QUICK_PREFIXES = [2048, 8192], [0, 131072]
SWEEP = [  # warp specialisation last: a setting Triton cannot build on this GPU may take the process down
    PrefillTile(256, 64, 16, 2), PrefillTile(256, 64, 16, 3), PrefillTile(256, 64, 8, 2), PrefillTile(256, 128, 16, 2),
    PrefillTile(256, 128, 8, 2), PrefillTile(128, 64, 8, 3), PrefillTile(128, 128, 8, 2), PrefillTile(128, 128, 8, 3),
    PrefillTile(128, 128, 4, 2), PrefillTile(512, 64, 16, 2), PrefillTile(256, 64, 16, 2, qk_ahead=True),
    PrefillTile(256, 64, 8, 2, qk_ahead=True), PrefillTile(128, 128, 8, 2, qk_ahead=True),
    PrefillTile(256, 64, 16, 2, True), PrefillTile(128, 128, 8, 2, True), PrefillTile(128, 64, 4, 2, True)]


def tile_name(tile: PrefillTile) -> str:
    knobs = " ws" * tile.warp_specialize + " ahead" * tile.qk_ahead
    return f"{tile.rows}x{tile.block_n} w{tile.num_warps} s{tile.num_stages}{knobs}"


def attention_flops(tokens: int, prefix: int) -> float:
    return 4 * HEADS * HEAD_DIM * (tokens * prefix + tokens * (tokens + 1) / 2)


def first_call(fn) -> float:
    """Seconds of ``fn``'s first call, synchronised (plan building and compilation included)."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - start


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


class Case:
    """One sequence of ``prefix`` cached tokens and a chunk of ``tokens``, its pages shuffled."""

    def __init__(self, tokens: int, prefix: int):
        self.tokens, self.prefix, seq_len = tokens, prefix, prefix + tokens
        self.pool = KVPool(1, seq_len // PAGE + 2, PAGE, KV_HEADS, HEAD_DIM, torch.bfloat16, torch.device("cuda"))
        self.pool.k.normal_()
        self.pool.v.normal_()
        gen = torch.Generator().manual_seed(0)
        pages = (torch.randperm(self.pool.capacity, generator=gen) + 1)[:-(-seq_len // PAGE)].tolist()
        self.batch = build_batch([SequenceChunk([0] * tokens, prefix, pages)], PAGE, self.pool.k.device)
        self.q = torch.randn(tokens, HEADS, HEAD_DIM, dtype=torch.bfloat16, device="cuda")

    def gathered(self, n: int) -> list[torch.Tensor]:
        """K and V of the row's first ``n`` keys, contiguous ``[n, kv_heads, D]`` as the cuDNN path
        gathers them, zeros past the pages' keys."""
        keys = [c[0][self.batch.page_table[0].long()].flatten(0, 1) for c in (self.pool.k, self.pool.v)]
        return [F.pad(k, (0, 0, 0, 0, 0, max(n - k.shape[0], 0)))[:n] for k in keys]

    def row(self, method: str, seconds: float, flops: float | None = None) -> dict:
        flops = flops or attention_flops(self.tokens, self.prefix)
        bound = flops / FLOPS_PER_S
        return dict(tokens=self.tokens, prefix=self.prefix, method=method, ms=seconds * 1e3,
                    tflops=flops / seconds / 1e12, ratio=flops / seconds / FLOPS_PER_S, bound_ms=bound * 1e3)

    def triton(self, tile: PrefillTile, splits: int | None) -> dict | None:
        blocks = prefill_block_table(self.batch.q_lens, HEADS // KV_HEADS, self.q.device, tile, [self.prefix], splits)
        chosen = splits or split_count(blocks.table.shape[0] * KV_HEADS, blocks.max_tiles,
                                       multiprocessors(self.q.device))
        k_cache, v_cache = self.pool.k[0], self.pool.v[0]
        try:
            seconds = timed(lambda: paged_prefill_attention(self.q, k_cache, v_cache, self.batch.page_table,
                                                            self.batch.seq_lens, self.batch.q_lens, HEAD_DIM ** -0.5,
                                                            blocks=blocks))
        except Exception as e:  # a tile that needs more shared memory than the SM has, or fails to compile
            print(f"  tile {tuple(tile)}: {type(e).__name__}: {str(e)[:80]}")
            return None
        return self.row(f"triton {tile_name(tile)} x{chosen}{'' if splits else ' auto'}", seconds)

    def cudnn(self) -> dict | None:
        """The backend's cuDNN path as the engine calls it (the chunk's own K/V from the pool)."""
        k_new, v_new = (k[self.prefix:].contiguous() for k in self.gathered(self.prefix + self.tokens))
        run = lambda: cached_prefix_attention(self.q, k_new, v_new, self.pool.k[0], self.pool.v[0],  # noqa: E731
                                              self.batch.page_table, [self.tokens], [self.prefix], HEAD_DIM ** -0.5)
        try:
            first = first_call(run)
            row = self.row("cudnn (gather + cuDNN x2 + merge)", timed(run))
        except RuntimeError as e:
            print(f"  cudnn: {str(e)[:120]}")
            return None
        return dict(row, first_ms=first * 1e3)

    def cudnn_padded(self, step: int) -> list[dict]:
        """cuDNN over the prefix alone (no mask), at its own length and padded to the next multiple of
        ``step`` keys with a stride-0 ``-inf`` bias on the pad (a plan per bucket instead of per
        length, if cuDNN takes the bias at little cost). The padded row's "first ms" builds its plan; the
        line after the rows gives its first call at a length 16 shorter (a reused plan is fast) and the
        largest difference of its output and log-sum-exp from the exact call's."""
        real, pad = self.prefix, -(-self.prefix // step) * step
        keys = [k.transpose(0, 1)[None] for k in self.gathered(pad)]
        q, scale = self.q.transpose(0, 1)[None], HEAD_DIM ** -0.5
        attention = torch.ops.aten._scaled_dot_product_cudnn_attention

        def exact():
            return attention(q, keys[0][:, :, :real], keys[1][:, :, :real], None, True, 0.0, False, False, scale=scale)[:2]

        def pad_bias(n: int) -> torch.Tensor:  # 0 on the first n keys, -inf after, for every head and query
            bias = torch.zeros(pad, dtype=q.dtype, device=q.device)
            bias[n:] = float("-inf")
            return bias.view(1, 1, 1, pad).expand(1, HEADS, self.tokens, pad)

        def padded(bias: torch.Tensor = pad_bias(real)):
            return attention(q, *keys, bias, True, 0.0, False, False, scale=scale)[:2]

        try:
            shorter = pad_bias(real - 16)
            first, again = first_call(padded), first_call(lambda: padded(shorter))
            (o1, l1), (o2, l2) = exact(), padded()
            err = max((o1.float() - o2.float()).abs().max().item(), (l1.float() - l2.float()).abs().max().item())
            flops = 4 * HEADS * HEAD_DIM * self.tokens * real
            rows = [self.row("cudnn prefix only, exact length", timed(exact), flops),
                    dict(self.row(f"cudnn prefix padded to {pad}, -inf bias", timed(padded), flops), first_ms=first * 1e3)]
        except RuntimeError as e:
            print(f"  cudnn padded: {str(e)[:160]}")
            return []
        print(f"  padded, first call at {real - 16} keys: {again * 1e3:.1f} ms; largest difference {err:.3g}")
        return rows

    def sdpa_flash(self) -> dict | None:
        """Causal over the chunk without a prefix; else every key, contiguous, no mask (its own FLOPs)."""
        seq_len = self.prefix + self.tokens
        keys = [k.transpose(0, 1)[None] for k in self.gathered(seq_len)]
        q = self.q.transpose(0, 1)[None]
        causal = self.prefix == 0
        flops = None if causal else 4 * HEADS * HEAD_DIM * self.tokens * seq_len
        try:
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                seconds = timed(lambda: F.scaled_dot_product_attention(q, *keys, is_causal=causal,
                                                                       scale=HEAD_DIM ** -0.5, enable_gqa=True))
        except RuntimeError as e:
            print(f"  sdpa flash: {str(e)[:80]}")
            return None
        return self.row("sdpa flash causal" if causal else "sdpa flash dense keys, no mask", seconds, flops)

    def reference(self) -> dict | None:
        k_new = torch.randn(self.tokens, KV_HEADS, HEAD_DIM, dtype=torch.bfloat16, device="cuda")
        torch_attn = TorchAttention(self.pool, HEAD_DIM ** -0.5)
        try:
            return self.row("torch reference", timed(lambda: torch_attn.forward(0, self.q, k_new, k_new, self.batch)))
        except torch.OutOfMemoryError:
            print(f"  torch reference: out of memory at {self.tokens} x {self.prefix + self.tokens}")
            return None


def run_case(tokens: int, prefix: int, tiles: list[PrefillTile], splits: list[int | None], reference: bool,
             kv_bucket: int = 0):
    case = Case(tokens, prefix)
    for tile in tiles:
        for s in splits:
            yield case.triton(tile, s)
    if prefix > 0:
        yield case.cudnn()
    if prefix > 0 and kv_bucket:
        yield from case.cudnn_padded(kv_bucket)
    if prefix == 0:  # the path the "triton" backend takes without a prefix
        k = torch.randn(tokens, KV_HEADS, HEAD_DIM, dtype=torch.bfloat16, device="cuda")
        yield case.row("sdpa causal (backend path)",
                       timed(lambda: causal_self_attention(case.q, k, k, [tokens], HEAD_DIM ** -0.5)))
    yield case.sdpa_flash()
    if reference:
        yield case.reference()


def print_best(rows: list[dict]) -> None:
    """The fastest Triton setting of each case, and how often each setting was the fastest."""
    best = {}
    for r in rows:
        key = (r["tokens"], r["prefix"])
        if r["method"].startswith("triton") and r["ms"] < best.get(key, {"ms": float("inf")})["ms"]:
            best[key] = r
    print("\nfastest triton setting per case")
    for (tokens, prefix), r in best.items():
        print(f"{tokens:>6} {prefix:>6} {r['method']:<40} {r['tflops']:>8.1f} {r['ratio']:>6.3f}")
    wins = {}
    for r in best.values():
        wins[r["method"]] = wins.get(r["method"], 0) + 1
    print("wins:", ", ".join(f"{m}: {n}" for m, n in sorted(wins.items(), key=lambda x: -x[1])))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--chunks", type=int, nargs="+", default=None)
    ap.add_argument("--prefixes", type=int, nargs="+", default=None)
    ap.add_argument("--quick", action="store_true", help=f"chunks {QUICK_CHUNKS} over prefixes {QUICK_PREFIXES}")
    ap.add_argument("--sweep", action="store_true", help="time every tile of SWEEP, not just the table's")
    ap.add_argument("--splits", nargs="+", default=["auto"], help="split-KV counts to time: auto and/or ints")
    ap.add_argument("--reference", action="store_true", help="also time the torch reference backend")
    ap.add_argument("--kv-bucket", type=int, default=0, metavar="N",
                    help="also cuDNN over the prefix padded to a multiple of N keys with a stride-0 -inf bias")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    chunks = args.chunks or (QUICK_CHUNKS if args.quick else CHUNKS)
    prefixes = args.prefixes or (QUICK_PREFIXES if args.quick else PREFIXES)
    splits = [None if s == "auto" else int(s) for s in args.splits]
    tiles = SWEEP if args.sweep else [tile_for(torch.bfloat16, HEAD_DIM)]
    print(f"prefill attention, one layer of qwen3-30b-geometry, {torch.cuda.get_device_name()}, "
          f"ratio = TFLOP/s / {FLOPS_PER_S / 1e12:.0f}")
    print(f"{'tokens':>6} {'prefix':>6} {'method':<40} {'ms':>8} {'TFLOP/s':>8} {'bound ms':>8} {'ratio':>6} "
          f"{'first ms':>8}")
    rows = []
    for prefix in prefixes:
        for tokens in chunks:
            for r in filter(None, run_case(tokens, prefix, tiles, splits, args.reference, args.kv_bucket)):
                rows.append(r)
                first = f"{r['first_ms']:>8.1f}" if "first_ms" in r else ""
                print(f"{r['tokens']:>6} {r['prefix']:>6} {r['method']:<40} {r['ms']:>8.2f} {r['tflops']:>8.1f} "
                      f"{r['bound_ms']:>8.2f} {r['ratio']:>6.3f} {first}", flush=True)
            torch.cuda.empty_cache()
    if args.sweep:
        print_best(rows)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
