"""A gpt-oss reply read token by token with openai-harmony's ``StreamableParser``, as the same
events as the text parsers (``frontend.http.parsers``): the analysis channel's text is
``Reasoning``, a message to a recipient (``to=functions.NAME``, on commentary) is a call whose
arguments stream as its content does, and any other message (final, or a commentary preamble)
is content. Tokens that break the format (a model that wanders off it) are content as they decode."""

from __future__ import annotations

from typing import Any, Mapping, NamedTuple, Sequence

from openai_harmony import Role, StreamableParser

from frontend.http.harmony.encoding import encoding
from frontend.http.parsers.events import CallArguments, CallStart, Event, ParsedCall, Reasoning
from frontend.http.parsers.reply import Reply, Shaping, reply_of

FUNCTIONS = "functions."


class HarmonyFormat(NamedTuple):
    """How the reply to one request reads; in place of ``parsers.ReplyFormat``."""

    schemas: Mapping[str, Any] | None  # the tools' schemas by name; None: no tools, no calls parsed

    @property
    def stop_token_ids(self) -> tuple[int, ...]:
        """``<|call|>`` and ``<|return|>``: the reply ends at a call or at its final answer."""
        return tuple(sorted(encoding().stop_tokens_for_assistant_actions()))  # the library: a set

    def parser(self, reasoning: bool = False, stream_arguments: bool = False) -> HarmonyParser:
        return HarmonyParser(reasoning, stream_arguments, calls=self.schemas is not None)

    def whole(self, text: str, ids: Sequence[int] = ()) -> Reply:
        parser = self.parser(reasoning=True)
        return reply_of(parser.feed(text, ids) + parser.flush())


class HarmonyParser:
    """``feed`` each chunk's token ids (its text is not read) and ``flush`` at the end; the events
    are shaped as ``parsers.ReplyParser``'s are."""

    def __init__(self, reasoning: bool = False, stream_arguments: bool = False, calls: bool = True) -> None:
        self._encoding = encoding()
        self._ends = frozenset(self._encoding.stop_tokens())
        self._parser: Any = StreamableParser(self._encoding, Role.ASSISTANT)
        self._shaped = Shaping(reasoning, stream_arguments)
        self._reads_calls = calls  # else a message to a tool is content, as the text parsers do without tools
        self._messages = 0  # messages the parser has closed
        self._call: tuple[str, list[str]] | None = None  # the open call's name and argument pieces
        self._quiet: list[int] = []  # tokens since the last event (a header so far)
        self.calls = 0

    def feed(self, text: str, ids: Sequence[int] = ()) -> list[Event]:
        events: list[Event] = []
        for token in ids:
            events += self._token(token)
        return [shaped for e in events for shaped in self._shaped(e)]

    def flush(self) -> list[Event]:
        """The end of the reply: a message cut short (a length limit) is closed as it is."""
        events: list[Event] = []
        if self._parser is not None:
            try:
                self._parser.process_eos()
                events = self._closed()
            except Exception:  # noqa: BLE001 (HarmonyError: it ended inside a header)
                events = self._lost([])
        return [shaped for e in events for shaped in self._shaped(e)]

    def _token(self, token: int) -> list[Event]:
        if self._parser is None:  # off the format: the rest is content
            return [self._encoding.decode([token])]
        try:
            self._parser.process(token)
        except Exception:  # noqa: BLE001 (HarmonyError: not harmony)
            return self._lost([token])
        delta = self._parser.last_content_delta
        # only <|end|>, <|call|> and <|return|> close a message (reading the messages costs their length)
        events = (self._closed() if token in self._ends else []) + (self._delta(delta) if delta else [])
        self._quiet = [] if events else self._quiet + [token]
        return events

    def _delta(self, delta: str) -> list[Event]:
        recipient = self._parser.current_recipient
        if self._reads_calls and recipient is not None and recipient != "assistant":
            if self._call is None:
                self._call = (recipient.removeprefix(FUNCTIONS), [])
                return [CallStart(self.calls, self._call[0]), self._argument(delta)]
            return [self._argument(delta)]
        if self._parser.current_channel == "analysis":
            return [Reasoning(delta)]
        return [delta]

    def _argument(self, delta: str) -> CallArguments:
        assert self._call is not None
        self._call[1].append(delta)
        return CallArguments(self.calls, delta)

    def _closed(self) -> list[Event]:
        """A ``ParsedCall`` for each call among the messages that closed since the last token."""
        closed = self._parser.messages[self._messages:]
        self._messages += len(closed)
        events: list[Event] = []
        for message in closed:
            if self._reads_calls and message.recipient is not None and message.recipient != "assistant":
                arguments = "".join(self._call[1]) if self._call is not None else ""
                events.append(ParsedCall(message.recipient.removeprefix(FUNCTIONS), arguments or "{}"))
                self._call, self.calls = None, self.calls + 1
        return events

    def _lost(self, tokens: list[int]) -> list[Event]:
        """The format broke: the tokens that gave no event yet (a header's) and ``tokens`` are
        content, and so is every later token."""
        self._parser = None
        text = self._encoding.decode(self._quiet + tokens)
        return [text] if text else []
