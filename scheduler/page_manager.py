"""KV page ownership in two tiers: the GPU pool's free list, the host pool's free list, the radix
prefix cache and the requests that hold pages; gpt-oss's sliding layers' window pages apart
(``scheduler.window_cache``).

Every GPU page (but the scratch page) is at any time exactly one of: free, held by the radix cache
(possibly shared by requests that locked it), or owned by one live request. Every host page is free
or held by exactly one radix node.
"""
from __future__ import annotations

from itertools import zip_longest

from worker.kv.host_pool import HostKVPool
from worker.kv.gpu_pool import KVPool
from worker.kv.state_pool import HostStatePool, StatePool

from scheduler.kv_tier import KVTier
from scheduler.radix_cache import PrefixMatch, RadixCache
from scheduler.request import Request
from scheduler.state_cache import StateCache
from scheduler.window_cache import WindowCache

HOST_SNAPSHOT_SHARE = 0.25  # of the host KV tier's bytes, for a hybrid model's state snapshots


class PageManager:
    def __init__(self, pool: KVPool, prefix_cache: bool = True, host_bytes: int = 0,
                 tier_mode: str = "writethrough", copy_method: str = "kernel", state_pool: StatePool | None = None,
                 window_pool: KVPool | None = None, window: int = 0):
        self.pool = pool
        self.page_size = pool.page_size
        self.radix = RadixCache(pool.page_size) if prefix_cache else None
        self.states = self._state_cache(state_pool, host_bytes) if prefix_cache and state_pool else None
        if self.states is not None and self.states.host is not None:
            host_bytes -= self.states.host.num_slots * state_pool.slot_bytes
        host = HostKVPool.like(pool, host_bytes) if prefix_cache and host_bytes > 0 else None
        self.in_flight: set[int] = set()  # GPU pages released since the last launch: the running step may use them
        self.tier = KVTier(pool, host, self.radix, tier_mode, copy_method, self.in_flight) if host else None
        self.counters = dict(kv_prefix_tokens_gpu=0, kv_prefix_tokens_host=0)
        self.windows = WindowCache(window_pool, window, prefix_cache) if window_pool is not None else None
        if self.windows is not None and self.radix is not None:
            self.radix.on_remove = self.windows.dropped

    @property
    def available_pages(self) -> int:
        return self.pool.num_free + (self.radix.num_evictable_pages if self.radix else 0)

    def pages_needed(self, req: Request) -> int:
        """Pages ``req`` holds at its longest (the last sampled token is never fed back, so its KV
        is never written)."""
        return self.pool.pages_for(len(req.prompt) + req.max_tokens - 1)

    def admit(self, req: Request, reserve: int = 0) -> bool:
        """Give ``req`` its page table for the tokens it prefills: the cached prefix (locked;
        restored to the GPU from the host where only the host holds it) plus fresh pages for the
        rest; decoding takes more with ``grow``. False, with nothing held, unless ``reserve`` pages
        (the running requests' next growth) stay available beside it."""
        prefill_pages = self.pool.pages_for(req.prefill_len)
        if self.radix is None:
            if not self._make_room(prefill_pages, reserve):
                return False
            req.pages = self.pool.allocate(prefill_pages)
            return True
        tokens = req.prefill_tokens[:-1]  # at least one token must be computed to get logits
        cached = len(tokens)
        if self.states is not None or self.windows is not None:  # resume only where a snapshot or window was kept
            usable, cached = self._resumable(tokens, "snapshot" if self.states is not None else "window")
            tokens = tokens[:usable]
        match = self.radix.match(tokens)
        self.radix.lock(match.node)
        fresh = prefill_pages - match.num_pages
        if not self._make_room(fresh, reserve):
            self.radix.unlock(match.node)
            self.radix.protected = None
            return False
        pages = self.pool.allocate(fresh)
        prefix = self._restore(tokens, match, pages) if self.tier else match
        self.radix.lock(prefix.node)
        self.radix.unlock(match.node)
        req.prefix = prefix
        req.pages = prefix.pages + pages[prefix.num_pages - match.num_pages:]
        req.prefilled = prefix.num_pages * self.page_size
        if not req.preemptions:  # what a client is told: prompt tokens it did not pay for
            req.cached_tokens = req.prefilled
        req.kv_ready = self.tier.pending() if self.tier else None
        self._resume_from(req, prefix, cached)
        self.counters["kv_prefix_tokens_gpu"] += match.num_pages * self.page_size
        self.counters["kv_prefix_tokens_host"] += (prefix.num_pages - match.num_pages) * self.page_size
        return True

    def resume_state(self, req: Request, running_slot: int) -> None:
        """Fill an admitted request's state slot from the snapshot its prefix ends on."""
        node = req.resume_from
        if node is None:
            return
        if node.snapshot is None or sum(len(n.key) for n in self.radix.path(node)) != req.prefilled:
            raise AssertionError("an admitted prefix of a hybrid model lost the snapshot it resumes from")
        self.states.restore(node, running_slot)
        self.states.counters["state_prefix_tokens"] += req.prefilled
        req.resume_from = None

    def window_table(self, req: Request, start: int, end: int) -> list[int] | None:
        """gpt-oss: ``req``'s sliding layers' table for a step writing positions [start, end), pages
        before its window given back (None: no window pool)."""
        return None if self.windows is None else list(self.windows.table(req, start, end))

    def grow(self, req: Request, position: int) -> bool:
        """Make sure ``req``'s pages reach ``position`` (the KV slot its next decode writes),
        taking a free or evicted page; False when none can be had."""
        if position < len(req.pages) * self.page_size:
            return True
        if not self._make_room(1):
            return False
        req.pages.append(self.pool.allocate(1)[0])
        written = self.tier.flush() if self.tier else None
        if written is not None:  # the page may be one a write-back still reads: the decode writes it after
            written.wait()
        return True

    def launched(self) -> None:
        """A step was launched. Pages released before it are not in it, and the steps before it have
        finished by the next admission (the host reads their tokens first)."""
        self.in_flight.clear()

    def release(self, req: Request, kv_tokens: list[int]) -> None:
        """Give back ``req``'s pages; the full pages of ``kv_tokens`` (tokens whose KV is written)
        go to the prefix cache, the rest to the free list."""
        self.in_flight.update(req.pages)
        if self.radix is None:
            self.pool.free(req.own_pages)
            req.pages = []
            if self.windows is not None:
                self.windows.release(req)
            return
        num_full = min(len(kv_tokens) // self.page_size, len(req.pages))
        inserted = self.radix.insert(kv_tokens, req.pages[:num_full])
        if self.states is not None:
            self._place_snapshots(req, kv_tokens, num_full * self.page_size)
        if self.windows is not None:
            end, prompt_end = num_full * self.page_size, self.windows.prompt_end(req)
            self.windows.take(self.radix.node_ending_at(kv_tokens, end) if end else None, req, end)
            if prompt_end <= end:
                self.windows.take_prompt_end(self.radix.node_ending_at(kv_tokens, prompt_end), req)
            self.windows.release(req)
        self.pool.free([p for p in req.own_pages if p not in inserted.adopted])
        self.radix.unlock(req.prefix.node)
        req.pages, req.prefix = [], None
        if self.tier and self.tier.mode == "writethrough" and inserted.new_node is not None:
            self.tier.mirror(inserted.new_node)

    def stats(self) -> dict[str, int | float]:
        return {**self.counters, **(self.tier.stats() if self.tier else {}),
                **(self.states.stats() if self.states else {}), **(self.windows.stats() if self.windows else {})}

    def check(self, live: list[Request]) -> None:
        """Self-check: every GPU page is free, cached or owned by one live request, exactly once;
        every host page is free or held by one radix node, exactly once."""
        owners: list[int] = list(self.pool.free_pages())
        owners += self.radix.all_pages() if self.radix else []
        for req in live:
            owners += req.own_pages
        _check_once("GPU", owners, set(range(1, self.pool.num_pages)))
        if self.radix:
            self.radix.check()
        if self.tier:
            host = self.tier.host
            _check_once("host", list(host.free_pages()) + self.radix.all_host_pages(), set(range(host.num_pages)))
        if self.states:
            self.states.check([slot for req in live for _, slot in req.snapshots], list(self.radix._nodes()))
        if self.windows:
            self.windows.check(live, list(self.radix._nodes()) if self.radix else [])

    # ==== internals ====

    def _state_cache(self, pool: StatePool, host_bytes: int) -> StateCache:
        host_slots = int(host_bytes * HOST_SNAPSHOT_SHARE) // pool.slot_bytes
        cache = StateCache(pool, HostStatePool(pool, host_slots) if host_slots else None)
        self.radix.on_remove = cache.dropped
        return cache

    def _resumable(self, tokens: list[int], kept: str) -> tuple[int, int]:
        """How much of ``tokens``' cached prefix a hybrid or windowed model can resume from: up to
        the deepest matched node holding a state snapshot or a window (``kept`` names which; the
        node is kept from host eviction while the request is admitted); and how much is cached in all."""
        match = self.radix.match(tokens)
        path = self.radix.path(match.host_nodes[-1] if match.host_nodes else match.node)
        depth, usable, node = 0, 0, None
        for n in path:
            depth += len(n.key)
            if getattr(n, kept) is not None:
                usable, node = depth, n
        self.radix.protected = node
        return usable, depth

    def _resume_from(self, req: Request, prefix: PrefixMatch, cached: int) -> None:
        """A hybrid model's linear layers resume from the snapshot at the prefix's end, gpt-oss's
        sliding layers from the window there; the ``cached`` tokens past it are computed again."""
        if self.states is not None:
            req.resume_from = prefix.node if req.prefilled else None
            self.states.counters["state_recomputed_tokens"] += max(cached - req.prefilled, 0)
        if self.windows is not None:
            self.windows.resume(req, prefix.node, req.prefilled)
            self.windows.counters["window_recomputed_tokens"] += max(cached - req.prefilled, 0)
        self.radix.protected = None

    def _place_snapshots(self, req: Request, tokens: list[int], cached: int) -> None:
        """Hang ``req``'s pending snapshots on the nodes that end at their positions."""
        snapshots = sorted(req.snapshots)
        nodes = self.radix.nodes_ending_at(tokens, [pos for pos, _ in snapshots if pos <= cached])
        for (pos, slot), node in zip_longest(snapshots, nodes):  # None past the cached pages
            if node is None:
                self.states.release([slot])
            else:
                self.states.attach(node, slot)
        req.snapshots = []

    def _restore(self, tokens: list[int], locked: PrefixMatch, pages: list[int]) -> PrefixMatch:
        """Move the host continuation of ``locked`` (matched again: making room may have evicted
        some of it) into the first of ``pages``; returns the whole prefix, now on the GPU."""
        match = self.radix.match(tokens)
        num = match.num_host_pages
        if num:
            self.radix.attach(match.host_nodes, pages[:num])
            self.tier.restore([p for n in match.host_nodes for p in n.host_pages], pages[:num])
            match = PrefixMatch(match.pages + pages[:num], match.host_nodes[-1])
        return match

    def _make_room(self, n: int, reserve: int = 0) -> bool:
        if n + reserve > self.available_pages:
            return False
        if n > self.pool.num_free:
            save = self.tier.save if self.tier else _drop
            freed, host_freed = self.radix.evict(n - self.pool.num_free, save)
            self.pool.free(freed)
            if host_freed:
                self.tier.host.free(host_freed)
        return True


def _drop(node) -> None:
    return None


def _check_once(tier: str, owners: list[int], expected: set[int]) -> None:
    if len(owners) != len(set(owners)) or set(owners) != expected:
        dup = len(owners) - len(set(owners))
        lost = sorted(expected - set(owners))[:8]
        raise AssertionError(f"{tier} KV page accounting broken: {dup} pages held twice, lost pages {lost}")
