"""Stop strings over streamed text: text that could still be the start of a stop string is held
back, so a client never sees part of a stop string."""

from __future__ import annotations

from typing import NamedTuple, Sequence


class StopResult(NamedTuple):
    text: str  # safe to emit now
    stopped: bool  # a stop string matched; ``text`` ends right before it


class StopMatcher:
    def __init__(self, stops: Sequence[str]) -> None:
        self._stops = [s for s in stops if s]
        self._held = ""
        self.matched: str | None = None  # the stop string that matched, once one has

    def feed(self, text: str) -> StopResult:
        if not self._stops:
            return StopResult(text, False)
        held = self._held + text
        # Everything before ``held`` was checked already and cannot start a match (it was not held).
        # The match that completes first wins (as it would token by token), the longest on a tie.
        hits = [(i + len(s), i, s) for s in self._stops if (i := held.find(s)) >= 0]
        if hits:
            _, start, self.matched = min(hits)
            self._held = ""
            return StopResult(held[:start], True)
        keep = self._partial_suffix(held)
        self._held = held[len(held) - keep :] if keep else ""
        return StopResult(held[: len(held) - keep], False)

    def flush(self) -> str:
        held, self._held = self._held, ""
        return held

    def _partial_suffix(self, text: str) -> int:
        # Length of the longest suffix of ``text`` that is a proper prefix of some stop string.
        longest = min(len(text), max(len(s) for s in self._stops) - 1)
        for n in range(longest, 0, -1):
            tail = text[-n:]
            if any(s.startswith(tail) for s in self._stops):
                return n
        return 0
