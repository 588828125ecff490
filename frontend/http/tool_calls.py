"""The Hermes / Qwen JSON tool-call parser under the names code imports from here; it lives in
``frontend.http.parsers.json_calls``. New code takes a ``ReplyFormat``'s parser instead
(``frontend.http.parsers``: the model's own call markup, reasoning, streamed arguments)."""

from __future__ import annotations

from typing import Union

from frontend.http.parsers.events import ParsedCall
from frontend.http.parsers.json_calls import CLOSE, OPEN, ToolCallStream, parse_call, parse_tool_calls

Event = Union[str, ParsedCall]  # content text, or one complete call

__all__ = ["CLOSE", "OPEN", "Event", "ParsedCall", "ToolCallStream", "parse_call", "parse_tool_calls"]
