"""Helpers the stream parsers share: markers that may be cut between two pieces of text, and the
whitespace around calls."""

from __future__ import annotations

from typing import Sequence


def partial_suffix(text: str, marker: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``marker``."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


def until_marker(held: str, marker: str) -> tuple[str, str, bool]:
    """``held`` split at ``marker``: the text before it, the text after it, True; or, where it has
    not come yet, the text that cannot be its start, the rest (a marker's cut start) held, False."""
    at = held.find(marker)
    if at >= 0:
        return held[:at], held[at + len(marker):], True
    keep = len(held) - partial_suffix(held, marker)
    return held[:keep], held[keep:], False


def first_of(text: str, markers: Sequence[str], start: int = 0) -> tuple[int, str]:
    """The position and the marker that comes first in ``text[start:]`` (-1 and "" when none does)."""
    found = [(i, m) for m in markers if (i := text.find(m, start)) >= 0]
    return min(found, key=lambda f: f[0]) if found else (-1, "")


class SpaceAfterCalls:
    """The whitespace a model writes between and after calls is markup, not a message: after a
    call it is held, and emitted only if more content follows."""

    def __init__(self) -> None:
        self._held = ""

    def content(self, text: str, calls: int) -> str:
        if not calls:
            return text
        text, self._held = self._held + text, ""
        if text.strip():
            return text
        self._held = text
        return ""

    def drop(self) -> None:
        """A call follows: the whitespace held before it was markup too."""
        self._held = ""
