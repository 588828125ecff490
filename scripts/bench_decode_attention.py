"""Decode attention of one new token a row over long paged contexts: the split-KV partial kernel and
its merge (``worker.attention.triton_decode``), as a decode step launches them, RoPE inside by
default, timed per layer from a CUDA graph of several layers (``bench_linear.graph_time_us``:
launch gaps do not count, and each layer's keys come from HBM, not L2); as GB/s and the ratio to
the bound K/V bytes / 4.3e12.

    python scripts/bench_decode_attention.py [--contexts 8192 32768 131072] [--batch 1 8]
        [--kv-cache-dtype auto fp8] [--fp8-bytes] [--table-tokens N] [--no-rope] [--sweep] [--kernels]
        [--json F]

Shapes are qwen3-30b-geometry's attention (32 query heads, 4 KV heads, head dim 128), bf16, the
pool in bf16 (``auto``) or float8 e4m3 (``fp8``, rows of their own), pages of 16 tokens in
shuffled order, every row of the batch at the same length. ``--sweep`` also times
other tiles (the partial kernel's tokens a step, programs the split plan aims at, warps and
pipeline stages; the merge's columns a program) at each shape; the served ones are the first row.
``--kernels`` prints each row's kernels (the partial kernel, the merge) and their microseconds a
layer, profiled from the same graph (under programmatic dependent launch a kernel's time includes
its wait for the one before).
"""
from __future__ import annotations

import functools
import itertools
import sys
from pathlib import Path
from typing import NamedTuple

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from worker.attention import triton_decode  # noqa: E402
from worker.attention.triton_decode import paged_decode_attention  # noqa: E402
from worker.kv.gpu_pool import KV_DTYPES  # noqa: E402
from worker.models.rotary import KVWrite, RopeInputs, Rotary  # noqa: E402
from bench_linear import graph_time_us, kernel_times_us  # noqa: E402  (beside this script)
from report_table import bench_parser, print_table, write_json  # noqa: E402

HBM_BYTES_PER_S = 4.3e12
HEADS, KV_HEADS, HEAD_DIM, PAGE = 32, 4, 128, 16
GRAPH_BYTES = 2e9  # each replay reads at least this many distinct K/V bytes: far past L2


class Tile(NamedTuple):
    block_n: int  # 0: the served ones (BLOCK_N; FP8_BLOCK_N where a float8 pool is read as words)
    target_programs: int
    warps: int
    stages: int | None  # None: Triton's default
    reduce_columns: int = triton_decode.REDUCE_COLUMNS  # head-dim columns a merge program takes
    words: bool = triton_decode.FP8_WORDS  # a float8 pool read as words of two values (False: as bytes)


SERVED_WARPS = triton_decode.ROPE_WARPS, triton_decode.PARTIAL_WARPS, triton_decode.FP8_ROPE_WARPS
SERVED_BLOCK_N = triton_decode.BLOCK_N, triton_decode.FP8_BLOCK_N
SERVED = Tile(0, triton_decode.TARGET_PROGRAMS, 0, triton_decode.PARTIAL_STAGES)
SWEEP = [Tile(64, 1024, 0, None), Tile(64, 512, 0, None), Tile(64, 128, 0, None), Tile(64, 256, 0, None, 16),
         Tile(128, 256, 0, None), Tile(64, 256, 0, 4), Tile(64, 256, 4, None),
         Tile(64, 256, 8, 4), Tile(64, 256, 4, 4), Tile(64, 256, 4, 2), Tile(128, 256, 4, 4),  # the warps of fp8
         Tile(128, 256, 8, 4), Tile(128, 512, 4, 4), Tile(128, 256, 4, 2), Tile(256, 256, 8, 4)]  # fp8's words


def tile_name(tile: Tile, rope: bool, kv: str = "auto") -> str:
    served = SERVED_WARPS[(2 if kv == "fp8" else 0) if rope else 1]
    block_n = tile.block_n or triton_decode.keys_a_step(kv == "fp8" and tile.words, HEAD_DIM)
    return (f"n{block_n} p{tile.target_programs} w{tile.warps or served} "
            f"s{tile.stages if tile.stages is not None else 'd'} r{tile.reduce_columns}"
            + ("" if tile.words or kv != "fp8" else " bytes"))


def use_tile(tile: Tile) -> None:
    """The module's tile constants set to ``tile`` (read at each launch)."""
    triton_decode.BLOCK_N, triton_decode.FP8_BLOCK_N = (tile.block_n,) * 2 if tile.block_n else SERVED_BLOCK_N
    triton_decode.TARGET_PROGRAMS = tile.target_programs
    triton_decode.PARTIAL_STAGES, triton_decode.REDUCE_COLUMNS = tile.stages, tile.reduce_columns
    triton_decode.FP8_WORDS = tile.words
    warps = (tile.warps,) * 3 if tile.warps else SERVED_WARPS
    triton_decode.ROPE_WARPS, triton_decode.PARTIAL_WARPS, triton_decode.FP8_ROPE_WARPS = warps


class Layer:
    """One layer's caches with ``batch`` rows of ``context`` tokens each, pages shuffled, and the
    decode step's q, k, v; the page table ``table_tokens`` wide (at least the context's pages: a
    decode graph's table spans its longest row, and the split plan comes from that width)."""

    def __init__(self, batch: int, context: int, gen: torch.Generator, table_tokens: int = 0,
                 kv_dtype: torch.dtype = torch.bfloat16):
        pages_a_row = -(-max(context, table_tokens) // PAGE)
        num_pages = batch * pages_a_row + 1
        shape = (num_pages, PAGE, KV_HEADS, HEAD_DIM)
        self.k_cache = torch.randn(shape, dtype=torch.bfloat16, device="cuda").to(kv_dtype)
        self.v_cache = torch.randn(shape, dtype=torch.bfloat16, device="cuda").to(kv_dtype)
        perm = torch.randperm(num_pages - 1, generator=gen)[:batch * pages_a_row] + 1
        self.table = perm.view(batch, pages_a_row).to(torch.int32).cuda()
        self.lens = torch.full((batch,), context, dtype=torch.int32, device="cuda")
        self.q = torch.randn(batch, HEADS, HEAD_DIM, dtype=torch.bfloat16, device="cuda")
        self.k = torch.randn(batch, KV_HEADS, HEAD_DIM, dtype=torch.bfloat16, device="cuda")
        self.v = torch.randn(batch, KV_HEADS, HEAD_DIM, dtype=torch.bfloat16, device="cuda")
        last = self.lens.long() - 1
        self.slot = self.table.long().gather(1, (last // PAGE)[:, None])[:, 0] * PAGE + last % PAGE
        self.positions = last

    def run(self, rotary: Rotary, rope: bool) -> torch.Tensor:
        if not rope:
            return paged_decode_attention(self.q, self.k_cache, self.v_cache, self.table, self.lens, HEAD_DIM ** -0.5)
        write = KVWrite(self.v, self.k_cache.view(-1, KV_HEADS, HEAD_DIM), self.v_cache.view(-1, KV_HEADS, HEAD_DIM),
                        self.slot)
        inputs = RopeInputs(self.positions, rotary, None, None, 1e-6, write)
        # the lengths and positions are written once, before the graph: read before the wait, as a model's step does
        return paged_decode_attention(self.q, self.k_cache, self.v_cache, self.table, self.lens, HEAD_DIM ** -0.5,
                                      rope=inputs, k=self.k, early_index=True)


def bench_shape(batch: int, context: int, tiles: list[Tile], rope: bool, table_tokens: int = 0,
                kv: str = "auto", kernels: bool = False) -> list[dict]:
    kv_dtype = KV_DTYPES[kv] or torch.bfloat16
    kv_bytes = batch * context * KV_HEADS * HEAD_DIM * 2 * kv_dtype.itemsize  # K and V
    count = max(2, min(48, int(-(-GRAPH_BYTES // kv_bytes))))
    gen = torch.Generator().manual_seed(0)
    layers = [Layer(batch, context, gen, table_tokens, kv_dtype) for _ in range(count)]
    rotary = Rotary(HEAD_DIM, 1e6, context + 1, torch.device("cuda"))
    rows = []
    for tile in tiles:
        use_tile(tile)
        try:
            splits, _ = triton_decode.split_plan(batch, KV_HEADS, layers[0].table.shape[1] * PAGE)
            calls = [functools.partial(layer.run, rotary, rope) for layer in layers]
            seconds = graph_time_us(calls) / 1e6
            split = kernel_times_us(calls) if kernels else {}
        except Exception as e:  # a tile Triton cannot build on this GPU
            print(f"  {tile_name(tile, rope, kv)}: {type(e).__name__}: {str(e)[:100]}")
            continue
        finally:
            use_tile(SERVED)
        bound = kv_bytes / HBM_BYTES_PER_S
        rows.append(dict(batch=batch, context=context, kv=kv, tile=tile_name(tile, rope, kv), us=seconds * 1e6,
                         bound_us=bound * 1e6, gbps=kv_bytes / seconds / 1e9, ratio=bound / seconds, splits=splits,
                         kernels=split))
    return rows


COLUMNS = [("batch", "batch", ">5"), ("context", "context", ">8"), ("KV", "kv", ">4"), ("tile", "tile", ">22"),
           ("splits", "splits", ">6"), ("us", "us", ">8.1f"), ("bound us", "bound_us", ">8.1f"),
           ("GB/s", "gbps", ">7.0f"), ("ratio", "ratio", ">6.3f")]


def main() -> None:
    p = bench_parser(__doc__)
    p.add_argument("--contexts", type=int, nargs="+", default=[8192, 32768, 131072])
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    p.add_argument("--table-tokens", type=int, default=0, metavar="N",
                   help="page tables this many tokens wide, as a decode graph captured for N-token rows has")
    p.add_argument("--kv-cache-dtype", nargs="+", default=["auto"], choices=list(KV_DTYPES),
                   help="what the pool holds: auto (bf16) or fp8 (float8 e4m3); several: rows each")
    p.add_argument("--no-rope", action="store_true", help="the kernel without RoPE inside (its own launch before)")
    p.add_argument("--sweep", action="store_true", help="also time the other tiles of SWEEP")
    p.add_argument("--kernels", action="store_true",
                   help="also each kernel's microseconds a layer, from the graph replayed under torch.profiler")
    p.add_argument("--fp8-bytes", action="store_true",
                   help="fp8 rows also time each tile reading the pool as bytes (widened to the query's dtype)")
    args = p.parse_args()
    tiles = [SERVED] + (SWEEP if args.sweep else [])
    print(f"decode attention, {torch.cuda.get_device_name()}, RoPE {'outside' if args.no_rope else 'inside'}, "
          f"bound = K/V bytes / {HBM_BYTES_PER_S / 1e12:.1f} TB/s; tile: tokens a step, target programs, warps, "
          f"stages, merge columns")
    rows = []
    for batch, context, kv in itertools.product(args.batch, args.contexts, args.kv_cache_dtype):
        both = kv == "fp8" and args.fp8_bytes
        shape_tiles = tiles + ([t._replace(words=False) for t in tiles] if both else [])
        shape_rows = bench_shape(batch, context, shape_tiles, not args.no_rope, args.table_tokens, kv, args.kernels)
        print_table(COLUMNS, shape_rows, gap=bool(rows))  # a table a shape, printed as it ends
        for row in shape_rows if args.kernels else []:
            print(f"  {row['tile']}: " + ", ".join(f"{name} {us:.1f} us" for name, us in row["kernels"].items()))
        rows += shape_rows
    write_json(args.json, rows)


if __name__ == "__main__":
    main()
