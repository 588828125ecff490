"""What a reply parser emits, in the order the model wrote it: content text, reasoning text, and
tool calls, each call either whole or as a start and the pieces of its arguments."""

from __future__ import annotations

from typing import NamedTuple, Union


class ParsedCall(NamedTuple):
    """A complete call; a parser emits it when the call closes."""

    name: str
    arguments: str  # JSON text, as OpenAI's tool_calls carry it


class Reasoning(NamedTuple):
    text: str  # a piece of the reasoning (``<think>`` ... ``</think>``)


class CallStart(NamedTuple):
    index: int  # the call's place among the reply's calls, from 0
    name: str


class CallArguments(NamedTuple):
    index: int
    text: str  # the next piece of the call's JSON arguments; the pieces join into ParsedCall.arguments


Event = Union[str, Reasoning, CallStart, CallArguments, ParsedCall]  # str: content
