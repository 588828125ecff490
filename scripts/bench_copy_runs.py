"""Time the copy engine on a prefill chunk's misses as the mirror stages them (``MirroredMisses.stage``,
then its repair launch): from banks stored one after another (one copy per run of missed experts
per bank, small banks bridged), against the expert records the store and the cache hold now
(``expert_records``: every bank of an expert in one record, one copy per run), and one copy of the
same bytes.

    python scripts/bench_copy_runs.py [--expert-dtype bf16 fp8 nvfp4 mxfp4] [--cache 0.25] [--json out.json]

qwen3-30b's geometry by default (128 experts of 2048 x 768). Two layers of host banks, each layer's
hits a random ``--cache`` share of its experts (at a slot past the buffer: read in place), the rest
its misses (an 8k chunk routes to nearly every expert); the layers staged in turn ``--layers`` times
a rep. The host banks are pinned memory seen by the device (as the expert store's are), so every
copy is the device-to-device ``copy_`` the mirror issues. The question it answers: does a copy's
set-up cost, beside its bytes, make the mirror's 4-bit staging from separate banks (4 unbridged)
slower than its bytes, and do records recover it?

Rows per format: ``banks`` (the mirror over separate banks, as before expert records),
``records`` (the mirror over records: the engine's staging), ``one`` (a layer's missed bytes in one
copy: the engine's ceiling). Time from CUDA events around
``--reps`` reps; host us = the Python time to issue a copy (it includes waits where the copy queue
is full); bound = bytes / 55 GB/s (pinned host-to-device, DESIGN.md); ratio = bound / time.
"""
from __future__ import annotations

import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from moe_offload.copy_runs import bridge_gaps  # noqa: E402
from moe_offload.expert_records import bank_views, record_layout  # noqa: E402
from moe_offload.formats import bank_specs, resolve_expert_format  # noqa: E402
from moe_offload.formats.expert_format import ExpertFormat  # noqa: E402
from moe_offload.host_register import pinned_device_view  # noqa: E402
from moe_offload.mirrored_misses import MirroredMisses  # noqa: E402
from report_table import bench_parser, print_table, write_json  # noqa: E402  (beside this script)

PCIE_BYTES_PER_S = 55e9
LAYERS = 2  # of host banks: the mirror's buffer alternates between two layers
WAYS = ("banks", "records", "one")


def bank_bytes(dtype: str, inter: int, hidden: int) -> list[int]:
    """One expert's bytes per bank in ``--expert-dtype`` ``dtype`` (``formats.bank_specs``)."""
    fmt = resolve_expert_format(dtype, ExpertFormat(torch.bfloat16), torch.bfloat16)
    return [torch.Size(shape).numel() * torch.empty(0, dtype=dt).element_size()
            for shape, dt in bank_specs(fmt, inter, hidden).values()]


def host_tensor(rows: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``rows`` in pinned host memory that ``device`` addresses (on a CPU: as they are)."""
    return pinned_device_view(rows.pin_memory(), device) if device.type == "cuda" else rows


class Layout:
    """Two layers of ``experts`` experts' banks (uint8 rows ``[L*E, 1, bytes]``) in host memory and
    a mirror staging them into a buffer; the same experts as records, with a mirror of their own."""

    def __init__(self, sizes: list[int], experts: int, cache: float, rng: random.Random, device: torch.device):
        self.sizes, self.experts = sizes, experts
        self.offsets, self.record = record_layout(sizes)
        specs = [((1, s), torch.uint8) for s in sizes]
        rows = [torch.randint(0, 256, (LAYERS * experts, 1, s), dtype=torch.uint8) for s in sizes]
        records = torch.zeros(LAYERS * experts, self.record, dtype=torch.uint8)
        for view, r in zip(bank_views(records, specs, record_layout(sizes)), rows):
            view.copy_(r)
        self.host = [host_tensor(r, device) for r in rows]
        self.host_records = host_tensor(records, device)
        self.pool_records = torch.zeros(LAYERS * experts, self.record, dtype=torch.uint8, device=device)
        table = torch.full((LAYERS * experts,), -1, dtype=torch.int32)
        for layer in range(LAYERS):  # hits at slots past the buffer's, read in place
            hits = rng.sample(range(experts), round(cache * experts))
            table[[layer * experts + e for e in hits]] = LAYERS * experts + torch.arange(len(hits), dtype=torch.int32)
        table = table.to(device)
        self.mirror = self._mirror(table, self.host, [torch.zeros_like(h, device=device) for h in self.host])
        as_banks = [bank_views(r, specs, record_layout(sizes)) for r in (self.host_records, self.pool_records)]
        self.records_mirror = self._mirror(table, *as_banks)

    def _mirror(self, table: torch.Tensor, host: list[torch.Tensor], pools: list[torch.Tensor]) -> MirroredMisses:
        """A mirror from ``host`` into ``pools``, its plan made from the exact table."""
        experts = self.experts
        mirror = MirroredMisses(table, list(zip(host, pools)), LAYERS, experts, torch.arange(experts),
                                LAYERS * experts)
        mirror.refresh(beside=False)
        if table.is_cuda:
            torch.cuda.synchronize()  # the plan reads the mirror: here it must be exact, not recent
        mirror.plan(torch.zeros(LAYERS, 2, dtype=torch.int64, device=table.device))
        return mirror

    def copy(self, way: str, layer: int) -> int:
        """``layer``'s misses copied ``way``; the copies."""
        if way != "one":
            mirror = self.mirror if way == "banks" else self.records_mirror
            before = mirror.copies
            mirror.stage(layer)
            return mirror.copies - before
        nbytes = self.moved_bytes(way, layer)
        self.pool_records.view(-1)[:nbytes].copy_(self.host_records.view(-1)[:nbytes], non_blocking=True)
        return 1

    def moved_bytes(self, way: str, layer: int) -> int:
        """The bytes ``way`` moves for ``layer`` (bridged gaps and record padding counted)."""
        mirror = self.mirror
        if way == "banks":
            return sum(sum(n for _, _, n in bridge_gaps(mirror.runs[layer], bridge)) * size
                       for size, (*_, bridge) in zip(self.sizes, mirror.copy_banks))
        return sum(n for _, _, n in mirror.runs[layer]) * self.record


def time_way(layout: Layout, way: str, layers: int, reps: int) -> dict:
    """Per layer: copies, bytes, GPU ms (events around ``reps`` reps of ``layers`` layers staged in
    turn) and host us per copy."""
    layout.copy(way, 0)  # warm the path
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    copies, host = 0, 0.0
    start.record()
    for _ in range(reps):
        t0 = time.perf_counter()
        copies += sum(layout.copy(way, layer % LAYERS) for layer in range(layers))
        host += time.perf_counter() - t0
    end.record()
    end.synchronize()
    staged = reps * layers
    nbytes = sum(layout.moved_bytes(way, layer % LAYERS) for layer in range(layers)) / layers
    ms = start.elapsed_time(end) / staged
    bound_ms = nbytes / PCIE_BYTES_PER_S * 1e3
    return dict(way=way, copies=copies / staged, mb=nbytes / 1e6, ms=ms, gbps=nbytes / ms / 1e6,
                host_us=host / copies * 1e6, bound_ms=bound_ms, ratio=bound_ms / ms)


def rows_for(dtype: str, args) -> list[dict]:
    """Every way's row for one format."""
    layout = Layout(bank_bytes(dtype, args.inter, args.hidden), args.experts, args.cache, random.Random(args.seed),
                    torch.device("cuda"))
    rows = [dict(dtype=dtype, banks=len(layout.sizes), **time_way(layout, way, args.layers, args.reps))
            for way in WAYS]
    del layout
    torch.cuda.empty_cache()
    return rows


COLUMNS = [("experts", "dtype", "<8"), ("banks", "banks", ">5"), ("way", "way", "<8"),
           ("copies/layer", "copies", ">12.1f"),
           ("MB/layer", "mb", ">9.2f"), ("ms/layer", "ms", ">9.3f"), ("GB/s", "gbps", ">7.1f"),
           ("host us/copy", "host_us", ">12.1f"), ("bound ms", "bound_ms", ">9.3f"), ("ratio", "ratio", ">6.3f")]


def main() -> None:
    p = bench_parser(__doc__)
    p.add_argument("--expert-dtype", nargs="+", default=["bf16", "fp8", "nvfp4", "mxfp4"])
    p.add_argument("--cache", type=float, default=0.25, help="share of each layer's experts that are hits")
    p.add_argument("--experts", type=int, default=128)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--inter", type=int, default=768)
    p.add_argument("--layers", type=int, default=48, help="layers staged a rep (the two host layers in turn)")
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
