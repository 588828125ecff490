"""The frontend's live requests, keyed twice: by the frontend's own ``rid`` (what the scheduler
sees) and by (client identity, client rid) (what a client may abort). A request being tokenized
holds its client key already (an Abort or a duplicate sees it) but has no ``RequestState`` yet.
Stats requests wait here too, by nonce, for the scheduler's reply."""

from __future__ import annotations

from typing import NamedTuple

from frontend.request_state import RequestState


class Waiting(NamedTuple):
    """Who to answer: the client's routing frames ([identity] for a local client) and its rid."""

    envelope: list[bytes]
    client_rid: str


class Dropped(NamedTuple):
    """What ``take_all`` emptied the table of, to be answered."""

    tokenizing: list[Waiting]
    running: list[RequestState]
    stats: list[Waiting]


class RequestTable:
    def __init__(self) -> None:
        self.running: dict[str, RequestState] = {}
        self.tokenizing: dict[str, Waiting] = {}
        self.stats_waiting: dict[int, Waiting] = {}
        self._by_client: dict[tuple[bytes, str], str] = {}

    def rid_of(self, identity: bytes, client_rid: str) -> str | None:
        """The live request (tokenizing or running) that a client knows as ``client_rid``."""
        return self._by_client.get((identity, client_rid))

    def add_tokenizing(self, rid: str, envelope: list[bytes], client_rid: str) -> None:
        self._by_client[(envelope[0], client_rid)] = rid
        self.tokenizing[rid] = Waiting(envelope, client_rid)

    def tokenized(self, rid: str) -> bool:
        """The request is tokenized and goes on (its client key stays); False: it was aborted, or
        its client left, meanwhile."""
        return self.tokenizing.pop(rid, None) is not None

    def drop_tokenizing(self, rid: str) -> Waiting | None:
        """Forget a request that never reaches the scheduler; None: forgotten already."""
        waiting = self.tokenizing.pop(rid, None)
        if waiting is not None:
            del self._by_client[(waiting.envelope[0], waiting.client_rid)]
        return waiting

    def start(self, rid: str, state: RequestState) -> None:
        self.running[rid] = state

    def forget(self, rid: str) -> RequestState:
        state = self.running.pop(rid)
        del self._by_client[(state.envelope[0], state.client_rid)]
        return state

    def remove_client(self, identity: bytes) -> list[str]:
        """Forget everything of a client that left; returns the rids the scheduler runs for it."""
        running = [rid for rid, s in self.running.items() if s.envelope[0] == identity]
        for rid in running:
            self.forget(rid)
        for rid in [r for r, w in self.tokenizing.items() if w.envelope[0] == identity]:
            self.drop_tokenizing(rid)
        for nonce in [n for n, w in self.stats_waiting.items() if w.envelope[0] == identity]:
            del self.stats_waiting[nonce]
        return running

    def take_all(self) -> Dropped:
        """Empty the table (the scheduler is gone); what was in it, to be answered."""
        dropped = Dropped(list(self.tokenizing.values()), list(self.running.values()),
                          list(self.stats_waiting.values()))
        self.running, self.tokenizing, self.stats_waiting, self._by_client = {}, {}, {}, {}
        return dropped

    def clients(self) -> int:
        return len({s.envelope[0] for s in self.running.values()})
