"""Time the copy engine on a prefill chunk's misses as the mirror stages them (one copy per run of
missed experts per bank, small banks bridged), against one copy per run of whole expert records
(an expert-major layout: every bank of an expert in one record) and one copy of the same bytes.

    python scripts/bench_copy_runs.py [--expert-dtype bf16 fp8 nvfp4 mxfp4] [--cache 0.25] [--json out.json]

qwen3-30b's geometry by default (128 experts of 2048 x 768, 48 layers). Each layer's hits are a
random ``--cache`` share of its experts, the rest its misses, copied from pinned host banks into a
buffer slot per expert, as ``mirrored_misses.MirroredMisses.stage`` does (an 8k chunk routes to
nearly every expert). The question it answers: does a copy's set-up cost, beside its bytes, make
the mirror's 4-bit staging (4 unbridged banks: about 140 copies a layer) slower than its bytes?

Rows per format: ``banks`` (today's copies), ``banks2`` (the same copies, the first bank's on one
stream and the others' on a second, so that two copy engines may overlap one's set-up with the
other's bytes), ``records`` (one copy a run), ``one`` (the layer's missed bytes in one copy: the
engine's ceiling). Time from CUDA events around ``--reps`` chunks of
every layer's copies on one stream; host us = the Python time to issue a copy; bound = bytes /
55 GB/s (pinned host-to-device, DESIGN.md); ratio = bound / time.
"""
from __future__ import annotations

import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from moe_offload.copy_runs import bridge_gaps, copy_runs  # noqa: E402
from moe_offload.formats import bank_specs, resolve_expert_format  # noqa: E402
from moe_offload.formats.expert_format import ExpertFormat  # noqa: E402
from moe_offload.mirrored_misses import bridges  # noqa: E402
from report_table import bench_parser, print_table, write_json  # noqa: E402  (beside this script)

PCIE_BYTES_PER_S = 55e9
ALIGN = 256  # a bank's offset inside a record
WAYS = ("banks", "banks2", "records", "one")


def bank_bytes(dtype: str, inter: int, hidden: int) -> list[int]:
    """One expert's bytes per bank in ``--expert-dtype`` ``dtype`` (``formats.bank_specs``)."""
    fmt = resolve_expert_format(dtype, ExpertFormat(torch.bfloat16), torch.bfloat16)
    return [torch.Size(shape).numel() * torch.empty(0, dtype=dt).element_size()
            for shape, dt in bank_specs(fmt, inter, hidden).values()]


def offsets(sizes: list[int]) -> tuple[list[int], int]:
    """Each bank's offset in a record, ``ALIGN``-aligned, and the record's length."""
    out, at = [], 0
    for size in sizes:
        out.append(at)
        at += -(-size // ALIGN) * ALIGN
    return out, at


class Layout:
    """Host banks and their buffer, per bank (``banks``) and as expert records (``records``), over
    ``experts`` experts; uint8 rows, pinned on CUDA."""

    def __init__(self, sizes: list[int], experts: int, device: torch.device):
        cuda = device.type == "cuda"
        self.sizes, (self.offsets, self.record) = sizes, offsets(sizes)
        self.host = [torch.randint(0, 256, (experts, s), dtype=torch.uint8).pin_memory() if cuda
                     else torch.randint(0, 256, (experts, s), dtype=torch.uint8) for s in sizes]
        records = torch.zeros(experts, self.record, dtype=torch.uint8, pin_memory=cuda)
        for h, off, s in zip(self.host, self.offsets, sizes):
            records[:, off:off + s] = h
        self.host_records = records
        self.pool = [torch.zeros(experts, s, dtype=torch.uint8, device=device) for s in sizes]
        self.pool_records = torch.zeros(experts, self.record, dtype=torch.uint8, device=device)
        self.bridge = bridges(sizes, experts)
        self.side = torch.cuda.Stream(device) if cuda else None

    def copy(self, way: str, runs: list[tuple[int, int, int]]) -> int:
        """One layer's misses (``runs`` of (host row, buffer slot, length)) copied ``way``; the copies."""
        if way == "banks":
            return sum(self._bank(b, runs) for b in range(len(self.sizes)))
        if way == "banks2":  # the first bank's copies here, the others' on a second stream at once
            if self.side is None:
                return self.copy("banks", runs)
            self.side.wait_stream(torch.cuda.current_stream())
            copies = self._bank(0, runs)
            with torch.cuda.stream(self.side):
                copies += sum(self._bank(b, runs) for b in range(1, len(self.sizes)))
            torch.cuda.current_stream().wait_stream(self.side)
            return copies
        if way == "records":
            for src, dst, n in runs:
                self.pool_records[dst:dst + n].copy_(self.host_records[src:src + n], non_blocking=True)
            return len(runs)
        nbytes = sum(n for _, _, n in runs) * self.record
        self.pool_records.view(-1)[:nbytes].copy_(self.host_records.view(-1)[:nbytes], non_blocking=True)
        return 1

    def _bank(self, b: int, runs: list[tuple[int, int, int]]) -> int:
        """Bank ``b``'s copies of ``runs`` (bridged where the mirror bridges it) on the current stream."""
        h, pool, bridge = self.host[b], self.pool[b], self.bridge[b]
        for src, dst, n in bridge_gaps(runs, bridge) if bridge else runs:
            pool[dst:dst + n].copy_(h[src:src + n], non_blocking=True)
        return len(bridge_gaps(runs, bridge) if bridge else runs)

    def moved_bytes(self, way: str, runs: list[tuple[int, int, int]]) -> int:
        """The bytes ``way`` moves for ``runs`` (bridged gaps and record padding counted)."""
        if not way.startswith("banks"):
            return sum(n for _, _, n in runs) * self.record
        return sum(sum(n for _, _, n in (bridge_gaps(runs, b) if b else runs)) * s
                   for s, b in zip(self.sizes, self.bridge))


def layer_runs(rng: random.Random, experts: int, cache: float) -> list[tuple[int, int, int]]:
    """A layer's misses as copy runs: a random ``cache`` share of the experts are hits."""
    hits = set(rng.sample(range(experts), round(cache * experts)))
    misses = [e for e in range(experts) if e not in hits]
    return copy_runs(misses, misses)


def time_way(layout: Layout, way: str, chunk: list[list[tuple[int, int, int]]], reps: int) -> dict:
    """Per layer: copies, bytes, GPU ms (events around ``reps`` chunks) and host us per copy."""
    layout.copy(way, chunk[0])  # warm the path
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    copies, host = 0, 0.0
    start.record()
    for _ in range(reps):
        t0 = time.perf_counter()
        copies += sum(layout.copy(way, runs) for runs in chunk)
        host += time.perf_counter() - t0
    end.record()
    end.synchronize()
    layers = reps * len(chunk)
    nbytes = sum(layout.moved_bytes(way, runs) for runs in chunk) / len(chunk)
    ms = start.elapsed_time(end) / layers
    bound_ms = nbytes / PCIE_BYTES_PER_S * 1e3
    return dict(way=way, copies=copies / layers, mb=nbytes / 1e6, ms=ms, gbps=nbytes / ms / 1e6,
                host_us=host / copies * 1e6, bound_ms=bound_ms, ratio=bound_ms / ms)


def rows_for(dtype: str, args) -> list[dict]:
    """Every way's row for one format, over one chunk of ``--layers`` layers' runs."""
    layout = Layout(bank_bytes(dtype, args.inter, args.hidden), args.experts, torch.device("cuda"))
    rng = random.Random(args.seed)
    chunk = [layer_runs(rng, args.experts, args.cache) for _ in range(args.layers)]
    rows = [dict(dtype=dtype, banks=len(layout.sizes), **time_way(layout, way, chunk, args.reps)) for way in WAYS]
    del layout
    torch.cuda.empty_cache()
    return rows


COLUMNS = [("experts", "dtype", "<8"), ("banks", "banks", ">5"), ("way", "way", "<8"), ("copies/layer", "copies", ">12.1f"),
           ("MB/layer", "mb", ">9.2f"), ("ms/layer", "ms", ">9.3f"), ("GB/s", "gbps", ">7.1f"),
           ("host us/copy", "host_us", ">12.1f"), ("bound ms", "bound_ms", ">9.3f"), ("ratio", "ratio", ">6.3f")]


def main() -> None:
    p = bench_parser(__doc__)
    p.add_argument("--expert-dtype", nargs="+", default=["bf16", "fp8", "nvfp4", "mxfp4"])
    p.add_argument("--cache", type=float, default=0.25, help="share of each layer's experts that are hits")
    p.add_argument("--experts", type=int, default=128)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--inter", type=int, default=768)
    p.add_argument("--layers", type=int, default=48)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_copy_runs.py times the copy engine: it needs a CUDA device")
    print(f"copy runs, {torch.cuda.get_device_name()}, {args.experts} experts of {args.hidden} x {args.inter}, "
          f"{args.cache:.0%} hits, {args.layers} layers x {args.reps} reps")
    rows = [row for dtype in args.expert_dtype for row in rows_for(dtype, args)]
    print_table(COLUMNS, rows)
    write_json(args.json, rows)


if __name__ == "__main__":
    main()
