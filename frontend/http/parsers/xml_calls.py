"""Tool calls in generated text, Qwen3-Coder style (the Qwen3-Coder and Qwen3.5 templates)::

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    <parameter=days>
    3
    </parameter>
    </function>
    </tool_call>

A value is text, typed by the tool's JSON schema (``typed_value``); the arguments are the JSON
object of the values. Streamed, a call starts at ``<function=NAME>`` and its arguments come out as
each parameter closes: ``{"city": "Paris"``, then ``, "days": 3``, then ``}``. A block that does
not open with ``<function=NAME>`` stays in the content as text (except a JSON body, which these
models sometimes write, read as the Hermes format); once a call has started, stray text between
its parameters is dropped, and text that ends inside a call closes it."""

from __future__ import annotations

import json
from typing import Any, Callable, Mapping

from frontend.http.parsers.events import CallArguments, CallStart, Event, ParsedCall
from frontend.http.parsers.json_calls import CLOSE, OPEN, parse_call
from frontend.http.parsers.text import SpaceAfterCalls, first_of, until_marker

FUNCTION, FUNCTION_END = "<function=", "</function>"
PARAMETER, PARAMETER_END = "<parameter=", "</parameter>"
# A value ends at its close tag, or, when the model forgot it, at the next tag.
_VALUE_ENDS = (PARAMETER_END, PARAMETER, FUNCTION_END)
_MAX_NAME = 256
_JSON_TYPES: dict[str, Any] = {"integer": int, "number": (int, float), "boolean": bool,
                               "object": dict, "array": list, "null": type(None)}
_NO_VALUE = object()


class XmlCallStream:
    """Splits streamed text into content and calls; like ``ToolCallStream``, never shows part of
    a call's markup as content. ``schemas``: each tool's parameters schema, by tool name."""

    def __init__(self, schemas: Mapping[str, Any] | None = None) -> None:
        self._schemas = schemas or {}
        self._held = ""
        self._state: Callable[[], list[Event] | None] = self._content
        self._space = SpaceAfterCalls()
        self._block_calls = 0  # calls in the open <tool_call> block
        self._name = self._parameter = self._arguments = ""  # the open call
        self._scanned = 0  # the open value's text up to here holds no end: a long value is read once
        self.calls = 0

    def feed(self, text: str) -> list[Event]:
        self._held += text
        events: list[Event] = []
        while (step := self._state()) is not None:  # a state returns None when it needs more text
            events += step
        return [e for e in events if e != ""]

    def flush(self) -> list[Event]:
        events = self._end()
        self._held, self._state = "", self._content
        return [e for e in events if e != ""]

    # ==== states: each consumes held text or moves on, else returns None ====

    def _content(self) -> list[Event] | None:
        text, self._held, opened = until_marker(self._held, OPEN)
        if not (text or opened):
            return None
        if opened:
            self._state, self._block_calls = self._block, 0
        return [self._text(text)]

    def _block(self) -> list[Event] | None:
        """Inside ``<tool_call>``: before its function, or after one."""
        s = self._held.lstrip()
        if self._block_calls and s.startswith(CLOSE):
            self._held, self._state = s[len(CLOSE):], self._content
            return []
        if s.startswith(FUNCTION):
            return self._start_call(s[len(FUNCTION):])
        if s.startswith("{") and not self._block_calls:
            self._state = self._json_body
            return []
        if not s or FUNCTION.startswith(s) or (self._block_calls and CLOSE.startswith(s)):
            return None
        return self._not_a_call()

    def _start_call(self, rest: str) -> list[Event] | None:
        end = rest.find(">")
        if end < 0:
            return None if _could_be_name(rest) else self._not_a_call()
        if not 0 < end <= _MAX_NAME or not _could_be_name(rest[:end]):
            return self._not_a_call()
        self._name, self._arguments = rest[:end], ""
        self._held, self._state = rest[end + 1:], self._function
        self._space.drop()
        return [CallStart(self.calls, self._name)]

    def _not_a_call(self) -> list[Event]:
        self._state = self._content  # what is held is read again, as content
        return [] if self._block_calls else [self._text(OPEN)]

    def _function(self) -> list[Event] | None:
        """Inside ``<function=NAME>``, between parameters."""
        s = self._held.lstrip()
        if s.startswith(PARAMETER):
            end = s.find(">")
            if end < 0:
                return None
            self._parameter, self._held = s[len(PARAMETER):end].strip(), s[end + 1:]
            self._state, self._scanned = self._value, 0
            return []
        for marker, after in ((FUNCTION_END, self._block), (CLOSE, self._content)):
            if s.startswith(marker):
                self._held, self._state = s[len(marker):], after
                return self._close_call()
        if not s or any(m.startswith(s) for m in (PARAMETER, FUNCTION_END, CLOSE)):
            return None
        stray = s.find("<", 1)
        self._held = s[stray:] if stray > 0 else ""
        return []

    def _value(self) -> list[Event] | None:
        end, marker = first_of(self._held, _VALUE_ENDS, self._scanned)
        if end < 0:
            self._scanned = max(0, len(self._held) - max(map(len, _VALUE_ENDS)) + 1)
            return None
        value = self._held[:end]
        self._held = self._held[end + len(marker):] if marker == PARAMETER_END else self._held[end:]
        self._state = self._function
        return [self._argument(value)]

    def _json_body(self) -> list[Event] | None:
        end = self._held.find(CLOSE)
        if end < 0:
            return None
        body, self._held = self._held[:end], self._held[end + len(CLOSE):]
        self._state = self._content
        return [self._json_call(body, CLOSE)]

    def _end(self) -> list[Event]:
        """The text ended in the state it is in."""
        held, state = self._held, self._state
        if state == self._content:
            return [self._text(held)]
        if state == self._block:
            if self._block_calls:
                return [] if CLOSE.startswith(held.lstrip()) else [self._text(held)]
            return [self._text(OPEN + held)]
        if state == self._json_body:
            return [self._json_call(held, "")]
        return ([self._argument(held)] if state == self._value else []) + self._close_call()

    # ==== what the states emit ====

    def _argument(self, value: str) -> CallArguments:
        typed = typed_value(_unwrapped(value), self._parameter_schema())
        piece = ("{" if not self._arguments else ", ") + json.dumps(self._parameter, ensure_ascii=False)
        piece += ": " + json.dumps(typed, ensure_ascii=False)
        self._arguments += piece
        return CallArguments(self.calls, piece)

    def _close_call(self) -> list[Event]:
        piece = "}" if self._arguments else "{}"
        self._arguments += piece
        self.calls += 1
        self._block_calls += 1
        return [CallArguments(self.calls - 1, piece), ParsedCall(self._name, self._arguments)]

    def _json_call(self, body: str, close: str) -> Event:
        call = parse_call(body)
        if call is None:
            return self._text(OPEN + body + close)
        self._space.drop()
        self.calls += 1
        self._block_calls += 1
        return call

    def _text(self, text: str) -> str:
        return self._space.content(text, self.calls)

    def _parameter_schema(self) -> Any:
        schema = self._schemas.get(self._name)
        properties = schema.get("properties") if isinstance(schema, Mapping) else None
        return properties.get(self._parameter) if isinstance(properties, Mapping) else None


def typed_value(text: str, schema: Any) -> Any:
    """``text`` as the first JSON type its schema declares that it parses as; else the string."""
    for kind in _declared_types(schema):
        value = _parsed(text, kind)
        if value is not _NO_VALUE:
            return value
    return text


def _declared_types(schema: Any) -> list[str]:
    if not isinstance(schema, Mapping):
        return []
    kinds = schema.get("type")
    if isinstance(kinds, str):
        return [kinds]
    if isinstance(kinds, list):
        return [k for k in kinds if isinstance(k, str)]
    options = schema.get("anyOf") or schema.get("oneOf")
    return [k for option in options for k in _declared_types(option)] if isinstance(options, list) else []


def _parsed(text: str, kind: str) -> Any:
    expected = _JSON_TYPES.get(kind)  # None for "string": the text is the value
    if expected is None:
        return _NO_VALUE
    text = text.strip().lower() if kind == "boolean" else text.strip()
    try:
        value = json.loads(text, parse_constant=_not_json)
    except ValueError:
        return _NO_VALUE
    if isinstance(value, bool) and kind != "boolean":  # a bool is an int in Python, not in JSON
        return _NO_VALUE
    return value if isinstance(value, expected) else _NO_VALUE


def _not_json(constant: str) -> Any:
    raise ValueError(f"{constant} is not JSON")


def _unwrapped(value: str) -> str:
    """The template writes a value on its own lines: one newline each side is markup."""
    value = value[1:] if value.startswith("\n") else value
    return value[:-1] if value.endswith("\n") else value


def _could_be_name(text: str) -> bool:
    return len(text) <= _MAX_NAME and not any(c.isspace() or c in "<>" for c in text)
