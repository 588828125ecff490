"""The host KV pool: pages of K and V in host RAM with the GPU pool's layout, handed out from a
free list. The radix cache keeps pages evicted from the GPU here, to restore them instead of
computing them again.

    k, v : [layers, num_pages, page_size, kv_heads, head_dim]   (one buffer, k then v)

On CUDA the buffer is registered as pinned, mapped memory (``cudaHostRegister``): copies run at
full PCIe speed and the page kernels address it from the device (``kernel_k``/``kernel_v``). It is
registered rather than allocated with ``pin_memory()`` because torch's pinned allocator rounds an
allocation up to a power of two, which for a pool of tens of GiB wastes up to half of it.
"""
from __future__ import annotations

import math
import mmap
import weakref

import torch

from moe_offload.host_register import host_register, host_unregister, mapped_device_bytes
from worker.kv import page_copy
from worker.kv.gpu_pool import KVPool, PagedPool


class HostKVPool(PagedPool):
    def __init__(self, num_layers: int, num_pages: int, page_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device):
        if num_pages < 1:
            raise ValueError(f"host KV pool needs at least 1 page, got {num_pages}")
        shape = (2, num_layers, num_pages, page_size, num_kv_heads, head_dim)
        nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        # whole OS pages of its own: CUDA refuses to register a page twice, and small pools share pages
        span = -(-nbytes // mmap.PAGESIZE) * mmap.PAGESIZE
        raw = torch.empty(span + mmap.PAGESIZE, dtype=torch.uint8)
        start = -raw.data_ptr() % mmap.PAGESIZE
        self._region = raw[start:start + span]
        self._buffer = self._region[:nbytes].view(dtype).view(shape)
        self.k, self.v = self._buffer[0], self._buffer[1]
        self.kernel_k, self.kernel_v = self.k, self.v
        if device.type == "cuda":
            self._map(device)
        self.page_size = page_size
        self.num_pages = num_pages
        self._free = list(range(num_pages - 1, -1, -1))  # allocate() hands out low pages first
        self._label = "host KV pool"

    @classmethod
    def like(cls, pool: KVPool, nbytes: int) -> HostKVPool | None:
        """A host pool of ``nbytes`` (rounded down to whole pages) beside ``pool``; None if that is no page."""
        num_pages = nbytes // pool.page_bytes
        if num_pages < 1:
            return None
        L, _, P, kvh, D = pool.k.shape
        return cls(L, num_pages, P, kvh, D, pool.k.dtype, pool.k.device)

    @property
    def capacity(self) -> int:
        return self.num_pages

    @property
    def page_bytes(self) -> int:
        return 2 * self.k[:, 0].numel() * self.k.element_size()

    # ==== page moves (on the caller's stream; ``method`` is one of page_copy.COPY_METHODS) ====

    def write_from(self, pool: KVPool, pages: list[int], host_pages: list[int], method: str = "kernel") -> None:
        """Copy GPU ``pages`` of ``pool`` into this pool's ``host_pages``."""
        if method == "memcpy":
            page_copy.copy_page_runs(pages, host_pages, pool.k, pool.v, self.k, self.v)
            return
        for src, dst in _batches(pages, host_pages):
            plan = page_copy.build_plan(src, dst, page_copy.PLAN_CAPACITY, pool.num_pages,
                                        self.num_pages, pool.k.device)
            page_copy.write_pages(plan, pool.k, pool.v, self.kernel_k, self.kernel_v)

    def load_into(self, pool: KVPool, host_pages: list[int], pages: list[int], method: str = "kernel") -> None:
        """Copy this pool's ``host_pages`` into GPU ``pages`` of ``pool``."""
        if method == "memcpy":
            page_copy.copy_page_runs(host_pages, pages, self.k, self.v, pool.k, pool.v)
            return
        for src, dst in _batches(host_pages, pages):
            plan = page_copy.build_plan(src, dst, page_copy.PLAN_CAPACITY, self.num_pages, pool.num_pages,
                                        pool.k.device)
            page_copy.load_pages(plan, self.kernel_k, self.kernel_v, pool.k, pool.v)

    def _map(self, device: torch.device) -> None:
        ptr, span = self._region.data_ptr(), self._region.numel()
        device_ptr = host_register(ptr, span, device)
        # the finalizer holds the memory, so it outlives its registration
        finalizer = weakref.finalize(self, _unregister, ptr, self._region)
        finalizer.atexit = False  # at exit the CUDA context is torn down anyway
        raw = mapped_device_bytes(device_ptr, span, device, owner=self)
        nbytes = self._buffer.numel() * self._buffer.element_size()
        mapped = raw[:nbytes].view(self._buffer.dtype).view(self._buffer.shape)
        self.kernel_k, self.kernel_v = mapped[0], mapped[1]


def _batches(src: list[int], dst: list[int]) -> list[tuple[list[int], list[int]]]:
    """Pairs in plans of ``PLAN_CAPACITY``: every launch of a move has the same shape."""
    cap = page_copy.PLAN_CAPACITY
    return [(src[i:i + cap], dst[i:i + cap]) for i in range(0, len(src), cap)]


def _unregister(ptr: int, _buffer: torch.Tensor) -> None:
    host_unregister(ptr)

