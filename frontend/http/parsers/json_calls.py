"""Tool calls in generated text, Hermes / Qwen2.5 / Qwen3 style: ``<tool_call>{"name": ...,
"arguments": {...}}</tool_call>`` blocks, whole or streamed. A block whose body is not such a JSON
object is left in the content as text, so nothing the model wrote is lost. A call comes out whole,
as one ``ParsedCall``, when its block closes."""

from __future__ import annotations

import json
from typing import Union

from frontend.http.parsers.events import ParsedCall
from frontend.http.parsers.text import SpaceAfterCalls, partial_suffix

OPEN = "<tool_call>"
CLOSE = "</tool_call>"


def parse_call(body: str) -> ParsedCall | None:
    try:
        value = json.loads(body)
    except ValueError:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    if not isinstance(arguments, str):
        arguments = json.dumps(arguments, ensure_ascii=False)
    return ParsedCall(value["name"], arguments)


def parse_tool_calls(text: str) -> tuple[str | None, list[ParsedCall]]:
    """The content (None when only whitespace is left) and the calls of a whole completion."""
    parser = ToolCallStream()
    events = parser.feed(text) + parser.flush()
    calls = [e for e in events if isinstance(e, ParsedCall)]
    content = "".join(e for e in events if isinstance(e, str))
    if calls:
        content = content.strip()
    return content or None, calls


class ToolCallStream:
    """Splits streamed text into content and calls. Text that could be the start of ``<tool_call>``
    is held back, and a block is held until ``</tool_call>`` closes it: a client never sees part
    of a call's markup as content."""

    def __init__(self) -> None:
        self._held = ""
        self._in_call = False
        self._space = SpaceAfterCalls()
        self.calls = 0

    def feed(self, text: str) -> list[Union[str, ParsedCall]]:
        self._held += text
        events: list[Union[str, ParsedCall]] = []
        while True:
            event = self._next_call() if self._in_call else self._next_content()
            if event is None:
                return [e for e in events if e]
            events.append(event)

    def flush(self) -> list[Union[str, ParsedCall]]:
        """The text ended: an unclosed block is a call if its body parses, else content."""
        held, self._held = self._held, ""
        if not self._in_call:
            return [self._content(held)] if held else []
        self._in_call = False
        call = parse_call(held)
        if call is not None:
            self.calls += 1
            return [call]
        return [self._content(OPEN + held)]

    def _next_content(self) -> Union[str, ParsedCall, None]:
        start = self._held.find(OPEN)
        if start >= 0:
            text, self._held = self._held[:start], self._held[start + len(OPEN) :]
            self._in_call = True
            return self._content(text)
        keep = partial_suffix(self._held, OPEN)
        text = self._held[: len(self._held) - keep]
        self._held = self._held[len(text) :]
        return self._content(text) if text else None

    def _next_call(self) -> Union[str, ParsedCall, None]:
        end = self._held.find(CLOSE)
        if end < 0:
            return None
        body, self._held = self._held[:end], self._held[end + len(CLOSE) :]
        self._in_call = False
        call = parse_call(body)
        if call is None:
            return self._content(OPEN + body + CLOSE)
        self.calls += 1
        return call

    def _content(self, text: str) -> str:
        return self._space.content(text, self.calls)
