"""Move KV pages between the GPU pool and the host pool: ``write_pages`` (device -> host) and
``load_pages`` (host -> device), over a copy plan of ``(src_page, dst_page)`` pairs.

    pools  k, v : [layers, pages, page_size, kv_heads, head_dim]   (same layout on both sides)
    plan        : src [C] int32, dst [C] int32 (padded with -1), count [1] int32, all on the device

The plan is built on the host from Python ints (the scheduler knows every page id), bounds checked
there, and sent in one non-blocking copy; the kernel reads the count on the device, so a move never
makes the host wait. On CUDA the host pool is pinned and mapped: the Triton kernel reads or writes
it through its device address (zero-copy over PCIe). ``copy_page_runs`` is the alternative, one
``cudaMemcpyAsync`` per layer and contiguous run, sized on the host; the benchmark compares them.
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import torch

from moe_offload.copy_runs import copy_runs
from moe_offload.kernels.triton_support import next_pow2, use_triton

MAX_BLOCK = 1024
PROGRAMS = 4096  # programs per launch over all layers: enough loads in flight to cover PCIe latency
COPY_METHODS = ("kernel", "memcpy")  # the zero-copy kernel over a plan, or copy_page_runs
PLAN_CAPACITY = 512  # pairs per launch; longer moves take several launches of the same shape


class PagePlan(NamedTuple):
    src: torch.Tensor  # [C] int32, -1 past count
    dst: torch.Tensor  # [C] int32, -1 past count
    count: torch.Tensor  # [1] int32
    src_pages: int  # page counts of the pools the ids were checked against
    dst_pages: int

    @property
    def capacity(self) -> int:
        return self.src.shape[0]


def build_plan(src: list[int], dst: list[int], capacity: int, src_pages: int, dst_pages: int,
               device: torch.device) -> PagePlan:
    """Check the pairs on the host (ValueError when out of range, a destination repeats, or they
    exceed ``capacity``), pad them with -1 and send them to ``device`` in one copy."""
    if len(src) != len(dst) or len(src) > capacity:
        raise ValueError(f"{len(src)} sources and {len(dst)} destinations for a plan of capacity {capacity}")
    for ids, limit, what in ((src, src_pages, "source"), (dst, dst_pages, "destination")):
        bad = [p for p in ids if not 0 <= p < limit]
        if bad:
            raise ValueError(f"{what} page {bad[0]} outside the pool of {limit} pages")
    if len(set(dst)) != len(dst):
        raise ValueError("a destination page appears twice in one plan")
    pad = [-1] * (capacity - len(src))
    host = torch.tensor(src + pad + dst + pad + [len(src)], dtype=torch.int32)
    if device.type == "cuda":
        host = host.pin_memory().to(device, non_blocking=True)
    return PagePlan(host[:capacity], host[capacity:2 * capacity], host[2 * capacity:], src_pages, dst_pages)


def write_pages(plan: PagePlan, device_k: torch.Tensor, device_v: torch.Tensor, host_k: torch.Tensor,
                host_v: torch.Tensor, backend: str | None = None) -> None:
    """Copy device pages ``plan.src`` to host pages ``plan.dst``."""
    copy_pages(plan, device_k, device_v, host_k, host_v, backend)


def load_pages(plan: PagePlan, host_k: torch.Tensor, host_v: torch.Tensor, device_k: torch.Tensor,
               device_v: torch.Tensor, backend: str | None = None) -> None:
    """Copy host pages ``plan.src`` to device pages ``plan.dst``."""
    copy_pages(plan, host_k, host_v, device_k, device_v, backend)


def copy_pages(plan: PagePlan, src_k: torch.Tensor, src_v: torch.Tensor, dst_k: torch.Tensor,
               dst_v: torch.Tensor, backend: str | None = None) -> None:
    """``dst[:, plan.dst[i]] = src[:, plan.src[i]]`` for ``i < count``, K and V, in one launch.
    On CUDA a host pool must be device-addressable (pinned CPU tensors, or device views of them)."""
    _check(plan, src_k, src_v, dst_k, dst_v)
    if src_k.element_size() == 1:  # float8 pools move as bytes (torch has no CPU index_copy_ for float8)
        src_k, src_v, dst_k, dst_v = (t.view(torch.uint8) for t in (src_k, src_v, dst_k, dst_v))
    if use_triton(plan.count, backend):
        layers, numel = src_k.shape[0], src_k[0, 0].numel()
        block = min(next_pow2(numel), MAX_BLOCK)
        blocks_per_page = -(-numel // block)
        programs = max(1, min(plan.capacity * blocks_per_page, PROGRAMS // layers))
        _kernel()[(programs, layers)](src_k, src_v, dst_k, dst_v, plan.src, plan.dst, plan.count,
                                      plan.src_pages, plan.dst_pages, numel, blocks_per_page, BLOCK=block)
    else:
        copy_pages_eager(plan, src_k, src_v, dst_k, dst_v)


def copy_pages_eager(plan: PagePlan, src_k: torch.Tensor, src_v: torch.Tensor, dst_k: torch.Tensor,
                     dst_v: torch.Tensor) -> None:
    """Reference twin: reads the count on the host (CPU path and oracle only)."""
    num = int(plan.count[0])
    for src, dst in ((src_k, dst_k), (src_v, dst_v)):
        rows = src.index_select(1, plan.src[:num].long().to(src.device))
        dst.index_copy_(1, plan.dst[:num].long().to(dst.device), rows.to(dst.device))


def copy_page_runs(src: list[int], dst: list[int], src_k: torch.Tensor, src_v: torch.Tensor,
                   dst_k: torch.Tensor, dst_v: torch.Tensor) -> int:
    """The memcpy alternative: one async copy per layer, K/V and run of pages consecutive on both
    sides (pinned host tensors, not device views). Returns the number of copies issued."""
    for ids, limit, what in ((src, src_k.shape[1], "source"), (dst, dst_k.shape[1], "destination")):
        bad = [p for p in ids if not 0 <= p < limit]
        if bad:
            raise ValueError(f"{what} page {bad[0]} outside the pool of {limit} pages")
    copies = 0
    for s, d, n in copy_runs(src, dst):
        for layer in range(src_k.shape[0]):
            dst_k[layer, d:d + n].copy_(src_k[layer, s:s + n], non_blocking=True)
            dst_v[layer, d:d + n].copy_(src_v[layer, s:s + n], non_blocking=True)
            copies += 2
    return copies


def _check(plan: PagePlan, src_k: torch.Tensor, src_v: torch.Tensor, dst_k: torch.Tensor, dst_v: torch.Tensor) -> None:
    pools = (src_k, src_v, dst_k, dst_v)
    if any(t.dim() != 5 or not t.is_contiguous() for t in pools):
        raise ValueError("KV pools must be contiguous [layers, pages, page_size, kv_heads, head_dim]")
    if src_k.shape != src_v.shape or dst_k.shape != dst_v.shape:
        raise ValueError("K and V pools of one side must have the same shape")
    if src_k.shape[0] != dst_k.shape[0] or src_k.shape[2:] != dst_k.shape[2:] or \
            len({t.dtype for t in pools}) != 1:
        raise ValueError(f"pools {tuple(src_k.shape)} {src_k.dtype} and {tuple(dst_k.shape)} {dst_k.dtype} "
                         "differ in layers, page shape or dtype")
    # the ids were range-checked against these page counts when the plan was built
    if (src_k.shape[1], dst_k.shape[1]) != (plan.src_pages, plan.dst_pages):
        raise ValueError(f"plan built for pools of {plan.src_pages} -> {plan.dst_pages} pages, "
                         f"given {src_k.shape[1]} -> {dst_k.shape[1]}")
    if any(t.dtype != torch.int32 or not t.is_contiguous() for t in plan[:3]) or plan.count.numel() != 1 \
            or plan.src.shape != plan.dst.shape:
        raise ValueError("plan src/dst must be [C] and count [1], contiguous int32")
    if plan.count.is_cuda and any(not (t.is_cuda or t.is_pinned()) for t in pools):
        raise ValueError("on CUDA every pool must be device-addressable (a CUDA tensor or pinned host memory)")


@functools.cache
def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def copy_pages_kernel(src_k_ptr, src_v_ptr, dst_k_ptr, dst_v_ptr, plan_src_ptr, plan_dst_ptr, count_ptr,
                          src_pages, dst_pages, numel, blocks_per_page, BLOCK: tl.constexpr):
        # program (p, layer) strides over the (page, block) work items of its layer
        layer = tl.program_id(1).to(tl.int64)
        stride = tl.num_programs(0)
        offs = tl.arange(0, BLOCK)
        work = tl.load(count_ptr) * blocks_per_page
        for w in range(tl.program_id(0), work, stride):
            j = w // blocks_per_page
            inside = (w % blocks_per_page) * BLOCK + offs
            mask = inside < numel
            src = tl.load(plan_src_ptr + j).to(tl.int64)
            dst = tl.load(plan_dst_ptr + j).to(tl.int64)
            src_at = (layer * src_pages + src) * numel + inside
            dst_at = (layer * dst_pages + dst) * numel + inside
            tl.store(dst_k_ptr + dst_at, tl.load(src_k_ptr + src_at, mask=mask), mask=mask)
            tl.store(dst_v_ptr + dst_at, tl.load(src_v_ptr + src_at, mask=mask), mask=mask)

    return copy_pages_kernel
