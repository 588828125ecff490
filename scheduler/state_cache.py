"""Snapshots of hybrid models' recurrent state in the prefix cache: where a radix node's KV pages let
a full-attention layer resume, a snapshot at the node's end lets the linear layers resume.

A snapshot is the state after exactly the node's tokens, copied from a running request's slot
right after a forward that ended there, or written by the linear layers of a chunk that passes
there (never relabelled from a later position):

    at the last page boundary of each prompt (written inside the prompt's chunk: an agent's next
        turn re-renders the reply, so its tokens part from the generated ones right after it)
    at page-aligned chunk ends of long prompts (the latest few per request)
    during decode at each page boundary, the latest kept: the end of a finished request

They wait on the request (``pending``) until its pages enter the tree, then hang on the node that
ends at their position. A match resumes from the deepest node with a snapshot; the tokens after
it are computed again (``state_recomputed_tokens``).

```
 GPU snapshot slots   StatePool slots past the running ones     LRU; evicted to the host, or dropped
 host snapshot slots  HostStatePool (pinned)                     LRU; dropped
```

Snapshots are evicted apart from KV pages and budgeted apart from them. Every move of a snapshot
is a fixed-shape copy enqueued on the compute stream (about a millisecond for Qwen3.5-35B's 64 MB
over PCIe, once a turn), so it is ordered with the steps that write and read the slots and the
host never waits on it.
"""
from __future__ import annotations

import itertools
from typing import TYPE_CHECKING

from worker.kv.state_pool import HostStatePool, StatePool

if TYPE_CHECKING:
    from scheduler.radix_cache import _Node

_clock = itertools.count()
PENDING_PREFILL = 2  # chunk-end snapshots kept per request while it prefills (the latest ones)


class Snapshot:
    __slots__ = ("gpu", "host", "last_use")

    def __init__(self, gpu: int | None = None, host: int | None = None):
        self.gpu, self.host, self.last_use = gpu, host, next(_clock)


class StateCache:
    def __init__(self, pool: StatePool, host: HostStatePool | None = None):
        self.pool, self.host = pool, host
        self.gpu_holders: dict[int, _Node] = {}  # GPU snapshot slot -> the node it belongs to
        self.host_holders: dict[int, _Node] = {}
        self.counters = dict(state_snapshots_taken=0, state_snapshots_restored_gpu=0,
                             state_snapshots_restored_host=0, state_snapshots_to_host=0, state_snapshots_dropped=0,
                             state_prefix_tokens=0, state_recomputed_tokens=0)

    # ==== taking and placing ====

    def take(self, running_slot: int) -> int | None:
        """Copy a running slot into a fresh snapshot slot (None: no slot could be freed)."""
        slot = self.reserve()
        if slot is not None:
            self.pool.copy([running_slot], [slot])
        return slot

    def reserve(self) -> int | None:
        """A fresh snapshot slot, for a step that writes the state into it itself (None: no slot
        could be freed)."""
        if not self.pool.num_free and not self._evict_gpu():
            return None
        self.counters["state_snapshots_taken"] += 1
        return self.pool.allocate(1)[0]

    def retake(self, slot: int, running_slot: int) -> None:
        """Overwrite a pending snapshot with the running slot's newer state."""
        self.pool.copy([running_slot], [slot])

    def release(self, slots: list[int]) -> None:
        """Pending snapshots nobody will hang on a node."""
        self.pool.free(slots)

    def attach(self, node: _Node, slot: int) -> bool:
        """Hang snapshot ``slot`` on ``node`` (which ends at its position); False, and the slot is
        freed, when the node has one already."""
        if node.snapshot is not None:
            self.pool.free([slot])
            return False
        node.snapshot = Snapshot(gpu=slot)
        self.gpu_holders[slot] = node
        return True

    def restore(self, node: _Node, running_slot: int) -> None:
        """Copy ``node``'s snapshot into a running slot (from the GPU copy if there is one)."""
        snap = node.snapshot
        snap.last_use = next(_clock)
        if snap.gpu is not None:
            self.pool.copy([snap.gpu], [running_slot])
            self.counters["state_snapshots_restored_gpu"] += 1
        else:
            self.host.load_into(self.pool, [snap.host], [running_slot])
            self.counters["state_snapshots_restored_host"] += 1

    def dropped(self, node: _Node) -> None:
        """The radix tree removed ``node``: its snapshot goes with it."""
        snap, node.snapshot = node.snapshot, None
        if snap is None:
            return
        if snap.gpu is not None:
            del self.gpu_holders[snap.gpu]
            self.pool.free([snap.gpu])
        if snap.host is not None:
            del self.host_holders[snap.host]
            self.host.free([snap.host])

    # ==== eviction ====

    def _evict_gpu(self) -> bool:
        """Free the least recently used GPU snapshot slot, keeping a host copy when there is room."""
        if not self.gpu_holders:
            return False
        slot, node = min(self.gpu_holders.items(), key=lambda item: item[1].snapshot.last_use)
        snap = node.snapshot
        if snap.host is None and self.host is not None and (self.host.num_free or self._evict_host()):
            snap.host = self.host.allocate(1)[0]
            self.host.write_from(self.pool, [slot], [snap.host])
            self.host_holders[snap.host] = node
            self.counters["state_snapshots_to_host"] += 1
        del self.gpu_holders[slot]
        snap.gpu = None
        self.pool.free([slot])
        if snap.host is None:
            node.snapshot = None
            self.counters["state_snapshots_dropped"] += 1
        return True

    def _evict_host(self) -> bool:
        if not self.host_holders:
            return False
        slot, node = min(self.host_holders.items(), key=lambda item: item[1].snapshot.last_use)
        del self.host_holders[slot]
        self.host.free([slot])
        node.snapshot.host = None
        if node.snapshot.gpu is None:
            node.snapshot = None
            self.counters["state_snapshots_dropped"] += 1
        return True

    # ==== accounting ====

    def stats(self) -> dict[str, int]:
        host_slots = self.host.capacity if self.host else 0
        return {**self.counters, "state_snapshots_gpu": len(self.gpu_holders),
                "state_snapshots_host": len(self.host_holders),
                "state_snapshot_bytes_gpu": len(self.gpu_holders) * self.pool.slot_bytes,
                "state_snapshot_bytes_host": len(self.host_holders) * self.pool.slot_bytes,
                "state_snapshot_slots_gpu": self.pool.capacity, "state_snapshot_slots_host": host_slots}

    def check(self, pending: list[int], nodes) -> None:
        """Every snapshot slot is free, pending on one live request or held by one node, once."""
        owners = list(self.pool.free_pages()) + pending + list(self.gpu_holders)
        expected = set(range(self.pool.running + 1, self.pool.num_slots))
        if len(owners) != len(set(owners)) or set(owners) != expected:
            raise AssertionError(f"state snapshot slots broken: held {sorted(owners)}, expected {sorted(expected)}")
        if self.host:
            host = list(self.host.free_pages()) + list(self.host_holders)
            if len(host) != len(set(host)) or set(host) != set(range(self.host.num_slots)):
                raise AssertionError("host state snapshot slots broken")
        held = {id(n) for n in nodes if n.snapshot is not None}
        holders = {id(n) for n in [*self.gpu_holders.values(), *self.host_holders.values()]}
        if held != holders:
            raise AssertionError("radix nodes' snapshots and the state cache disagree")
