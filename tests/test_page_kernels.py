"""Parity of the KV page-move kernels (write_pages / load_pages) with their eager twin, and their
host-side bounds checks. Interpreted on the CPU (TRITON_INTERPRET=1, tiny sizes); compiled and
sync-free on a GPU, reading and writing the mapped host pool in place."""
from __future__ import annotations

import os
from typing import NamedTuple

import pytest
import torch

# The interpreter is chosen when a kernel is decorated, i.e. lazily on the first launch inside a
# test; on a GPU the kernels must compile instead.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from worker.kv import page_copy  # noqa: E402
from worker.kv.host_pool import HostKVPool  # noqa: E402
from worker.kv.page_copy import build_plan, copy_page_runs, load_pages, write_pages  # noqa: E402

interpreted = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs TRITON_INTERPRET=1")
TRIALS = 20


class Shape(NamedTuple):
    layers: int
    device_pages: int
    host_pages: int
    page_size: int
    kv_heads: int
    head_dim: int
    capacity: int


SHAPES = {
    "one-block": Shape(2, 9, 7, 4, 2, 8, 6),
    "two-blocks-partial": Shape(3, 6, 12, 16, 2, 48, 8),  # 1536 elements a page: blocks of 1024, masked tail
    "odd-full-capacity": Shape(1, 5, 5, 1, 1, 3, 5),  # plans may fill their capacity exactly
}


def pools(shape: Shape, gen: torch.Generator) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    page = (shape.page_size, shape.kv_heads, shape.head_dim)
    device = [torch.randn(shape.layers, shape.device_pages, *page, generator=gen) for _ in range(2)]
    host = [torch.randn(shape.layers, shape.host_pages, *page, generator=gen) for _ in range(2)]
    return device, host


def random_pairs(num_src: int, num_dst: int, capacity: int, gen: torch.Generator) -> tuple[list[int], list[int]]:
    """Sources may repeat; destinations are distinct (a plan writes each page once)."""
    count = int(torch.randint(0, min(capacity, num_dst) + 1, (1,), generator=gen))
    src = torch.randint(num_src, (count,), generator=gen).tolist()
    dst = torch.randperm(num_dst, generator=gen)[:count].tolist()
    return src, dst


def naive(src_ids, dst_ids, src, dst):
    """Page by page in Python: the twin's own oracle."""
    out = [t.clone() for t in dst]
    for s, d in zip(src_ids, dst_ids):
        for o, t in zip(out, src):
            o[:, d] = t[:, s]
    return out


def run_trial(shape: Shape, seed: int, backend: str) -> None:
    gen = torch.Generator().manual_seed(seed)
    device, host = pools(shape, gen)
    for direction in ("write", "load"):
        src_pool, dst_pool = (device, host) if direction == "write" else (host, device)
        src, dst = random_pairs(src_pool[0].shape[1], dst_pool[0].shape[1], shape.capacity, gen)
        plan = build_plan(src, dst, shape.capacity, src_pool[0].shape[1], dst_pool[0].shape[1], torch.device("cpu"))
        assert plan.src.tolist()[len(src):] == [-1] * (shape.capacity - len(src))  # padding
        want = [t.clone() for t in dst_pool]
        page_copy.copy_pages_eager(plan, *src_pool, *want)
        got = [t.clone() for t in dst_pool]
        op = write_pages if direction == "write" else load_pages
        op(plan, *src_pool, *got, backend=backend)
        for g, w, n in zip(got, want, naive(src, dst, src_pool, dst_pool)):
            assert torch.equal(w, n), f"{direction}: twin differs from the naive copy"
            assert torch.equal(g, w), f"{direction}: {backend} differs from the twin"
        # out-of-range ids (a past-the-end page, or a negative one) never reach a launch
        limit = dst_pool[0].shape[1]
        bad = dst[:-1] + [limit] if dst else [int(torch.randint(2, (1,), generator=gen)) * (limit + 1) - 1]
        with pytest.raises(ValueError, match="outside"):
            build_plan(src or [0], bad, shape.capacity, src_pool[0].shape[1], limit, torch.device("cpu"))


@interpreted
@pytest.mark.parametrize("name", SHAPES)
def test_kernel_matches_twin_interpreted(name, monkeypatch):
    for trial in range(TRIALS):
        # odd trials: two programs per layer, so each loops over several (page, block) items
        monkeypatch.setattr(page_copy, "PROGRAMS", 2 * SHAPES[name].layers if trial % 2 else page_copy.PROGRAMS)
        run_trial(SHAPES[name], seed=trial, backend="triton")
        monkeypatch.undo()


@pytest.mark.parametrize("name", SHAPES)
def test_twin_and_memcpy_runs(name):
    """The eager path (what the CPU runs) and the per-run memcpy alternative agree with the naive copy."""
    shape = SHAPES[name]
    for trial in range(TRIALS):
        run_trial(shape, seed=trial, backend="eager")
        gen = torch.Generator().manual_seed(1000 + trial)
        device, host = pools(shape, gen)
        src, dst = random_pairs(shape.host_pages, shape.device_pages, shape.capacity, gen)
        want = naive(src, dst, host, device)
        copy_page_runs(src, dst, *host, *device)
        assert all(torch.equal(g, w) for g, w in zip(device, want))


def test_runs_merge_consecutive_pairs():
    assert page_copy.copy_runs([3, 4, 5, 9, 1], [7, 8, 2, 3, 4]) == [(3, 7, 2), (5, 2, 1), (9, 3, 1), (1, 4, 1)]
    assert page_copy.copy_runs([], []) == []


def test_bounds_and_shapes_are_checked_on_the_host():
    cpu = torch.device("cpu")
    with pytest.raises(ValueError, match="capacity"):
        build_plan([0, 1, 2], [0, 1, 2], 2, 4, 4, cpu)
    with pytest.raises(ValueError, match="sources"):
        build_plan([0, 1], [0], 4, 4, 4, cpu)
    with pytest.raises(ValueError, match="source page -1"):
        build_plan([-1], [0], 4, 4, 4, cpu)
    with pytest.raises(ValueError, match="destination page 4"):
        build_plan([0], [4], 4, 4, 4, cpu)
    with pytest.raises(ValueError, match="twice"):
        build_plan([0, 1], [2, 2], 4, 4, 4, cpu)
    with pytest.raises(ValueError, match="outside"):
        copy_page_runs([5], [0], *[torch.zeros(1, 4, 2, 1, 2)] * 4)
    device, host = pools(SHAPES["one-block"], torch.Generator().manual_seed(0))
    plan = build_plan([1], [2], 4, 9, 7, cpu)
    write_pages(plan, *device, *host)  # the shapes it was built for
    with pytest.raises(ValueError, match="plan built for"):
        load_pages(plan, *host, *device)  # 7 -> 9 pages, not 9 -> 7
    with pytest.raises(ValueError, match="page shape"):
        write_pages(plan, *device, *(t[:, :, :2].contiguous() for t in host))
    with pytest.raises(ValueError, match="contiguous"):
        write_pages(plan, *device, *(t.transpose(2, 3) for t in host))


# ==== on a GPU ====

@pytest.mark.cuda
@pytest.mark.parametrize("name", SHAPES)
def test_kernel_and_memcpy_on_cuda_without_syncs(name):
    """Device pool on the GPU, host pool pinned and mapped: both moves and the memcpy runs, under
    sync debug mode, against the twin on the CPU."""
    shape = SHAPES[name]
    cuda = torch.device("cuda")
    for trial in range(TRIALS):
        gen = torch.Generator().manual_seed(trial)
        device, host = pools(shape, gen)
        mapped = HostKVPool(shape.layers, shape.host_pages, shape.page_size, shape.kv_heads, shape.head_dim,
                            torch.float32, cuda)
        mapped.k.copy_(host[0])
        mapped.v.copy_(host[1])
        gpu = [t.to(cuda) for t in device]
        w_src, w_dst = random_pairs(shape.device_pages, shape.host_pages, shape.capacity, gen)
        l_src, l_dst = random_pairs(shape.host_pages, shape.device_pages, shape.capacity, gen)
        want_host = naive(w_src, w_dst, device, host)
        want_device = naive(l_src, l_dst, want_host, device)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            plan = build_plan(w_src, w_dst, shape.capacity, shape.device_pages, shape.host_pages, cuda)
            write_pages(plan, *gpu, mapped.kernel_k, mapped.kernel_v)
            plan = build_plan(l_src, l_dst, shape.capacity, shape.host_pages, shape.device_pages, cuda)
            load_pages(plan, mapped.kernel_k, mapped.kernel_v, *gpu)
            again = [t.clone() for t in gpu]
            copy_page_runs(l_src, l_dst, mapped.k, mapped.v, *again)
        finally:
            torch.cuda.set_sync_debug_mode(0)
        torch.cuda.synchronize()
        assert torch.equal(mapped.k, want_host[0]) and torch.equal(mapped.v, want_host[1])
        assert all(torch.equal(g.cpu(), w) for g, w in zip(gpu, want_device))
        assert all(torch.equal(g.cpu(), w) for g, w in zip(again, want_device))
