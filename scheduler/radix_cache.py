"""Radix prefix cache over KV pages: page-aligned token prefixes -> the pages holding their KV.

Every edge holds a whole number of pages. A request locks the path it matched (reference counts
up to the root), so locked pages are never evicted; unlocked leaves are evicted least recently
used first.
"""
from __future__ import annotations

import itertools
from typing import NamedTuple

_clock = itertools.count()


class _Node:
    __slots__ = ("key", "pages", "children", "parent", "lock_ref", "last_use")

    def __init__(self, key: tuple[int, ...], pages: list[int], parent: _Node | None):
        self.key, self.pages, self.parent = key, pages, parent
        self.children: dict[tuple[int, ...], _Node] = {}
        self.lock_ref = 0
        self.last_use = next(_clock)


class PrefixMatch(NamedTuple):
    pages: list[int]  # KV pages of the matched prefix, in order
    node: _Node  # the deepest matched node; lock it while the pages are in use

    @property
    def num_pages(self) -> int:
        return len(self.pages)


class RadixCache:
    def __init__(self, page_size: int):
        self.page_size = page_size
        self.root = _Node((), [], None)
        self.root.lock_ref = 1  # the root is never evicted
        self.num_pages = 0
        self.num_locked_pages = 0

    @property
    def num_evictable_pages(self) -> int:
        return self.num_pages - self.num_locked_pages

    def match(self, tokens: list[int]) -> PrefixMatch:
        """The longest cached page-aligned prefix of ``tokens``."""
        node, pages, pos = self.root, [], 0
        while True:
            child = node.children.get(self._page_key(tokens, pos))
            if child is None:
                break
            n = self._common_pages(child.key, tokens, pos)
            if n < len(child.pages):
                child = self._split(child, n)
            pages += child.pages
            pos += len(child.key)
            node = child
            node.last_use = next(_clock)
        return PrefixMatch(pages, node)

    def insert(self, tokens: list[int], pages: list[int]) -> int:
        """Cache ``pages`` as the KV of ``tokens`` (whole pages only). Returns how many leading
        pages were already cached: the caller's copies of those are duplicates unless they are the
        very pages the tree holds."""
        P = self.page_size
        num = min(len(tokens) // P, len(pages))
        node, pos = self.root, 0
        while pos < num * P:
            key = self._page_key(tokens, pos)
            child = node.children.get(key)
            if child is None:
                new = _Node(tuple(tokens[pos:num * P]), pages[pos // P:num], node)
                node.children[key] = new
                self.num_pages += len(new.pages)
                return pos // P
            n = self._common_pages(child.key, tokens[:num * P], pos)
            if n < len(child.pages):
                child = self._split(child, n)
            child.last_use = next(_clock)
            node, pos = child, pos + len(child.key)
        return num

    def lock(self, node: _Node) -> None:
        self._add_lock(node, +1)

    def unlock(self, node: _Node) -> None:
        self._add_lock(node, -1)

    def evict(self, num_pages: int) -> list[int]:
        """Remove unlocked leaves, least recently used first, until ``num_pages`` are freed (or no
        more can be); returns the freed pages."""
        freed: list[int] = []
        while len(freed) < num_pages:
            leaves = [n for n in self._nodes() if not n.children and n.lock_ref == 0]
            if not leaves:
                break
            leaf = min(leaves, key=lambda n: n.last_use)
            del leaf.parent.children[self._page_key(leaf.key, 0)]
            self.num_pages -= len(leaf.pages)
            freed += leaf.pages
        return freed

    def all_pages(self) -> list[int]:
        return [p for n in self._nodes() for p in n.pages]

    # ==== internals ====

    def _page_key(self, tokens, pos: int) -> tuple[int, ...]:
        return tuple(tokens[pos:pos + self.page_size])

    def _common_pages(self, key: tuple[int, ...], tokens: list[int], pos: int) -> int:
        P, n = self.page_size, 0
        while (n + 1) * P <= len(key) and pos + (n + 1) * P <= len(tokens) and \
                key[n * P:(n + 1) * P] == tuple(tokens[pos + n * P:pos + (n + 1) * P]):
            n += 1
        return n

    def _split(self, node: _Node, num_pages: int) -> _Node:
        """Cut ``node`` after ``num_pages`` pages; returns the new upper part."""
        cut = num_pages * self.page_size
        upper = _Node(node.key[:cut], node.pages[:num_pages], node.parent)
        upper.lock_ref, upper.last_use = node.lock_ref, node.last_use
        node.parent.children[self._page_key(node.key, 0)] = upper
        node.key, node.pages, node.parent = node.key[cut:], node.pages[num_pages:], upper
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

    def _nodes(self):
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())
