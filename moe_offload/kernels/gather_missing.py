"""Copy the experts of a copy plan from the host banks into their cache slots.

On CUDA the host banks are pinned, mapped host memory (or device views of it): the kernel reads
them through their device addresses (zero-copy over PCIe), so a decode step with misses needs no
``cudaMemcpy`` the host would have to size, and is capturable in a CUDA graph. The grid is fixed
by the expert's size and the plan's capacity: program ``(p, q)`` copies block ``p`` of planned
experts ``q, q + SPLIT, ...`` below the count read on the device, so a step without misses costs one
launch of empty loops, and a decode step's few misses are read side by side, not one after another
(PCIe reads are latency-bound: the more in flight, the closer to the link's rate).

The kernel copies raw bytes (each bank viewed as the integer type of its item size), so one kernel
serves bf16 banks, fp8 and 4-bit banks (1 byte) and their scale banks alike, and every bank of a
call in one launch: the grid's first axis runs over the banks' blocks one bank after another
(``MAX_BANKS`` at most: w13, w2 and nvfp4's four scale banks), so a decode step's small scale rows
cross PCIe beside each other, not one launch's latency after another's. Where both sides are expert
records (``moe_offload.expert_records``: the store's and the cache's), the call moves whole records,
one bank; a side of banks of their own is read through its row strides.

With ``programs`` the launch is that many programs, which deal the planned rows among them in
``STEP``-item steps, instead of a program per block of every planned expert. The wide grid holds
every SM while its programs wait on PCIe, so the kernels that run beside it (the decode prefetch's
gather runs beside the dense GEMVs) wait for SMs; a few programs of 8 warps, each with a step in
flight, keep the link as busy and leave most SMs free. They also read one expert faster than the
wide grid (on the H200 50.6 against 43.3 GB/s for a 9.4 MB bf16 expert; equal from two on), so
the decode's own misses are gathered so too (``slot_fill.MISS_PROGRAMS``).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from moe_offload.expert_records import whole_records
from moe_offload.kernels.triton_support import pdl_args, raw_bytes, use_triton

BLOCK = 4096
SPLIT = 8  # programs per block, each taking every SPLIT-th planned expert
MAX_BANKS = 6
ARGS = 5  # a bank's arguments: host, slots, an expert's items, the two row strides
STEP = 8192  # items a step of the few programs (8 KB of fp8 or 4-bit, 16 KB of bf16)
STEP_WARPS = 8
PROGRAMS = 32  # the few-program form's width: 32 steps of 8-16 KB in flight, enough for the link


def check_gather(plan_src: torch.Tensor, plan_dst: torch.Tensor, count: torch.Tensor,
                 banks: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """The host-side checks of a gather over ``(host, slots)`` bank pairs (metadata only)."""
    if plan_src.dim() != 1 or plan_src.shape != plan_dst.shape or count.numel() != 1:
        raise ValueError("plan_src and plan_dst must be [P] and count [1]")
    if any(t.dtype != torch.int32 or not t.is_contiguous() for t in (plan_src, plan_dst, count)):
        raise ValueError("plan_src, plan_dst and count must be contiguous int32")
    slot_device = banks[0][1].device
    if any(t.device != slot_device for t in (plan_src, plan_dst, count)):
        raise ValueError("the copy plan must be on the slot pools' device")
    for host, slots in banks:
        if host.dim() != 3 or host.shape[1:] != slots.shape[1:] or host.dtype != slots.dtype:
            raise ValueError(f"host bank {tuple(host.shape)} {host.dtype} does not match slots "
                             f"{tuple(slots.shape)} {slots.dtype}")
        if not (host[0].is_contiguous() and slots[0].is_contiguous()) or slots.device != slot_device:
            raise ValueError("an expert's rows must be contiguous in the host banks and slot pools, the pools on "
                             "one device")
    if len({host.shape[0] for host, _ in banks}) != 1 or len({slots.shape[0] for _, slots in banks}) != 1:
        raise ValueError("every bank (w13, w2 and any scales) must hold the same experts and slots")


def gather_missing(plan_src: torch.Tensor, plan_dst: torch.Tensor, count: torch.Tensor,
                   host_w13: torch.Tensor, host_w2: torch.Tensor, slot_w13: torch.Tensor, slot_w2: torch.Tensor,
                   backend: str | None = None, host_scales: tuple[torch.Tensor, ...] | None = None,
                   slot_scales: tuple[torch.Tensor, ...] | None = None, programs: int = 0) -> None:
    """Copy rows ``host[plan_src[i]] -> slots[plan_dst[i]]`` for ``i < count``, every bank, in one
    launch: over the wide grid, or with ``programs > 0`` over that many programs (a gather beside
    compute).

    ``host_w13 [L*E, 2I, H]``, ``host_w2 [L*E, H, I]``, ``slot_w13 [S, 2I, H]``, ``slot_w2 [S, H, I]``;
    quantized banks also move their scales: ``host_scales`` (each ``[L*E, R, C]``; fp8's w13 and w2,
    nvfp4's also its channel scales: at most ``MAX_BANKS - 2``) into ``slot_scales`` (``[S, R, C]``
    each, in the same order).
    Plan entries are not checked (that would read the device): ``lookup_admit`` produces them in
    range. On CUDA the host banks must be device-addressable (pinned/registered, or device views).
    """
    banks = _pairs(host_w13, host_w2, slot_w13, slot_w2, host_scales, slot_scales)
    check_gather(plan_src, plan_dst, count, banks)
    gather_pairs(plan_src, plan_dst, count, whole_records(banks), backend, programs)


def gather_pairs(plan_src: torch.Tensor, plan_dst: torch.Tensor, count: torch.Tensor,
                 banks: list[tuple[torch.Tensor, torch.Tensor]], backend: str | None = None, programs: int = 0) -> None:
    """``gather_missing`` over ``(host, slots)`` pairs that ``check_gather`` passed, resolved to whole
    records where both sides are (``whole_records``): for an owner that gathers from the same banks
    every layer and resolves them once (the mirror's repairs)."""
    if programs < 0:
        raise ValueError(f"programs must be 0 (the wide grid) or a count of programs, not {programs}")
    if not use_triton(banks[0][1], backend):
        gather_missing_eager(plan_src, plan_dst, count, banks)
    elif programs:
        _launch_few(plan_src, plan_dst, count, banks, programs)
    else:
        _launch(plan_src, plan_dst, count, banks)


def _launch(plan_src: torch.Tensor, plan_dst: torch.Tensor, count: torch.Tensor,
            banks: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """One launch over every bank: each bank's (host, slots, an expert's items) as raw bytes, padded
    to ``MAX_BANKS`` with the first bank, and where each bank's blocks start on the grid (the
    padding's start at the grid's end, so no program reaches it)."""
    args, starts, total = _bank_args(banks), [], 0
    for numel in args[2:ARGS * len(banks):ARGS]:
        starts.append(total)
        total += _num_blocks(numel)
    starts += [total] * (MAX_BANKS - len(banks))
    split = max(1, min(SPLIT, plan_src.shape[0]))
    gather_missing_kernel[(total, split)](plan_src, plan_dst, count, *args, *starts[1:], BLOCK=BLOCK,
                                          **pdl_args(banks[0][1]))


def _launch_few(plan_src: torch.Tensor, plan_dst: torch.Tensor, count: torch.Tensor,
                banks: list[tuple[torch.Tensor, torch.Tensor]], programs: int) -> None:
    """One launch of ``programs`` programs over every bank (the padding's banks are not visited)."""
    gather_missing_few_kernel[(programs,)](plan_src, plan_dst, count, *_bank_args(banks), NUM_BANKS=len(banks),
                                           STEP=STEP, num_warps=STEP_WARPS, **pdl_args(banks[0][1]))


def _bank_args(banks: list[tuple[torch.Tensor, torch.Tensor]]) -> list:
    """Each bank's (host, slots, an expert's items, the host's and the slots' row strides) as raw
    bytes, padded to ``MAX_BANKS`` with the first bank's. Either side may be expert records
    (``expert_records``): then its rows are strided."""
    args = []
    for host, slots in banks:
        host, slots = raw_bytes(host), raw_bytes(slots)
        args += [host, slots, host[0].numel(), host.stride(0), slots.stride(0)]
    return args + args[:ARGS] * (MAX_BANKS - len(banks))


def _pairs(host_w13: torch.Tensor, host_w2: torch.Tensor, slot_w13: torch.Tensor, slot_w2: torch.Tensor,
           host_scales: tuple[torch.Tensor, ...] | None,
           slot_scales: tuple[torch.Tensor, ...] | None) -> list[tuple[torch.Tensor, torch.Tensor]]:
    if (host_scales is None) != (slot_scales is None):
        raise ValueError("scales must be given for both the host banks and the slots, or for neither")
    if host_scales is not None and (len(host_scales) != len(slot_scales) or len(host_scales) > MAX_BANKS - 2):
        raise ValueError(f"{len(host_scales)} host and {len(slot_scales)} slot scale banks: give the same number, "
                         f"at most {MAX_BANKS - 2}")
    pairs = [(host_w13, slot_w13), (host_w2, slot_w2)]
    return pairs + list(zip(host_scales, slot_scales)) if host_scales is not None else pairs


def _num_blocks(numel: int) -> int:
    return -(-numel // BLOCK)


def gather_missing_eager(plan_src: torch.Tensor, plan_dst: torch.Tensor, count: torch.Tensor,
                         banks: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Reference twin over ``(host, slots)`` bank pairs: reads the count on the host (CPU path and
    oracle only)."""
    num = int(count[0])
    for host, slots in banks:
        src = plan_src[:num].long().to(host.device)
        slots[plan_dst[:num].long()] = host[src].to(slots.device)


@triton.jit
def _copy_part(src_ptr, dst_ptr, numel, src_row, dst_row, offs, plan_src_ptr, plan_dst_ptr, j):
    """Items ``offs`` (below ``numel``) of planned expert ``j``'s row: host -> its slot."""
    src = tl.load(plan_src_ptr + j).to(tl.int64)
    dst = tl.load(plan_dst_ptr + j).to(tl.int64)
    inside = offs < numel
    vals = tl.load(src_ptr + src * src_row + offs, mask=inside)
    tl.store(dst_ptr + dst * dst_row + offs, vals, mask=inside)


@triton.jit
def _copy_block(src_ptr, dst_ptr, numel, src_row, dst_row, block, plan_src_ptr, plan_dst_ptr, count,
                BLOCK: tl.constexpr):
    """Block ``block`` of every planned expert this program takes (every num_programs(1)-th)."""
    offs = block.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    for j in range(tl.program_id(1), count, tl.num_programs(1)):
        _copy_part(src_ptr, dst_ptr, numel, src_row, dst_row, offs, plan_src_ptr, plan_dst_ptr, j)


@triton.jit
def gather_missing_kernel(plan_src_ptr, plan_dst_ptr, count_ptr,
                          src0, dst0, numel0, srow0, drow0, src1, dst1, numel1, srow1, drow1,
                          src2, dst2, numel2, srow2, drow2, src3, dst3, numel3, srow3, drow3,
                          src4, dst4, numel4, srow4, drow4, src5, dst5, numel5, srow5, drow5,
                          start1, start2, start3, start4, start5, BLOCK: tl.constexpr, PDL: tl.constexpr):
    if PDL:  # see triton_support.pdl_args
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    pid = tl.program_id(0)
    count = tl.load(count_ptr)
    if pid < start1:
        _copy_block(src0, dst0, numel0, srow0, drow0, pid, plan_src_ptr, plan_dst_ptr, count, BLOCK)
    elif pid < start2:
        _copy_block(src1, dst1, numel1, srow1, drow1, pid - start1, plan_src_ptr, plan_dst_ptr, count, BLOCK)
    elif pid < start3:
        _copy_block(src2, dst2, numel2, srow2, drow2, pid - start2, plan_src_ptr, plan_dst_ptr, count, BLOCK)
    elif pid < start4:
        _copy_block(src3, dst3, numel3, srow3, drow3, pid - start3, plan_src_ptr, plan_dst_ptr, count, BLOCK)
    elif pid < start5:
        _copy_block(src4, dst4, numel4, srow4, drow4, pid - start4, plan_src_ptr, plan_dst_ptr, count, BLOCK)
    else:
        _copy_block(src5, dst5, numel5, srow5, drow5, pid - start5, plan_src_ptr, plan_dst_ptr, count, BLOCK)


@triton.jit
def _deal_steps(src_ptr, dst_ptr, numel, src_row, dst_row, plan_src_ptr, plan_dst_ptr, count, STEP: tl.constexpr):
    """Every planned expert's items of one bank, cut into ``STEP``-item steps dealt round-robin to
    the programs."""
    steps = tl.cdiv(numel, STEP)
    for w in range(tl.program_id(0), count * steps, tl.num_programs(0)):
        j = w // steps
        offs = (w - j * steps).to(tl.int64) * STEP + tl.arange(0, STEP)
        _copy_part(src_ptr, dst_ptr, numel, src_row, dst_row, offs, plan_src_ptr, plan_dst_ptr, j)


@triton.jit
def gather_missing_few_kernel(plan_src_ptr, plan_dst_ptr, count_ptr,
                              src0, dst0, numel0, srow0, drow0, src1, dst1, numel1, srow1, drow1,
                              src2, dst2, numel2, srow2, drow2, src3, dst3, numel3, srow3, drow3,
                              src4, dst4, numel4, srow4, drow4, src5, dst5, numel5, srow5, drow5,
                              NUM_BANKS: tl.constexpr, STEP: tl.constexpr, PDL: tl.constexpr):
    if PDL:  # see triton_support.pdl_args
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    count = tl.load(count_ptr)
    _deal_steps(src0, dst0, numel0, srow0, drow0, plan_src_ptr, plan_dst_ptr, count, STEP)
    _deal_steps(src1, dst1, numel1, srow1, drow1, plan_src_ptr, plan_dst_ptr, count, STEP)
    if NUM_BANKS > 2:
        _deal_steps(src2, dst2, numel2, srow2, drow2, plan_src_ptr, plan_dst_ptr, count, STEP)
    if NUM_BANKS > 3:
        _deal_steps(src3, dst3, numel3, srow3, drow3, plan_src_ptr, plan_dst_ptr, count, STEP)
    if NUM_BANKS > 4:
        _deal_steps(src4, dst4, numel4, srow4, drow4, plan_src_ptr, plan_dst_ptr, count, STEP)
    if NUM_BANKS > 5:
        _deal_steps(src5, dst5, numel5, srow5, drow5, plan_src_ptr, plan_dst_ptr, count, STEP)
