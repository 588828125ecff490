"""Time copying a decode layer's cache misses from mapped host memory into their slots, against the
PCIe bound, on the qwen3-30b geometry (bf16 experts, 9.4 MB each).

    python scripts/bench_expert_fill.py [--misses 1 2 4 8] [--reps 12] [--sweep] [--beside] [--json out.json]

Per count of misses m (of a batch-1 layer's k = 8 experts), each way of filling them:

- ``memcpy``: the copy engine, ``m`` host-to-device copies per bank (what a host-driven engine
  pays; not capturable without the host knowing the misses),
- ``gather``: ``gather_missing``, one launch per bank reading the host banks zero-copy, over its
  wide grid; ``gather N``: over N programs that deal the rows among them,
- ``gemm``: the decode GEMM with the fill (``grouped_swiglu(fill=...)``): its gate_up launch copies
  the misses as it computes the hits; "GEMM alone" is the same GEMM with every expert a hit
  (replayed from a CUDA graph: launched from Python it would time the host; its slots stay in L2
  in part), so "fill us" (the row's time less it) is what the misses add.

``--beside`` times a gather on a side stream beside dense work on the compute stream (four GEMVs
over a 128 MB bf16 weight, as a decode step's projections read HBM), as the decode prefetch runs
its guess: the wide grid against ``gather_missing``'s few programs (``programs``), and one and 32
programs gathering from HBM instead (is it any kernel beside the GEMVs that slows them, or one
reading PCIe?); each row the GEMVs' time (alone: no gather), the gather's, and both together; the
GEMVs' HBM bound beside them.

``--sweep`` adds "gemm" rows for other tiles of the fill, each named by the ``DecodeConfig`` field it
changes: ``fill_k`` (the columns of a w13 copy step), ``fill_rows`` (the w2 rows of a copy program)
and ``pair_n`` (one token's gate_up columns: a missed expert's w13 is copied by ``I / pair_n``
programs).

``--packed`` makes the banks 4-bit (bytes, half the columns; the scales left out) for the gather
and memcpy rows alone (``--hidden 2880 --inter 2880``: gpt-oss's experts). ``--shm-gb G`` takes the
host banks from a G GB shared-memory segment registered with CUDA, as the expert store's are (not
from ``cudaHostAlloc``), every rep's experts drawn at random across it.

Every rep copies other host experts (a host bank of 64 experts, 600 MB, pinned), so no read is
served by L2. Time per rep from CUDA events around ``--reps`` reps; bound = bytes / 55 GB/s
(pinned host-to-device, measured in DESIGN.md); ratio = bound / time.
"""
from __future__ import annotations

import ctypes
import math
import mmap
import os
import sys
from pathlib import Path
from typing import NamedTuple

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from moe_offload.grouped import SlotFill, grouped_swiglu  # noqa: E402
from moe_offload.host_register import host_register, mapped_device_bytes  # noqa: E402
from moe_offload.kernels.grouped_gemm_decode import DecodeConfig, decode_grouped_swiglu  # noqa: E402
from moe_offload.kernels import gather_missing as gather_mod  # noqa: E402
from moe_offload.kernels.gather_missing import gather_missing  # noqa: E402
from moe_offload.kernels.lookup_admit import CopyPlan  # noqa: E402
from report_table import bench_parser, print_table, write_json  # noqa: E402  (beside this script)

PCIE_BYTES_PER_S = 55e9
HBM_BYTES_PER_S = 4.3e12
BESIDE_PROGRAMS = [0, 1, 4, 16, 32, 64]  # gather_missing's wide grid, then that many programs
GATHER_PROGRAMS = [16, 32, 64, 128]
HOST_EXPERTS = 64
SLOTS = 16
TOP_K = 8
SWEEP = [dict(fill_k=128), dict(fill_k=512), dict(fill_rows=8), dict(fill_rows=32), dict(pair_n=8), dict(pair_n=32)]


def plans(misses: int, reps: int, host_experts: int = HOST_EXPERTS) -> list[CopyPlan]:
    """A plan per rep: ``misses`` host experts (other ones every rep, drawn at random) into slots
    ``[0, misses)``."""
    out = []
    order = torch.randperm(host_experts, generator=torch.Generator().manual_seed(misses)).int()
    for rep in range(reps):
        src = torch.full((TOP_K,), -1, dtype=torch.int32)
        dst = src.clone()
        src[:misses] = order[torch.arange(rep * misses, (rep + 1) * misses) % host_experts]
        dst[:misses] = torch.arange(misses, dtype=torch.int32)
        out.append(CopyPlan(src.cuda(), dst.cuda(), torch.tensor([misses], dtype=torch.int32, device="cuda")))
    return out


def timed(run, reps: int) -> float:
    """Microseconds per rep of ``run(rep)``, after an untimed ``run(reps)`` (other experts)."""
    run(reps)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for rep in range(reps):
        run(rep)
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / reps


def graph_timed(run, reps: int) -> float:
    """Microseconds per call of ``run()`` replayed from a CUDA graph of ``reps`` calls: a launch
    whose GPU time is shorter than the host's time to launch it is timed on the GPU."""
    run()  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            run()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / reps


class Banks(NamedTuple):
    """Host banks (pinned, or views of a registered segment), the GPU slots they fill, and a batch-1
    decode step's inputs."""
    host_w13: torch.Tensor
    host_w2: torch.Tensor
    w13: torch.Tensor
    w2: torch.Tensor
    hidden: torch.Tensor
    weights: torch.Tensor
    slots: torch.Tensor

    @property
    def expert_bytes(self) -> int:
        return (self.host_w13[0].numel() + self.host_w2[0].numel()) * self.host_w13.element_size()


def shm_banks(shapes: list[tuple[int, ...]], dtype: torch.dtype, gb: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Host banks ``[N, *shape]`` of as many experts as fit ``gb`` GB, in one shared-memory segment
    registered with CUDA (the expert store's way), as device views."""
    item = torch.empty((), dtype=dtype).element_size()
    per_expert = sum(math.prod(shape) for shape in shapes) * item
    experts = int(gb * 1e9) // per_expert
    sizes = [experts * math.prod(shape) * item for shape in shapes]
    fd = os.open(f"/dev/shm/sluice-bench-fill-{os.getpid()}", os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    os.unlink(f"/dev/shm/sluice-bench-fill-{os.getpid()}")
    os.posix_fallocate(fd, 0, sum(sizes))
    mm = mmap.mmap(fd, sum(sizes))
    os.close(fd)
    ptr = ctypes.addressof(ctypes.c_char.from_buffer(mm))
    raw = mapped_device_bytes(host_register(ptr, sum(sizes), torch.device("cuda")), sum(sizes), torch.device("cuda"),
                              owner=mm)
    w13 = raw[:sizes[0]].view(dtype).view(experts, *shapes[0])
    return w13, raw[sizes[0]:].view(dtype).view(experts, *shapes[1])


def make_banks(dim: int, inter: int, packed: bool = False, shm_gb: float = 0.0) -> Banks:
    gen = torch.Generator().manual_seed(0)
    dtype = torch.uint8 if packed else torch.bfloat16
    shapes = [(2 * inter, dim // 2), (dim, inter // 2)] if packed else [(2 * inter, dim), (dim, inter)]
    if shm_gb:
        host_w13, host_w2 = shm_banks(shapes, dtype, shm_gb)
    elif packed:  # 4-bit: two values a byte
        host_w13 = torch.randint(0, 256, (HOST_EXPERTS, 2 * inter, dim // 2), dtype=torch.uint8, generator=gen)
        host_w2 = torch.randint(0, 256, (HOST_EXPERTS, dim, inter // 2), dtype=torch.uint8, generator=gen)
    else:
        host_w13 = (torch.randn(HOST_EXPERTS, 2 * inter, dim, generator=gen) * dim**-0.5).bfloat16()
        host_w2 = (torch.randn(HOST_EXPERTS, dim, inter, generator=gen) * inter**-0.5).bfloat16()
    if not shm_gb:
        host_w13, host_w2 = host_w13.pin_memory(), host_w2.pin_memory()
    w13 = torch.zeros(SLOTS, *host_w13.shape[1:], dtype=host_w13.dtype, device="cuda")
    w2 = torch.zeros(SLOTS, *host_w2.shape[1:], dtype=host_w2.dtype, device="cuda")
    slots = torch.arange(TOP_K, device="cuda").view(1, TOP_K)  # misses take slots [0, m), hits the rest
    return Banks(host_w13, host_w2, w13, w2, torch.randn(1, dim, device="cuda").bfloat16(),
                 torch.rand(1, TOP_K, device="cuda"), slots)


def fill_ways(b: Banks, misses: int, plan: list, sweep: bool) -> dict:
    """Each way of bringing ``misses`` experts in, as a function of the repetition."""
    srcs = [p.src_id.tolist() for p in plan]  # off the timed loop: the host knows a memcpy's experts

    def memcpy(rep: int) -> None:
        for j, src in enumerate(srcs[rep][:misses]):
            b.w13[j].copy_(b.host_w13[src], non_blocking=True)
            b.w2[j].copy_(b.host_w2[src], non_blocking=True)

    def gemm(cfg: DecodeConfig | None):
        return lambda rep: decode_grouped_swiglu(b.hidden, b.weights, b.slots, b.w13, b.w2, cfg,
                                                 fill=SlotFill(plan[rep], b.host_w13, b.host_w2))

    def gather(programs: int):
        return lambda rep: gather_missing(*plan[rep], b.host_w13, b.host_w2, b.w13, b.w2, programs=programs)

    ways = {"memcpy": memcpy, "gather": gather(0), **{f"gather {n}": gather(n) for n in GATHER_PROGRAMS}}
    if b.w13.dtype == torch.uint8:  # packed: no GEMM over raw bytes
        return ways
    ways["gemm"] = lambda rep: grouped_swiglu(b.hidden, b.weights, b.slots, b.w13, b.w2,
                                              fill=SlotFill(plan[rep], b.host_w13, b.host_w2))
    for tiles in SWEEP if sweep else []:
        ways["gemm " + " ".join(f"{k}={v}" for k, v in tiles.items())] = gemm(DecodeConfig(**tiles))
    return ways


def time_ways(b: Banks, misses: int, alone: float, reps: int, sweep: bool) -> list[dict]:
    plan = plans(misses, reps + 1, b.host_w13.shape[0])
    mb, bound = misses * b.expert_bytes / 1e6, misses * b.expert_bytes / PCIE_BYTES_PER_S * 1e6
    rows = []
    for way, run in fill_ways(b, misses, plan, sweep).items():
        us = timed(run, reps)
        fill_us = us - alone if way.startswith("gemm") else us
        rows.append(dict(misses=misses, way=way, mb=mb, us=us, alone=alone, fill_us=fill_us,
                         gb_s=mb / fill_us * 1e3, bound_us=bound, ratio=bound / us))
    return rows


class Beside(NamedTuple):
    """Dense work on the compute stream (four GEMVs over ``weight``) and a side stream for gathers."""
    weight: torch.Tensor
    x: torch.Tensor
    side: torch.cuda.Stream

    def once(self, gather) -> tuple[float, float, float]:
        """us of the GEMVs, of ``gather()`` on the side stream (None: none), and of both together."""
        events = [torch.cuda.Event(enable_timing=True) for _ in range(4)]
        events[0].record()
        if gather is not None:
            self.side.wait_event(events[0])
            with torch.cuda.stream(self.side):
                gather()
                events[2].record()
        for _ in range(4):
            torch.mv(self.weight, self.x)
        events[1].record()
        if gather is not None:
            torch.cuda.current_stream().wait_event(events[2])
        events[3].record()
        events[3].synchronize()
        gather_us = events[0].elapsed_time(events[2]) * 1e3 if gather is not None else 0.0
        return events[0].elapsed_time(events[1]) * 1e3, gather_us, events[0].elapsed_time(events[3]) * 1e3


def beside_ways(b: Banks, misses: int, reps: int) -> dict:
    """Each gather to run beside the GEMVs, by name, as a function of the rep: from the host banks
    at each width, and by one and 32 programs from copies of the first experts in HBM (no PCIe)."""
    host_plan = plans(misses, reps + 1, b.host_w13.shape[0])
    hbm = [t[:HOST_EXPERTS].to("cuda", copy=True) for t in (b.host_w13, b.host_w2)]  # device views too
    hbm_plan = plans(misses, reps + 1, HOST_EXPERTS)

    def gather(plan, banks, programs):
        return lambda rep: lambda: gather_missing(*plan[rep], *banks, b.w13, b.w2, programs=programs)

    ways = {"none": lambda rep: None}
    for programs in BESIDE_PROGRAMS:
        ways["wide grid" if programs == 0 else f"{programs} programs"] = gather(host_plan,
                                                                               (b.host_w13, b.host_w2), programs)
    for programs in (1, 32):
        ways[f"{programs} from HBM"] = gather(hbm_plan, hbm, programs)
    return ways


def beside_rows(b: Banks, misses: int, reps: int) -> list[dict]:
    """The GEMVs alone, and beside a gather of ``misses`` experts on a side stream (each way)."""
    beside = Beside(torch.randn(16384, 4096, dtype=torch.bfloat16, device="cuda"),
                    torch.randn(4096, dtype=torch.bfloat16, device="cuda"), torch.cuda.Stream())
    gemv_bound = 4 * beside.weight.numel() * beside.weight.element_size() / HBM_BYTES_PER_S * 1e6
    rows = []
    for way, gather in beside_ways(b, misses, reps).items():
        beside.once(gather(reps))  # compile, and other experts than the timed reps'
        times = [beside.once(gather(rep)) for rep in range(reps)]
        gemv, gather_us, both = (sum(t[i] for t in times) / reps for i in range(3))
        pcie = way not in ("none",) and "HBM" not in way
        rows.append(dict(misses=misses, way=way, gemv_us=gemv, gemv_bound_us=gemv_bound, gather_us=gather_us,
                         gather_bound_us=misses * b.expert_bytes / PCIE_BYTES_PER_S * 1e6 if pcie else 0.0,
                         both_us=both, gb_s=misses * b.expert_bytes / gather_us / 1e3 if gather_us else 0.0))
    return rows


def print_beside(rows: list[dict]) -> None:
    print(f"\nbeside dense work: four GEMVs over 128 MB of bf16 on the compute stream, the gather on a side stream "
          f"(the few programs of {gather_mod.STEP_WARPS} warps each)")
    print_table([("misses", "misses", ">6"), ("gather", "way", ">12"), ("GEMVs us", "gemv_us", ">9.1f"),
                 ("HBM bound", "gemv_bound_us", ">9.1f"), ("gather us", "gather_us", ">9.1f"),
                 ("GB/s", "gb_s", ">6.1f"), ("PCIe bound", "gather_bound_us", ">10.1f"),
                 ("both us", "both_us", ">8.1f")], rows)


def main() -> None:
    p = bench_parser(__doc__)
    p.add_argument("--misses", type=int, nargs="+", default=[1, 2, 4, 8])
    p.add_argument("--reps", type=int, default=12)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--inter", type=int, default=768)
    p.add_argument("--sweep", action="store_true", help="also time other tiles of the GEMM's fill")
    p.add_argument("--beside", action="store_true", help="also time gathers beside dense work, per width")
    p.add_argument("--step-warps", type=int, default=gather_mod.STEP_WARPS,
                   help="warps of each of the few programs' gather (gather_missing.STEP_WARPS)")
    p.add_argument("--packed", action="store_true", help="4-bit banks (bytes): gather and memcpy rows only")
    p.add_argument("--shm-gb", type=float, default=0.0, metavar="G",
                   help="host banks in a G GB registered shared-memory segment (the expert store's way)")
    args = p.parse_args()
    gather_mod.STEP_WARPS = args.step_warps
    b = make_banks(args.hidden, args.inter, args.packed, args.shm_gb)
    alone = 0.0 if args.packed else graph_timed(lambda: grouped_swiglu(b.hidden, b.weights, b.slots, b.w13, b.w2),
                                                args.reps)
    rows = [row for misses in args.misses for row in time_ways(b, misses, alone, args.reps, args.sweep)]
    print(f"{torch.cuda.get_device_name()}, experts {2 * args.inter}x{args.hidden} + {args.hidden}x{args.inter} "
          f"{'4-bit' if args.packed else 'bf16'}, {b.expert_bytes / 1e6:.2f} MB each; the batch-1 GEMM alone "
          f"(8 hits): {alone:.1f} us")
    print_table([("misses", "misses", ">6"), ("way", "way", ">16"), ("MB", "mb", ">6.1f"), ("us", "us", ">8.1f"),
                 ("fill us", "fill_us", ">8.1f"), ("GB/s", "gb_s", ">6.1f"), ("bound us", "bound_us", ">8.1f"),
                 ("ratio", "ratio", ">6.3f")], rows)
    beside = [row for misses in args.misses for row in beside_rows(b, misses, args.reps)] if args.beside else []
    if beside:
        print_beside(beside)
    write_json(args.json, rows + beside)


if __name__ == "__main__":
    main()
