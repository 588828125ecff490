"""A reply parser for one request: the model's text, whole or streamed, through the reasoning
split and then the template's tool-call format, as one stream of events."""

from __future__ import annotations

from functools import lru_cache
from typing import Any, Literal, Mapping, NamedTuple, Sequence

from frontend.http.parsers.events import CallArguments, CallStart, Event, ParsedCall, Reasoning
from frontend.http.parsers.json_calls import ToolCallStream
from frontend.http.parsers.reasoning import END_THINK, THINK, ReasoningSplit, opens_reasoning
from frontend.http.parsers.xml_calls import FUNCTION, PARAMETER, XmlCallStream


class TemplateMarkup(NamedTuple):
    """The markup a chat template teaches its model."""

    calls: Literal["json", "xml"]
    reasoning: bool  # the template knows <think>


@lru_cache(maxsize=4)
def template_markup(template: str | None) -> TemplateMarkup:
    """XML calls where the template shows ``<function=...><parameter=...>`` (Qwen3-Coder,
    Qwen3.5), else the JSON ``<tool_call>`` of Hermes / Qwen2.5 / Qwen3, today's default."""
    text = template or ""
    calls = "xml" if FUNCTION in text and PARAMETER in text else "json"
    return TemplateMarkup(calls, THINK in text or END_THINK in text)


class Reply(NamedTuple):
    content: str | None  # None when only whitespace is left
    calls: list[ParsedCall]
    reasoning: str | None


class ReplyFormat(NamedTuple):
    """How the reply to one request reads."""

    markup: TemplateMarkup
    in_reasoning: bool  # the prompt opened <think>
    schemas: Mapping[str, Any] | None  # each tool's parameters schema by name; None: no tools

    @classmethod
    def of(cls, template: str | None, prompt_tail: str, schemas: Mapping[str, Any] | None) -> ReplyFormat:
        markup = template_markup(template)
        return cls(markup, markup.reasoning and opens_reasoning(prompt_tail), schemas)

    def parser(self, reasoning: bool = False, stream_arguments: bool = False) -> ReplyParser:
        return ReplyParser(self, reasoning, stream_arguments)

    @property
    def stop_token_ids(self) -> tuple[int, ...]:
        return ()  # the model's EOS ids end the reply

    def whole(self, text: str, ids: Sequence[int] = ()) -> Reply:
        """A whole reply's content, calls and reasoning."""
        parser = self.parser(reasoning=True)
        return reply_of(parser.feed(text, ids) + parser.flush())


def reply_of(events: list[Event]) -> Reply:
    """A whole reply from all of its events."""
    content = "".join(e for e in events if isinstance(e, str))
    calls = [e for e in events if isinstance(e, ParsedCall)]
    if calls:
        content = content.strip()
    reasoning = "".join(e.text for e in events if isinstance(e, Reasoning))
    return Reply(content or None, calls, reasoning or None)


class Shaping:
    """A parser's events as its reader asked for them: ``Reasoning`` kept or left out, a call's
    ``CallStart`` and ``CallArguments`` kept (made up before a ``ParsedCall`` that came alone) or
    left out."""

    def __init__(self, reasoning: bool, stream_arguments: bool) -> None:
        self._reasoning, self._stream_arguments = reasoning, stream_arguments
        self._open = False  # a CallStart went out for the call in progress
        self._closed = 0  # calls closed so far

    def __call__(self, event: Event) -> list[Event]:
        if isinstance(event, Reasoning):
            return [event] if self._reasoning else []
        if isinstance(event, (CallStart, CallArguments)):
            self._open = True
            return [event] if self._stream_arguments else []
        if isinstance(event, ParsedCall):
            opened, self._open, index = self._open, False, self._closed
            self._closed += 1
            if self._stream_arguments and not opened:
                return [CallStart(index, event.name), CallArguments(index, event.arguments), event]
        return [event]


class ReplyParser:
    """``feed`` pieces of the reply and ``flush`` at its end; each gives the events in order:
    ``str`` content and a ``ParsedCall`` as each call closes; with ``reasoning``, ``Reasoning``
    pieces (else the reasoning is left out); with ``stream_arguments``, a ``CallStart`` and
    ``CallArguments`` pieces before each ``ParsedCall`` (in one go for the JSON format)."""

    def __init__(self, reply: ReplyFormat, reasoning: bool = False, stream_arguments: bool = False) -> None:
        self._split = ReasoningSplit(reply.in_reasoning) if reply.markup.reasoning else None
        self._calls: ToolCallStream | XmlCallStream | None = None
        if reply.schemas is not None:
            self._calls = XmlCallStream(reply.schemas) if reply.markup.calls == "xml" else ToolCallStream()
        self._shaped = Shaping(reasoning, stream_arguments)

    @property
    def calls(self) -> int:
        return self._calls.calls if self._calls is not None else 0

    def feed(self, text: str, ids: Sequence[int] = ()) -> list[Event]:
        """The events of the reply's next ``text`` (its token ``ids`` are for the harmony parser)."""
        return self._events(self._split.feed(text) if self._split is not None else [text], False)

    def flush(self) -> list[Event]:
        return self._events(self._split.flush() if self._split is not None else [], True)

    def _events(self, pieces: list[str | Reasoning], end: bool) -> list[Event]:
        """Reasoning passes by; content goes through the call parser, if any."""
        events: list[Event] = []
        for piece in pieces:
            if isinstance(piece, Reasoning) or self._calls is None:
                events.append(piece)
            else:
                events += self._calls.feed(piece)
        if end and self._calls is not None:
            events += self._calls.flush()
        return [shaped for e in events for shaped in self._shaped(e)]
