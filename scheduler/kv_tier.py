"""The host KV tier's policy and streams: which radix-cache pages move between the GPU pool and the
host pool, when, and on which stream; the pools move them (``HostKVPool.write_from`` /
``load_into``, over ``worker/kv/page_copy.py``'s kernels).

    write-back   a GPU node evicted without a host copy is written to the host then (once)
    write-through  a node is mirrored to the host when it enters the cache; eviction writes nothing

On CUDA every move runs on one copy stream, overlapped with the steps on the compute stream:

- a copy waits for the compute stream only when it touches a GPU page released since the last
  launch (``in_flight``: the step still running may read or write it); other pages are idle;
- the compute stream never waits for copies. ``pending`` gives the event of the copies still
  running; the page manager hands it to every request admitted meanwhile (its pages may be restored
  ones, or ones a write-back still reads). While other requests run, the engine launches such a
  request only once ``query`` says the event completed, so they keep decoding while a long prefix
  comes in; when nothing else runs, its chunk goes behind ``event.wait()`` on the compute stream.

The host never waits. On the CPU the copies are plain and immediate.
"""
from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch

from scheduler.config import KV_TIER_COPIES, KV_TIER_MODES
from scheduler.radix_cache import RadixCache
from worker.kv.host_pool import HostKVPool
from worker.kv.gpu_pool import KVPool

if TYPE_CHECKING:
    from scheduler.radix_cache import _Node


class KVTier:
    def __init__(self, pool: KVPool, host: HostKVPool, radix: RadixCache, mode: str, method: str,
                 in_flight: set[int]):
        if mode not in KV_TIER_MODES or method not in KV_TIER_COPIES:
            raise ValueError(f"KV tier mode {mode!r} / copy method {method!r}: use one of {KV_TIER_MODES} / "
                             f"{KV_TIER_COPIES}")
        self.pool, self.host, self.radix, self.mode, self.method = pool, host, radix, mode, method
        self.device = pool.k.device
        self.stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self.in_flight = in_flight  # GPU pages the running step may touch (the page manager's set)
        self._writes: tuple[list[int], list[int]] = ([], [])  # (GPU, host) pages queued for the host
        self._last: torch.cuda.Event | None = None  # recorded on the copy stream after the latest copy
        self._timings: list[tuple[str, torch.cuda.Event, torch.cuda.Event, int]] = []
        self.counters = dict(kv_host_pages_written=0, kv_host_pages_restored=0)
        self._seconds = dict(written=0.0, restored=0.0)
        self._timed_bytes = dict(written=0, restored=0)

    # ==== called by the page manager ====

    def save(self, node: _Node) -> list[int] | None:
        """Radix eviction callback: host pages holding ``node``'s KV, queued for writing unless a
        copy is there already; None when the host pool cannot hold it."""
        if node.host_pages is not None:
            return node.host_pages
        host = self._allocate(len(node.pages))
        if host is not None:
            self._writes[0].extend(node.pages)
            self._writes[1].extend(host)
        return host

    def mirror(self, node: _Node) -> None:
        """Write-through: copy a node that just entered the cache to the host now."""
        host = self._allocate(len(node.pages))
        if host is None:
            return
        self._writes[0].extend(node.pages)
        self._writes[1].extend(host)
        self.radix.set_host_pages(node, host)
        self._flush()

    def restore(self, host_pages: list[int], pages: list[int]) -> None:
        """Copy ``host_pages`` into GPU ``pages`` (queued writes go first: they may read those pages)."""
        self._flush()
        self._copy("restored", host_pages, pages)
        self.counters["kv_host_pages_restored"] += len(pages)

    def flush(self) -> torch.cuda.Event | None:
        """Issue queued write-backs; the event of their copy (None: none queued, or on the CPU)."""
        if not self._writes[0]:
            return None
        self._flush()
        return self._last

    def pending(self) -> torch.cuda.Event | None:
        """Issue queued writes; the event of the copies not yet finished, None when all are done
        (``query`` never waits)."""
        self._flush()
        if self._last is not None and self._last.query():
            self._last = None
        return self._last

    def stats(self) -> dict[str, int | float]:
        self._collect_timings()
        page_bytes = self.pool.page_bytes
        return {
            **self.counters,
            "kv_host_bytes_written": self.counters["kv_host_pages_written"] * page_bytes,
            "kv_host_bytes_restored": self.counters["kv_host_pages_restored"] * page_bytes,
            "kv_host_write_gb_per_s": self._bandwidth("written"),
            "kv_host_restore_gb_per_s": self._bandwidth("restored"),
            "kv_host_pages_total": self.host.capacity,
            "kv_host_pages_used": self.host.capacity - self.host.num_free,
            "kv_host_bytes_total": self.host.capacity * self.host.page_bytes,
            "kv_host_usage": 1 - self.host.num_free / self.host.capacity,
        }

    # ==== internals ====

    def _allocate(self, n: int) -> list[int] | None:
        if n > self.host.capacity:
            return None
        if n > self.host.num_free:
            self._flush()  # queued writes target host pages that eviction may hand out again
            self.host.free(self.radix.evict_host(n - self.host.num_free))
        return self.host.allocate(n) if n <= self.host.num_free else None

    def _flush(self) -> None:
        pages, host = self._writes
        if pages:
            self._copy("written", pages, host)
            self.counters["kv_host_pages_written"] += len(pages)
            self._writes = ([], [])

    def _copy(self, kind: str, src: list[int], dst: list[int]) -> None:
        if self.stream is None:
            start = time.perf_counter()
            self._launch(kind, src, dst)
            self._seconds[kind] += time.perf_counter() - start
            self._timed_bytes[kind] += len(src) * self.pool.page_bytes
            return
        gpu_pages = src if kind == "written" else dst
        if not self.in_flight.isdisjoint(gpu_pages):
            self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            self._launch(kind, src, dst)
            end.record()
        self._last = end
        self._timings.append((kind, start, end, len(src) * self.pool.page_bytes))
        if len(self._timings) > 64:  # bounded even when nobody asks for stats
            self._collect_timings()

    def _launch(self, kind: str, src: list[int], dst: list[int]) -> None:
        if kind == "written":
            self.host.write_from(self.pool, src, dst, self.method)
        else:
            self.host.load_into(self.pool, src, dst, self.method)

    def _collect_timings(self) -> None:
        """Fold in the timings of copies that have finished (``query`` never waits)."""
        pending = []
        for kind, start, end, nbytes in self._timings:
            if end.query():
                self._seconds[kind] += start.elapsed_time(end) / 1e3
                self._timed_bytes[kind] += nbytes
            else:
                pending.append((kind, start, end, nbytes))
        self._timings = pending

    def _bandwidth(self, kind: str) -> float:
        seconds = self._seconds[kind]
        return self._timed_bytes[kind] / seconds / 1e9 if seconds > 0 else 0.0
