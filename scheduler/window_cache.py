"""gpt-oss's sliding layers' pages: each running request's table into the window pool, whose pages
wholly before its window go back to the pool, and the windows the prefix cache keeps at node ends
(where a request's KV ends, and where its prompt does).

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
                 the request's KV enters the tree; at most one a node, two a request
 prompt end      the window at the prompt's last page boundary, held (``pending``) from the step that
                 writes it until the request's KV enters the tree, then its node's window
```

Why the prompt's end: a chat client's next turn re-renders the reply (harmony drops its analysis),
so its prompt parts from the cached tokens right after the previous prompt; the radix cache matches
whole pages, so that follow-up's match ends at the prompt's last page boundary, and its sliding
layers resume there as the full layers do. By the time the request ends, its ring has given those
pages back: they are held from the step that writes them.

A page is free or has holders (request tables, node windows, prompt-end windows), counted in
``refs``. A prefix match resumes from the deepest matched node that keeps a window (the tokens after
it are computed again, ``window_recomputed_tokens``): the sliding layers never read a freed page.
Windows are evicted least recently used when the pool runs short (then running requests' prompt-end
windows), apart from the nodes' KV pages; they stay on the GPU (a node whose full-layer pages went
to the host tier keeps its window, and a restore of those pages resumes from it; a node leaving the
tree drops its window).
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
    def __init__(self, pool: KVPool, window: int, prompt_ends: bool = True):
        self.pool, self.window, self.page_size = pool, window, pool.page_size
        self.prompt_ends = prompt_ends  # keep prompt-end windows (only a prefix cache uses them)
        self.refs: dict[int, int] = {}  # window-pool page -> its holders
        self.holders: dict[int, _Node] = {}  # id(node) -> a node keeping a window
        self.held: dict[int, int] = {}  # id(request) -> pages its table holds
        self.pending: dict[int, Window | None] = {}  # id(request) -> its prompt-end window (None: none to keep)
        self.counters = dict(window_pages_freed=0, window_snapshots_taken=0, window_prompt_snapshots=0,
                             window_snapshots_evicted=0, window_prefix_tokens=0, window_recomputed_tokens=0,
                             window_pages_peak=0)

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
        end = self.prompt_end(req)
        if self.prompt_ends and end and id(req) not in self.pending and len(table) * self.page_size >= end:
            self.pending[id(req)] = self._window_at(table, end)  # its pages are allocated, none freed yet
        return table

    def prompt_end(self, req: Request) -> int:
        """Where a follow-up that extends ``req``'s prompt, not its reply, resumes: the radix cache
        matches whole pages, so at the prompt's last page boundary."""
        return len(req.prompt) // self.page_size * self.page_size

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
        pending = self.pending.pop(id(req), None)
        self._unref([p for p in req.window_pages if p] + (pending.pages if pending else []))
        req.window_pages = []
        self.held.pop(id(req), None)

    # ==== node windows ====

    def take(self, node: _Node | None, req: Request, end: int) -> None:
        """Keep ``req``'s pages of [end - W, end) as ``node``'s window (``node`` ends at ``end``)."""
        if node is not None and node.window is None:
            self._hang(node, self._window_at(req.window_pages, end))

    def take_prompt_end(self, node: _Node | None, req: Request) -> None:
        """Give ``req``'s prompt-end window to ``node`` (ending at ``prompt_end(req)``), unless it
        has one; what is not given is dropped with the request (``release``)."""
        win = self.pending.get(id(req))
        if node is not None and node.window is None and win is not None:
            del self.pending[id(req)]
            self._hang(node, win)
            self.counters["window_prompt_snapshots"] += 1

    def dropped(self, node: _Node) -> None:
        """The radix tree removed ``node``: its window goes with it."""
        win, node.window = node.window, None
        if win is not None:
            del self.holders[id(node)]
            self._unref(win.pages)

    # ==== accounting ====

    def stats(self) -> dict[str, int]:
        running = sum(self.held.values())
        pending = sum(len(w.pages) for w in self.pending.values() if w)
        return {**self.counters, "window_pages_total": self.pool.capacity, "window_pages_free": self.pool.num_free,
                "window_pages_running": running, "window_pages_pending": pending, "window_snapshots": len(self.holders),
                "window_ring_pages": -(-self.window // self.page_size) + 2}

    def check(self, live: list[Request], nodes) -> None:
        """Every window page is free or held, and ``refs`` counts its holders exactly."""
        held: dict[int, int] = {}
        windows = [n.window.pages for n in nodes if n.window is not None]
        pending = [w.pages for w in self.pending.values() if w]
        for pages in [r.window_pages for r in live] + windows + pending:
            for p in pages:
                if p:
                    held[p] = held.get(p, 0) + 1
        free = self.pool.free_pages()
        if any(self.held.get(id(r), 0) != sum(1 for p in r.window_pages if p) for r in live):
            raise AssertionError("a request's count of window pages disagrees with its table")
        if not set(self.pending) <= {id(r) for r in live}:
            raise AssertionError("a prompt-end window outlived its request")
        if held != self.refs or free & set(held) or free | set(held) != set(range(1, self.pool.num_pages)):
            raise AssertionError(f"window page accounting broken: {len(held)} held, {len(self.refs)} counted, "
                                 f"{len(free)} free of {self.pool.capacity}")
        if len(windows) != len(self.holders):
            raise AssertionError("radix nodes' windows and the window cache disagree")

    # ==== internals ====

    def _allocate(self, n: int) -> list[int]:
        """``n`` pages, evicting node windows LRU first, then running requests' prompt-end windows
        (the plan's share for cached windows holds them: a ring's worth per running request)."""
        while n > self.pool.num_free and (self.holders or any(self.pending.values())):
            if self.holders:
                self.dropped(min(self.holders.values(), key=lambda x: x.window.last_use))
            else:
                rid = next(r for r, w in self.pending.items() if w)
                self._unref(self.pending[rid].pages)
                self.pending[rid] = None
            self.counters["window_snapshots_evicted"] += 1
        return self.pool.allocate(n)

    def _window_at(self, table: list[int], end: int) -> Window | None:
        """A reference to ``table``'s pages of [end - W, end); None where some went back to the pool."""
        first = max(end - self.window, 0) // self.page_size
        pages = table[first:end // self.page_size]
        if len(pages) != end // self.page_size - first or not all(pages):
            return None
        self._ref(pages)
        return Window(first, list(pages))

    def _hang(self, node: _Node, win: Window | None) -> None:
        if win is not None:
            win.last_use = next(_clock)
            node.window = win
            self.holders[id(node)] = node
            self.counters["window_snapshots_taken"] += 1

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
