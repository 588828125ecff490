"""gpt-oss's sliding layers' pages: each running request's table into the window pool, whose pages
wholly before its window go back to the pool, and the windows the prefix cache keeps at node ends.

A sliding layer's query at position p reads keys (p - W, p] only. Its pages live in a pool of their
own (``worker.kv.gpu_pool.KVPool`` over the sliding layers, sized by the memory plan), addressed by
a table of its own that maps positions to pages as the full layers' table does, so the kernels
index both alike:

```
 request table   logical page i -> window-pool page; 0 (the scratch page) once the page lies wholly
                 before what the request may still read or leave to the prefix cache
                 (``keep_from``): at most ceil(W / page) + 2 pages between steps, plus a prefill chunk's
 node window     a radix node's last W keys, [e - W, e) for its end e: the pages of the request
                 that wrote them, shared (positions before e are never written again), taken when
                 the request's KV enters the tree
```

A page is free or has holders (request tables and node windows), counted in ``refs``. A prefix
match resumes from the deepest matched node that keeps a window (the tokens after it are computed
again, ``window_recomputed_tokens``): the sliding layers never read a freed page. Windows are
evicted least recently used when the pool runs short, apart from the nodes' KV pages; they stay on
the GPU (a node whose full-layer pages went to the host tier keeps its window, and a restore of
those pages resumes from it; a node leaving the tree drops its window).
"""
from __future__ import annotations

import itertools
from typing import TYPE_CHECKING

from worker.kv.gpu_pool import KVPool

if TYPE_CHECKING:
    from scheduler.radix_cache import _Node
    from scheduler.request import Request

_clock = itertools.count()


class Window:
    __slots__ = ("first", "pages", "last_use")

    def __init__(self, first: int, pages: list[int]):
        self.first, self.pages, self.last_use = first, pages, next(_clock)  # first: pages[0]'s logical page


class WindowCache:
    def __init__(self, pool: KVPool, window: int):
        self.pool, self.window, self.page_size = pool, window, pool.page_size
        self.refs: dict[int, int] = {}  # window-pool page -> its holders
        self.holders: dict[int, _Node] = {}  # id(node) -> a node keeping a window
        self.held: dict[int, int] = {}  # id(request) -> pages its table holds
        self.counters = dict(window_pages_freed=0, window_snapshots_taken=0, window_snapshots_evicted=0,
                             window_prefix_tokens=0, window_recomputed_tokens=0, window_pages_peak=0)

    def keep_from(self, pos: int) -> int:
        """The first logical page a request whose next token is at ``pos`` keeps: its last W keys
        before the page boundary at or below ``pos`` (a node window may end there), and a page more
        (the token the host has not read yet)."""
        P = self.page_size
        return max(pos // P * P - self.window - P, 0) // P

    # ==== a running request's table ====

    def table(self, req: Request, start: int, end: int) -> list[int]:
        """``req``'s table for a step writing positions [start, end): pages wholly before
        ``keep_from(start)`` go back to the pool, new ones cover ``end``. The freed entries are a
        prefix of the table, so the walk back from ``keep_from`` stops at the first one."""
        table, held = req.window_pages, self.held.get(id(req), 0)
        i = min(self.keep_from(start), len(table)) - 1
        while i >= 0 and table[i]:
            self._unref([table[i]])
            table[i], i, held = 0, i - 1, held - 1
            self.counters["window_pages_freed"] += 1
        need = -(-end // self.page_size) - len(table)
        if need > 0:
            new = self._allocate(need)
            self._ref(new)
            table += new
            held += need
        self.held[id(req)] = held
        self.counters["window_pages_peak"] = max(self.counters["window_pages_peak"], held)
        return table

    def resume(self, req: Request, node: _Node | None, prefilled: int) -> None:
        """Start ``req``'s table from ``node``'s window (its prefix of ``prefilled`` tokens ends there)."""
        if node is None or not prefilled:
            return
        win = node.window
        if win is None or (win.first + len(win.pages)) * self.page_size != prefilled:
            raise AssertionError("an admitted prefix of a windowed model lost the window it resumes from")
        win.last_use = next(_clock)
        req.window_pages = [0] * win.first + list(win.pages)
        self._ref(win.pages)
        self.held[id(req)] = len(win.pages)
        self.counters["window_prefix_tokens"] += prefilled

    def release(self, req: Request) -> None:
        self._unref([p for p in req.window_pages if p])
        req.window_pages = []
        self.held.pop(id(req), None)

    # ==== node windows ====

    def take(self, node: _Node | None, req: Request, end: int) -> None:
        """Keep ``req``'s pages of [end - W, end) as ``node``'s window (``node`` ends at ``end``)."""
        if node is None or node.window is not None:
            return
        first = max(end - self.window, 0) // self.page_size
        pages = req.window_pages[first:end // self.page_size]
        if len(pages) != end // self.page_size - first or not all(pages):
            return
        node.window = Window(first, list(pages))
        self._ref(pages)
        self.holders[id(node)] = node
        self.counters["window_snapshots_taken"] += 1

    def dropped(self, node: _Node) -> None:
        """The radix tree removed ``node``: its window goes with it."""
        win, node.window = node.window, None
        if win is not None:
            del self.holders[id(node)]
            self._unref(win.pages)

    # ==== accounting ====

    def stats(self) -> dict[str, int]:
        running = sum(self.held.values())
        return {**self.counters, "window_pages_total": self.pool.capacity, "window_pages_free": self.pool.num_free,
                "window_pages_running": running, "window_snapshots": len(self.holders),
                "window_ring_pages": -(-self.window // self.page_size) + 2}

    def check(self, live: list[Request], nodes) -> None:
        """Every window page is free or held, and ``refs`` counts its holders exactly."""
        held: dict[int, int] = {}
        windows = [n.window.pages for n in nodes if n.window is not None]
        for pages in [r.window_pages for r in live] + windows:
            for p in pages:
                if p:
                    held[p] = held.get(p, 0) + 1
        free = self.pool.free_pages()
        if any(self.held.get(id(r), 0) != sum(1 for p in r.window_pages if p) for r in live):
            raise AssertionError("a request's count of window pages disagrees with its table")
        if held != self.refs or free & set(held) or free | set(held) != set(range(1, self.pool.num_pages)):
            raise AssertionError(f"window page accounting broken: {len(held)} held, {len(self.refs)} counted, "
                                 f"{len(free)} free of {self.pool.capacity}")
        if len(windows) != len(self.holders):
            raise AssertionError("radix nodes' windows and the window cache disagree")

    # ==== internals ====

    def _allocate(self, n: int) -> list[int]:
        while n > self.pool.num_free and self.holders:
            node = min(self.holders.values(), key=lambda x: x.window.last_use)
            self.dropped(node)
            self.counters["window_snapshots_evicted"] += 1
        return self.pool.allocate(n)

    def _ref(self, pages: list[int]) -> None:
        for p in pages:
            self.refs[p] = self.refs.get(p, 0) + 1

    def _unref(self, pages: list[int]) -> None:
        freed = []
        for p in pages:
            self.refs[p] -= 1
            if not self.refs[p]:
                del self.refs[p]
                freed.append(p)
        self.pool.free(freed)
