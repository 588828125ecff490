"""KV page ownership: the free list, the radix prefix cache and the requests that hold pages.

Every page of the pool (but the scratch page) is at any time exactly one of: free, held by the
radix cache (possibly shared by requests that locked it), or owned by one live request.
"""
from __future__ import annotations

from worker.kv_pool import KVPool

from scheduler.radix_cache import RadixCache
from scheduler.request import Request


class PageManager:
    def __init__(self, pool: KVPool, prefix_cache: bool = True):
        self.pool = pool
        self.page_size = pool.page_size
        self.radix = RadixCache(pool.page_size) if prefix_cache else None

    @property
    def available_pages(self) -> int:
        return self.pool.num_free + (self.radix.num_evictable_pages if self.radix else 0)

    def pages_needed(self, req: Request) -> int:
        # the last sampled token is never fed back, so its KV is never written
        return self.pool.pages_for(len(req.prompt) + req.max_tokens - 1)

    def admit(self, req: Request) -> bool:
        """Give ``req`` its page table: the cached prefix (locked) plus fresh pages for the rest.
        False, with nothing held, when the pool cannot fit it now."""
        if self.radix:
            # at least one prompt token must be computed to get logits
            match = self.radix.match(req.prompt[:-1])
            self.radix.lock(match.node)
        else:
            match = None
        num_cached = match.num_pages if match else 0
        fresh = self.pages_needed(req) - num_cached
        if not self._make_room(fresh):
            if match:
                self.radix.unlock(match.node)
            return False
        req.prefix = match
        req.pages = (match.pages if match else []) + self.pool.allocate(fresh)
        req.cached_tokens = req.prefilled = num_cached * self.page_size
        return True

    def release(self, req: Request, kv_tokens: list[int]) -> None:
        """Give back ``req``'s pages; the full pages of ``kv_tokens`` (tokens whose KV is written)
        go to the prefix cache, the rest to the free list."""
        own = req.own_pages
        if self.radix is None:
            self.pool.free(own)
            return
        num_full = min(len(kv_tokens) // self.page_size, len(req.pages))
        already = self.radix.insert(kv_tokens, req.pages[:num_full])
        first_own = req.prefix.num_pages
        duplicates = req.pages[first_own:max(first_own, already)]
        self.pool.free(duplicates + req.pages[max(num_full, first_own):])
        self.radix.unlock(req.prefix.node)
        req.pages, req.prefix = [], None

    def check(self, live: list[Request]) -> None:
        """Self-check: every page is free, cached or owned by one live request, exactly once."""
        owners: list[int] = list(self.pool.free_pages())
        cached = self.radix.all_pages() if self.radix else []
        owners += cached
        for req in live:
            owners += req.own_pages
        expected = set(range(1, self.pool.num_pages))
        if len(owners) != len(set(owners)) or set(owners) != expected:
            dup = len(owners) - len(set(owners))
            lost = sorted(expected - set(owners))[:8]
            raise AssertionError(f"KV page accounting broken: {dup} pages held twice, lost pages {lost}")
        if self.radix and self.radix.num_locked_pages < 0:
            raise AssertionError("radix cache lock count negative")

    def _make_room(self, n: int) -> bool:
        if n > self.available_pages:
            return False
        if n > self.pool.num_free:
            self.pool.free(self.radix.evict(n - self.pool.num_free))
        return True
