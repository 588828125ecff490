"""``<think>...</think>`` reasoning, split from the content, whole or streamed. The reply starts
inside reasoning when the template opened ``<think>`` at the end of the prompt (Qwen3.5 does
unless ``enable_thinking`` is false), else only a ``<think>`` that opens the reply starts it.
Whitespace around the reasoning, and before the content that follows it, is markup: dropped."""

from __future__ import annotations

from typing import Callable, Union

from frontend.http.parsers.events import Reasoning
from frontend.http.parsers.text import until_marker

THINK, END_THINK = "<think>", "</think>"
Piece = Union[str, Reasoning]  # content, or reasoning


def opens_reasoning(prompt_tail: str) -> bool:
    """Whether the prompt (its last few tokens' text will do) leaves the reply inside reasoning."""
    return prompt_tail.rstrip().endswith(THINK)


class ReasoningSplit:
    """Streamed text in, ``Reasoning`` and content (``str``) pieces out."""

    def __init__(self, in_reasoning: bool) -> None:
        self._held = ""
        self._state: Callable[[], list[Piece] | None] = self._reasoning if in_reasoning else self._start
        self._space = ""  # whitespace at the end of the reasoning so far, held
        self._lead = True  # no reasoning text yet

    def feed(self, text: str) -> list[Piece]:
        self._held += text
        pieces: list[Piece] = []
        while (step := self._state()) is not None:  # a state returns None when it needs more text
            pieces += step
        return _nonempty(pieces)

    def flush(self) -> list[Piece]:
        held, self._held = self._held, ""
        if self._state == self._start:
            return _nonempty([held])
        if self._state == self._reasoning:  # ended inside reasoning (a length limit, say)
            return _nonempty([self._reasoning_text(held)])
        return []

    def _start(self) -> list[Piece] | None:
        s = self._held.lstrip()
        if s.startswith(THINK):
            self._held, self._state = s[len(THINK):], self._reasoning
            return []
        if not s or THINK.startswith(s):
            return None
        self._state = self._content
        return []

    def _reasoning(self) -> list[Piece] | None:
        text, self._held, ended = until_marker(self._held, END_THINK)
        if not (text or ended):
            return None
        piece = self._reasoning_text(text)
        if ended:
            self._state, self._space = self._after, ""
        return [piece]

    def _after(self) -> list[Piece] | None:
        s = self._held.lstrip()
        self._held = s
        if not s:
            return None
        self._state = self._content
        return []

    def _content(self) -> list[Piece] | None:
        text, self._held = self._held, ""
        return [text] if text else None

    def _reasoning_text(self, text: str) -> Reasoning:
        text = self._space + text
        if self._lead:
            text = text.lstrip()
        body = text.rstrip()
        self._space = text[len(body):]
        self._lead = self._lead and not body
        return Reasoning(body)


def _nonempty(pieces: list[Piece]) -> list[Piece]:
    return [p for p in pieces if (p.text if isinstance(p, Reasoning) else p)]
