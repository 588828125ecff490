"""Stage one layer's experts into a prefill buffer: every expert of the layer, in expert order (or,
under expert parallelism, a rank's share: experts ``first, first + stride, ...``, at ``(e - first) / stride``).

An expert resident in the cache outside the lent range (``slot_for_id >= lent``) is copied from its
slot (device to device, HBM); every other one is read from the host bank (PCIe). Which is which is
read on the device, per expert, so the host never learns how many hit:

```
 buf[e] = pool[slot_for_id[layer*E + e]]   if that slot >= lent      (hit: HBM)
          host[layer*E + e]                 otherwise                 (miss: PCIe, zero-copy)
```

Why a kernel rather than ``cudaMemcpyAsync``: the misses are not contiguous and only the device
knows them, so copy-engine transfers would have to cover the whole layer (no PCIe saved by a hit)
or be sized on the host (a sync). The kernel is persistent with a small grid (``programs`` CTAs
loop over (expert, block) work items) so that the grouped GEMM on the compute stream keeps most of
the SMs; it reads mapped host memory through its device address (about 51-55 GB/s measured for the
decode gather). ``scripts/bench_prefill.py`` measures it against a whole-layer copy-engine copy.

Like the gather it copies raw bytes (``triton_support.raw_bytes``): fp8 banks and their float32 scale
banks are staged by the same kernel, one launch per bank, or one for whole records where the pool,
the host banks and the buffer are all expert records (``moe_offload.expert_records``).
"""
from __future__ import annotations

import functools
from typing import Sequence

import torch

from moe_offload.expert_records import whole_records
from moe_offload.kernels.triton_support import next_pow2, raw_bytes, use_triton

BLOCK = 8192  # elements per work item: 16 KB of bf16 in flight per CTA
PROGRAMS = 32  # CTAs: 512 KB in flight covers PCIe latency; the other SMs stay with the GEMM
STAGE_FIELDS = ("from_cache", "from_host")  # columns of the stats table, in experts


def share_count(num_experts: int, first: int, stride: int) -> int:
    """Experts ``first, first + stride, ...`` below ``num_experts``: how many a buffer holds."""
    if stride < 1 or not 0 <= first < num_experts:
        raise ValueError(f"expert share (first {first}, stride {stride}) does not fit {num_experts} experts")
    return len(range(first, num_experts, stride))


def check_stage(layer: int, num_experts: int, lent: int, slot_for_id: torch.Tensor,
                banks: list[tuple[torch.Tensor, ...]], stats: torch.Tensor, count: int) -> None:
    """Shapes, dtypes, devices and the buffer's place in the pool, all from metadata."""
    num_ids = slot_for_id.numel()
    if num_experts < 1 or num_ids % num_experts or not 0 <= layer < num_ids // num_experts:
        raise ValueError(f"layer {layer} of {num_experts} experts is outside slot_for_id of {num_ids} ids")
    if slot_for_id.dtype != torch.int32 or not slot_for_id.is_contiguous():
        raise ValueError("slot_for_id must be contiguous int32")
    shape = (num_ids // num_experts, len(STAGE_FIELDS))
    if stats.dtype != torch.int64 or stats.shape != shape or not stats.is_contiguous():
        raise ValueError(f"stats must be contiguous int64 {list(shape)}")
    for pool, host, buf in banks:
        if pool.dim() != 3 or host.shape[1:] != pool.shape[1:] or buf.shape != (count, *pool.shape[1:]):
            raise ValueError(f"pool {tuple(pool.shape)}, host {tuple(host.shape)} and buffer {tuple(buf.shape)} "
                             f"do not hold one expert shape (buffer: the {count} staged experts)")
        if host.shape[0] != num_ids or len({pool.dtype, host.dtype, buf.dtype}) != 1:
            raise ValueError(f"host bank of {host.shape[0]} experts / dtypes {pool.dtype}, {host.dtype}, {buf.dtype} "
                             f"do not match {num_ids} ids of one dtype")
        if not (pool[0].is_contiguous() and host[0].is_contiguous() and buf[0].is_contiguous()):
            raise ValueError("an expert's rows must be contiguous in the pools, host banks and buffers")
        if not count <= lent <= pool.shape[0]:
            raise ValueError(f"lent range [0, {lent}) must hold a buffer of {count} "
                             f"and fit the {pool.shape[0]} slots")
        # the buffer must lie in the lent range: a hit's source slot (>= lent) then never overlaps it
        offset, slot_bytes = buf.data_ptr() - pool.data_ptr(), pool.stride(0) * pool.element_size()
        if buf.device != pool.device or offset % slot_bytes or not 0 <= offset <= (lent - count) * slot_bytes:
            raise ValueError("the buffer must be a slot-aligned view of the pool inside its lent range")
        if len({pool.device, buf.device, slot_for_id.device, stats.device}) != 1:
            raise ValueError("pools, buffers, slot_for_id and stats must be on one device")


def stage_experts(layer: int, num_experts: int, lent: int, slot_for_id: torch.Tensor,
                  pool_w13: torch.Tensor, pool_w2: torch.Tensor, host_w13: torch.Tensor, host_w2: torch.Tensor,
                  buf_w13: torch.Tensor, buf_w2: torch.Tensor, stats: torch.Tensor,
                  backend: str | None = None, programs: int = PROGRAMS,
                  scales: Sequence[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = (),
                  first: int = 0, stride: int = 1) -> None:
    """Fill ``buf [n, ...]`` with experts ``first, first + stride, ...`` of ``layer`` (all ``E`` by
    default; a rank's share under expert parallelism), ``buf[j]`` = expert ``first + stride * j``:
    hits (slot >= ``lent``) from the pool ``[S, ...]``, the rest from the host bank ``[L*E, ...]``;
    ``stats[layer] += (hits, misses)``.
    fp8 banks stage their scale banks too: ``scales`` holds ``(pool, host, buf)`` for ``w13_scale``
    and ``w2_scale``, shaped like the weights' but ``[..., R, C]``.

    One launch per bank, fixed grids. On CUDA the host banks must be device-addressable (pinned
    or registered, or device views of mapped memory). Slot entries are not checked (that would read
    the device): ``lookup_admit`` keeps them in ``[0, S)`` or -1.
    """
    banks = [(pool_w13, host_w13, buf_w13), (pool_w2, host_w2, buf_w2), *scales]
    check_stage(layer, num_experts, lent, slot_for_id, banks, stats, share_count(num_experts, first, stride))
    stage_banks(layer, num_experts, lent, slot_for_id, whole_records(banks), stats, backend, programs,
                first, stride)


def stage_banks(layer: int, num_experts: int, lent: int, slot_for_id: torch.Tensor,
                banks: Sequence[tuple[torch.Tensor, torch.Tensor, torch.Tensor]], stats: torch.Tensor,
                backend: str | None = None, programs: int = PROGRAMS, first: int = 0, stride: int = 1) -> None:
    """``stage_experts`` over ``(pool, host, buf)`` banks that ``check_stage`` passed, resolved to
    whole records where every side is (``whole_records``: one launch): for an owner that stages
    from the same banks every layer and resolves them once (the prefill pipeline)."""
    if programs < 1:
        raise ValueError(f"programs must be >= 1, got {programs}")
    if not use_triton(banks[0][2], backend):
        stage_experts_eager(layer, num_experts, lent, slot_for_id, banks, stats, first, stride)
        return
    count = share_count(num_experts, first, stride)
    for i, bank in enumerate(banks):
        pool, host, buf = (raw_bytes(t) for t in bank)
        numel = pool[0].numel()
        grid = min(programs, count * -(-numel // BLOCK))
        _kernel()[(grid,)](slot_for_id, pool, host, buf, stats, layer, num_experts, first, stride, count, lent, numel,
                           pool.stride(0), host.stride(0), buf.stride(0), COUNT=i == 0, BLOCK=BLOCK, PROGRAMS=grid,
                           BLOCK_E=next_pow2(count), NUM_FIELDS=len(STAGE_FIELDS), num_warps=8)


def stage_experts_eager(layer: int, num_experts: int, lent: int, slot_for_id: torch.Tensor,
                        banks: Sequence[tuple[torch.Tensor, torch.Tensor, torch.Tensor]], stats: torch.Tensor,
                        first: int = 0, stride: int = 1) -> None:
    """Reference twin over ``(pool, host, buf)`` banks (or records): plain gathers and a select (CPU
    path and oracle; it copies every expert from both sources, so it saves no PCIe traffic)."""
    gids = layer * num_experts + torch.arange(first, num_experts, stride, device=slot_for_id.device)
    slots = slot_for_id[gids].long()
    hit = slots >= lent
    for pool, host, buf in banks:
        from_host = host[gids.to(host.device)].to(buf.device)
        buf.copy_(torch.where(hit.view(-1, *[1] * (buf.dim() - 1)), pool[slots.clamp(min=0)], from_host))
    num_hit = hit.sum()
    stats[layer].add_(torch.stack((num_hit, gids.numel() - num_hit)))


@functools.cache
def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def stage_experts_kernel(slot_for_id_ptr, pool_ptr, host_ptr, buf_ptr, stats_ptr,
                             layer, num_experts, first, stride, count, lent, numel, pool_row, host_row, buf_row,
                             COUNT: tl.constexpr, BLOCK: tl.constexpr, PROGRAMS: tl.constexpr,
                             BLOCK_E: tl.constexpr, NUM_FIELDS: tl.constexpr):
        pid = tl.program_id(0)
        blocks = tl.cdiv(numel, BLOCK)
        cols = tl.arange(0, BLOCK)
        # work item w = (buffer slot w // blocks, block w % blocks); neighbouring CTAs read neighbouring blocks
        for w in range(pid, count * blocks, PROGRAMS):
            e = w // blocks
            offs = (w - e * blocks).to(tl.int64) * BLOCK + cols
            inside = offs < numel
            gid = layer * num_experts + first + stride * e
            # one scalar branch per work item, so the load's mask is the same for the whole block
            # (the first version selected per lane with hit/miss masks and staged at ~7 GB/s)
            slot = tl.load(slot_for_id_ptr + gid).to(tl.int64)
            if slot >= lent:
                src = pool_ptr + slot * pool_row
            else:
                src = host_ptr + gid.to(tl.int64) * host_row
            tl.store(buf_ptr + e.to(tl.int64) * buf_row + offs, tl.load(src + offs, mask=inside), mask=inside)
        if COUNT:
            if pid == 0:
                es = tl.arange(0, BLOCK_E)
                slots = tl.load(slot_for_id_ptr + layer * num_experts + first + stride * es, mask=es < count, other=-1)
                hits = tl.sum((slots >= lent).to(tl.int64), axis=0)
                fields = tl.arange(0, 2)
                ptrs = stats_ptr + layer * NUM_FIELDS + fields
                old = tl.load(ptrs)
                tl.store(ptrs, old + tl.where(fields == 0, hits, count - hits))

    return stage_experts_kernel
