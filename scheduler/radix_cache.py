"""Radix prefix cache over KV pages, in two tiers: page-aligned token prefixes -> the GPU pages
and/or host pages holding their KV.

Every edge holds a whole number of pages. A node's pages are on the GPU, on the host, or both:

    root ── A (gpu) ── B (gpu+host) ── C (host)       GPU nodes form a subtree at the root, so a
                   └── D (gpu)                        match is GPU pages, then host pages to restore

A request locks the GPU path it uses (reference counts up to the root), so locked pages are never
evicted. GPU eviction takes unlocked nodes without GPU children, least recently used first, and asks
a ``save`` callback for host pages holding a copy; without one the node and its (host-only) subtree
are dropped. Host eviction drops redundant host copies first, then host-only leaves, LRU.
"""
from __future__ import annotations

import heapq
import itertools
from typing import Callable, NamedTuple

_clock = itertools.count()


class _Node:
    __slots__ = ("key", "pages", "host_pages", "children", "parent", "lock_ref", "last_use", "snapshot",
                 "window")

    def __init__(self, key: tuple[int, ...], pages: list[int] | None, parent: _Node | None,
                 host_pages: list[int] | None = None):
        self.key, self.pages, self.host_pages, self.parent = key, pages, host_pages, parent
        self.children: dict[tuple[int, ...], _Node] = {}
        self.lock_ref = 0
        self.last_use = next(_clock)
        self.snapshot = None  # hybrid models: the recurrent state at the node's end (scheduler.state_cache)
        self.window = None  # gpt-oss: the sliding layers' last window at the node's end (scheduler.window_cache)

    @property
    def num_pages(self) -> int:
        return len(self.pages if self.pages is not None else self.host_pages)


class PrefixMatch(NamedTuple):
    pages: list[int]  # GPU pages of the matched prefix, in order
    node: _Node  # the deepest matched node on the GPU; lock it while the pages are in use
    host_nodes: tuple[_Node, ...] = ()  # the match continued on the host, in order

    @property
    def num_pages(self) -> int:
        return len(self.pages)

    @property
    def num_host_pages(self) -> int:
        return sum(len(n.host_pages) for n in self.host_nodes)


class InsertResult(NamedTuple):
    adopted: set[int]  # the caller's pages the tree now holds; the caller frees the rest of its own
    new_node: _Node | None  # the node created for the uncached tail, if any


SaveFn = Callable[[_Node], "list[int] | None"]


class RadixCache:
    def __init__(self, page_size: int):
        self.page_size = page_size
        self.root = _Node((), [], None)
        self.root.lock_ref = 1  # the root is never evicted
        self.num_pages = 0  # GPU pages held
        self.num_host_pages = 0
        self.num_locked_pages = 0
        self.on_remove: Callable[[_Node], None] | None = None  # told of every node leaving the tree
        self.protected: _Node | None = None  # kept from host eviction (a snapshot an admission resumes from)

    @property
    def num_evictable_pages(self) -> int:
        return self.num_pages - self.num_locked_pages

    def match(self, tokens: list[int]) -> PrefixMatch:
        """The longest cached page-aligned prefix of ``tokens``: GPU part, then host part (the walk
        goes on below the last GPU node through host-only nodes, however many turns they hold)."""
        node, gpu_node, pages, host_nodes, pos = self.root, self.root, [], [], 0
        while True:
            child = node.children.get(self._page_key(tokens, pos))
            if child is None:
                break
            n = self._common_pages(child.key, tokens, pos)
            if n < child.num_pages:
                child = self._split(child, n)
            child.last_use = next(_clock)
            if child.pages is not None:
                pages += child.pages
                gpu_node = child
            else:
                host_nodes.append(child)
            node, pos = child, pos + len(child.key)
        return PrefixMatch(pages, gpu_node, tuple(host_nodes))

    def node_ending_at(self, tokens: list[int], pos: int) -> _Node | None:
        """The node whose key ends exactly ``pos`` tokens into ``tokens`` (a page boundary), split
        off where a longer node covers it; None when the cached path stops short of ``pos``."""
        return self.nodes_ending_at(tokens, [pos])[0]

    def nodes_ending_at(self, tokens: list[int], positions: list[int]) -> list[_Node | None]:
        """``node_ending_at`` for each of ``positions`` (ascending page boundaries) in one walk down
        ``tokens``' path: a request's snapshots, placed at its end, cost the path once."""
        node, at, found = self.root, 0, []
        for pos in positions:
            while node is not None and at < pos:
                child = node.children.get(self._page_key(tokens, at))
                n = self._common_pages(child.key, tokens, at, pos) if child is not None else 0
                if n == 0:
                    node = None
                    break
                if n < child.num_pages:
                    child = self._split(child, n)
                node, at = child, at + len(child.key)
            found.append(node if node is not None and at == pos and node is not self.root else None)
        return found

    @staticmethod
    def path(node: _Node) -> list[_Node]:
        """``node`` and its ancestors below the root, root side first."""
        out = []
        while node.parent is not None:
            out.append(node)
            node = node.parent
        return out[::-1]

    def attach(self, nodes: tuple[_Node, ...], pages: list[int]) -> None:
        """Give host-only ``nodes`` (a matched host continuation) GPU ``pages``, being restored."""
        for node in nodes:
            node.pages, pages = pages[:len(node.host_pages)], pages[len(node.host_pages):]
            self.num_pages += len(node.pages)

    def set_host_pages(self, node: _Node, host_pages: list[int]) -> None:
        """Record a host copy of GPU ``node`` (write-through)."""
        node.host_pages = host_pages
        self.num_host_pages += len(host_pages)

    def insert(self, tokens: list[int], pages: list[int]) -> InsertResult:
        """Cache ``pages`` as the KV of ``tokens`` (whole pages only). Host-only nodes on the way
        take the caller's pages as their GPU copy."""
        P = self.page_size
        num = min(len(tokens) // P, len(pages))
        node, pos, adopted = self.root, 0, set()
        while pos < num * P:
            key = self._page_key(tokens, pos)
            child = node.children.get(key)
            if child is None:
                new = _Node(tuple(tokens[pos:num * P]), pages[pos // P:num], node)
                node.children[key] = new
                self.num_pages += len(new.pages)
                return InsertResult(adopted | set(new.pages), new)
            n = self._common_pages(child.key, tokens, pos, num * P)
            if n < child.num_pages:
                child = self._split(child, n)
            if child.pages is None:
                child.pages = pages[pos // P:pos // P + child.num_pages]
                self.num_pages += len(child.pages)
                adopted.update(child.pages)
            child.last_use = next(_clock)
            node, pos = child, pos + len(child.key)
        return InsertResult(adopted, None)

    def lock(self, node: _Node) -> None:
        self._add_lock(node, +1)

    def unlock(self, node: _Node) -> None:
        self._add_lock(node, -1)

    def evict(self, num_pages: int, save: SaveFn) -> tuple[list[int], list[int]]:
        """Take GPU pages from unlocked nodes without GPU children, LRU first, until ``num_pages``
        are freed (or no more can be). ``save(node)`` returns host pages holding the node's KV (it
        may write them now), or None to drop the node. Returns (freed GPU pages, freed host pages)."""
        freed, host_freed = [], []
        heap = [(n.last_use, id(n), n) for n in self._nodes() if self._gpu_evictable(n)]
        heapq.heapify(heap)
        while len(freed) < num_pages and heap:
            node = heapq.heappop(heap)[2]
            if not self._gpu_evictable(node):
                continue
            kept = save(node)
            freed += node.pages
            self.num_pages -= len(node.pages)
            node.pages = None
            if kept is None:
                host_freed += self._remove_subtree(node)
            elif node.host_pages is None:
                node.host_pages = kept
                self.num_host_pages += len(kept)
            parent = node.parent
            if self._gpu_evictable(parent):
                heapq.heappush(heap, (parent.last_use, id(parent), parent))
        return freed, host_freed

    def evict_host(self, num_pages: int) -> list[int]:
        """Free host pages: redundant copies of GPU nodes first, then host-only leaves, LRU first."""
        freed: list[int] = []
        heap = [self._host_rank(n) for n in self._nodes() if self._host_evictable(n)]
        heapq.heapify(heap)
        while len(freed) < num_pages and heap:
            node = heapq.heappop(heap)[3]
            if not self._host_evictable(node):
                continue
            freed += node.host_pages
            self.num_host_pages -= len(node.host_pages)
            node.host_pages = None
            if node.pages is None:
                self._detach(node)
                if self.on_remove is not None:
                    self.on_remove(node)
                if self._host_evictable(node.parent):
                    heapq.heappush(heap, self._host_rank(node.parent))
        return freed

    def all_pages(self) -> list[int]:
        return [p for n in self._nodes() if n.pages is not None for p in n.pages]

    def all_host_pages(self) -> list[int]:
        return [p for n in self._nodes() if n.host_pages is not None for p in n.host_pages]

    def check(self) -> None:
        """Self-check of the tree's invariants (tiers, counts, locks); AssertionError if broken."""
        gpu = locked = host = 0
        for n in self._nodes():
            if n.pages is None and n.host_pages is None or len(n.key) != n.num_pages * self.page_size:
                raise AssertionError("radix node without pages, or key and pages disagree")
            if n.pages is not None and n.host_pages is not None and len(n.pages) != len(n.host_pages):
                raise AssertionError("radix node's GPU and host copies differ in length")
            if n.pages is not None and n.parent.pages is None:
                raise AssertionError("radix node on the GPU below a node that is not")
            if n.lock_ref < 0 or n.lock_ref and n.pages is None:
                raise AssertionError("radix node locked off the GPU, or lock count negative")
            gpu += len(n.pages or [])
            host += len(n.host_pages or [])
            locked += len(n.pages) if n.lock_ref else 0
        counted = (self.num_pages, self.num_host_pages, self.num_locked_pages)
        if (gpu, host, locked) != counted:
            raise AssertionError(f"radix counts (gpu, host, locked) {counted} != tree {(gpu, host, locked)}")

    # ==== internals ====

    def _page_key(self, tokens, pos: int) -> tuple[int, ...]:
        return tuple(tokens[pos:pos + self.page_size])

    def _common_pages(self, key: tuple[int, ...], tokens: list[int], pos: int, end: int | None = None) -> int:
        """Whole pages that ``key`` shares with ``tokens[pos:end]`` from their starts. One compare of
        the pages both have (no slice of ``tokens`` longer than ``key``: a walk down a 60-turn path
        costs the path's length once, not once per node), then page by page only where they differ."""
        P = self.page_size
        end = len(tokens) if end is None else min(end, len(tokens))
        full = min(len(key), end - pos) // P
        if full <= 0:
            return 0
        if key[:full * P] == tuple(tokens[pos:pos + full * P]):
            return full
        n = 0
        while key[n * P:(n + 1) * P] == tuple(tokens[pos + n * P:pos + (n + 1) * P]):
            n += 1
        return n

    def _split(self, node: _Node, num_pages: int) -> _Node:
        """Cut ``node`` after ``num_pages`` pages; returns the new upper part."""
        cut = num_pages * self.page_size
        upper = _Node(node.key[:cut], _head(node.pages, num_pages), node.parent, _head(node.host_pages, num_pages))
        upper.lock_ref, upper.last_use = node.lock_ref, node.last_use
        node.parent.children[self._page_key(node.key, 0)] = upper
        node.key, node.parent = node.key[cut:], upper
        node.pages, node.host_pages = _tail(node.pages, num_pages), _tail(node.host_pages, num_pages)
        upper.children[self._page_key(node.key, 0)] = node
        return upper

    def _add_lock(self, node: _Node, delta: int) -> None:
        while node is not self.root:
            if delta > 0 and node.lock_ref == 0:
                self.num_locked_pages += len(node.pages)
            node.lock_ref += delta
            if delta < 0 and node.lock_ref == 0:
                self.num_locked_pages -= len(node.pages)
            node = node.parent

    def _gpu_evictable(self, node: _Node) -> bool:
        return node is not self.root and node.pages is not None and node.lock_ref == 0 and \
            all(c.pages is None for c in node.children.values())

    def _host_evictable(self, node: _Node) -> bool:
        return node is not self.root and node.host_pages is not None and \
            (node.pages is not None or not node.children and node is not self.protected)

    @staticmethod
    def _host_rank(node: _Node) -> tuple[int, int, int, _Node]:
        return (node.pages is None, node.last_use, id(node), node)

    def _remove_subtree(self, node: _Node) -> list[int]:
        """Detach ``node`` (already off the GPU) with everything below it; returns their host pages."""
        self._detach(node)
        host = []
        for n in [node, *self._nodes(node)]:
            host += n.host_pages or []
            if self.on_remove is not None:
                self.on_remove(n)
        self.num_host_pages -= len(host)
        return host

    def _detach(self, node: _Node) -> None:
        del node.parent.children[self._page_key(node.key, 0)]

    def _nodes(self, top: _Node | None = None):
        stack = list((top or self.root).children.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())


def _head(pages: list[int] | None, n: int) -> list[int] | None:
    return None if pages is None else pages[:n]


def _tail(pages: list[int] | None, n: int) -> list[int] | None:
    return None if pages is None else pages[n:]
