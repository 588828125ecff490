"""Incremental detokenization that never emits a broken UTF-8 sequence.

The ids are decoded as a window that starts a few tokens back (prompt tokens at first), so that
decoders which drop a word's leading space at the start of a text (SentencePiece) still produce
it. Trailing U+FFFD (a multi-byte character split over tokens) is held back until the character
is complete or the request ends."""

from __future__ import annotations

from typing import Callable, Sequence

# Tokens of left context kept in the window; it slides once it holds twice as many.
_CONTEXT_TOKENS = 6
_REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    def __init__(self, decode: Callable[[Sequence[int]], str], prompt_ids: Sequence[int]) -> None:
        self._decode = decode
        self._ids = list(prompt_ids[-_CONTEXT_TOKENS:])
        self._start = 0  # the window is ids[start:]
        self._emitted = len(decode(self._ids))  # characters of the window's text already emitted

    def step(self, new_ids: Sequence[int]) -> str:
        """Append ``new_ids``; return the text that became final."""
        self._ids.extend(new_ids)
        return self._advance(final=False)

    def flush(self) -> str:
        """The request ended: return whatever was held back, incomplete characters included."""
        return self._advance(final=True)

    def _advance(self, final: bool) -> str:
        text = self._decode(self._ids[self._start :])
        complete = not text.endswith(_REPLACEMENT)
        if not final:
            text = text.rstrip(_REPLACEMENT)
        delta = text[self._emitted :]
        self._emitted = max(self._emitted, len(text))
        if complete and len(self._ids) - self._start > 2 * _CONTEXT_TOKENS:
            # Everything decoded so far was emitted: restart the window near the end.
            self._start = len(self._ids) - _CONTEXT_TOKENS
            self._emitted = len(self._decode(self._ids[self._start :]))
        return delta
