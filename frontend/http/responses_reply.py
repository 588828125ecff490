"""``/v1/responses`` replies, whole or as the typed event stream. Both are built by one
``ResponseBuilder`` from the same parser events (``frontend.http.parsers``: content, reasoning,
calls with their arguments in pieces), so a whole reply is exactly the ``response.completed`` of
the same stream.

    response.created, response.in_progress
    per reasoning or message item:  output_item.added, content_part.added,
        reasoning_text.delta... | output_text.delta..., reasoning_text.done | output_text.done,
        content_part.done, output_item.done
    per call:  output_item.added, function_call_arguments.delta..., .done, output_item.done
    response.completed | response.incomplete (max_output_tokens) | response.failed
"""

from __future__ import annotations

import uuid
from typing import AsyncIterator, Callable, NamedTuple

import msgspec

from frontend.api.replies import Chunk
from frontend.http import responses_objects as o
from frontend.http import sse
from frontend.http.errors import ApiError
from frontend.http.parsers import (CallArguments, CallStart, Event, ParsedCall, Reasoning, ReplyFormat,
                                   ReplyParser)
from frontend.http.session import Session, stream_events
from frontend.tokenizer import ChatTokenizer


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class _TextKind(NamedTuple):
    """How an item of one text part is made and streamed."""

    item: Callable[[], o.TextItem]
    part: Callable[[], o.OutputText | o.ReasoningText]
    delta: type[o.Event]
    done: type[o.Event]


MESSAGE = _TextKind(lambda: o.MessageOut(id=_id("msg"), status="in_progress", content=[]),
                    lambda: o.OutputText(text=""), o.TextDelta, o.TextDone)
REASONING = _TextKind(lambda: o.ReasoningOut(id=_id("rs"), status="in_progress", content=[]),
                      lambda: o.ReasoningText(text=""), o.ReasoningDelta, o.ReasoningDone)


class ResponseBuilder:
    """The output items of one response, and (when streaming) the events that build them.

    Whitespace between text and the next item's markup is markup: trailing whitespace is held
    until more text of the same item follows, and dropped when another item starts."""

    def __init__(self, frame: o.ResponseObject, streaming: bool, count_tokens: Callable[[str], int]) -> None:
        self.response = frame
        self._streaming = streaming
        self._count_tokens = count_tokens  # of the reasoning, for usage
        self._sequence = 0
        self._output: list[o.OutputItem] = []
        self._text: tuple[_TextKind, o.TextItem] | None = None  # the open text item
        self._kind: _TextKind | None = None  # of the open item, or of the whitespace held
        self._space = ""
        self._call: o.FunctionCallOut | None = None  # the call whose arguments are arriving
        self._namespaces = {f.get("name"): t["name"] for t in frame.tools if t.get("type") == "namespace"
                            for f in t.get("tools", [])}

    def start(self) -> list[bytes]:
        return self._emit(o.Created, response=self.response) + self._emit(o.InProgress, response=self.response)

    def feed(self, event: Event) -> list[bytes]:
        if isinstance(event, Reasoning):
            return self._append_text(REASONING, event.text)
        if isinstance(event, str):
            return self._append_text(MESSAGE, event)
        if isinstance(event, CallStart):
            return self._start_call(event.name)
        if isinstance(event, CallArguments):
            return self._arguments(event.text)
        return self._end_call(event)

    def finish(self, chunk: Chunk) -> list[bytes]:
        """The last chunk: close the output and report the whole response with its usage."""
        assert chunk.usage is not None
        cut = chunk.finish_reason == "length"
        events: list[bytes] = []
        if not self._output:  # nothing but whitespace: still a message
            events += self._open_text(MESSAGE)
        if self._kind is MESSAGE and self._space:
            events += self._delta(self._space)
        events += self._close_text("incomplete" if cut else "completed")
        reasoning = "".join(i.content[0].text for i in self._output if isinstance(i, o.ReasoningOut))
        self.response = msgspec.structs.replace(
            self.response, output=self._output, usage=o.usage(chunk.usage, self._count_tokens(reasoning)),
            status="incomplete" if cut else "completed",
            incomplete_details=o.IncompleteDetails(reason="max_output_tokens") if cut else None)
        if chunk.finish_reason == "abort":  # the scheduler gave it up (shutting down, a failure)
            return events + self.fail(ApiError(503, "the request was aborted before it finished"))
        return events + self._emit(o.Incomplete if cut else o.Completed, response=self.response)

    def fail(self, exc: ApiError) -> list[bytes]:
        self.response = msgspec.structs.replace(
            self.response, status="failed", error=o.ErrorInfo(code=exc.code or exc.type, message=str(exc)))
        return self._emit(o.Failed, response=self.response)

    # ==== text items: messages and reasoning ====

    def _append_text(self, kind: _TextKind, piece: str) -> list[bytes]:
        events = self._close_text("completed") if self._kind is not kind else []
        self._kind, body = kind, piece.rstrip()
        if not body:
            self._space += piece
            return events
        delta, self._space = self._space + body, piece[len(body):]
        if self._text is None:
            events += self._open_text(kind)
        return events + self._delta(delta)

    def _open_text(self, kind: _TextKind) -> list[bytes]:
        item = kind.item()
        self._text, index = (kind, item), len(self._output)
        self._output.append(item)
        events = self._emit(o.ItemAdded, output_index=index, item=item)
        item.content.append(kind.part())
        return events + self._emit(o.PartAdded, item_id=item.id, output_index=index, part=item.content[0])

    def _delta(self, delta: str) -> list[bytes]:
        assert self._text is not None
        kind, item = self._text
        item.content[0].text += delta
        return self._emit(kind.delta, item_id=item.id, output_index=len(self._output) - 1, delta=delta)

    def _close_text(self, status: o.ItemStatus) -> list[bytes]:
        """Close the open text item, if any; held whitespace goes with it."""
        text, self._text, self._kind, self._space = self._text, None, None, ""
        if text is None:
            return []
        kind, item = text
        item.status = status
        index, part = self._output.index(item), item.content[0]
        return (self._emit(kind.done, item_id=item.id, output_index=index, text=part.text)
                + self._emit(o.PartDone, item_id=item.id, output_index=index, part=part)
                + self._emit(o.ItemDone, output_index=index, item=item))

    # ==== function calls ====

    def _start_call(self, name: str) -> list[bytes]:
        events = self._close_text("completed")
        self._call = o.FunctionCallOut(id=_id("fc"), call_id=_id("call"), name=name, arguments="",
                                       status="in_progress", namespace=self._namespaces.get(name))
        self._output.append(self._call)
        return events + self._emit(o.ItemAdded, output_index=len(self._output) - 1, item=self._call)

    def _arguments(self, piece: str) -> list[bytes]:
        assert self._call is not None
        self._call.arguments += piece
        return self._emit(o.ArgumentsDelta, item_id=self._call.id, output_index=len(self._output) - 1,
                          delta=piece)

    def _end_call(self, call: ParsedCall) -> list[bytes]:
        """A call closed; its arguments are the parser's whole text (their pieces join into it)."""
        events = [] if self._call is not None else self._start_call(call.name) + self._arguments(call.arguments)
        item, self._call = self._call, None
        assert item is not None
        item.arguments, item.status = call.arguments, "completed"
        index = len(self._output) - 1
        return events + (self._emit(o.ArgumentsDone, item_id=item.id, output_index=index, arguments=item.arguments)
                         + self._emit(o.ItemDone, output_index=index, item=item))

    def _emit(self, kind: type[o.Event], **fields) -> list[bytes]:
        """The event, encoded now: later changes to the items it carries are not in it."""
        if not self._streaming:
            return []
        event = kind(sequence_number=self._sequence, **fields)
        self._sequence += 1
        return [sse.typed_event(kind.__struct_config__.tag, event)]


def _feed(builder: ResponseBuilder, parser: ReplyParser, chunk: Chunk) -> list[bytes]:
    pieces = parser.feed(chunk.text, chunk.token_ids)
    if chunk.finish_reason is not None:
        pieces += parser.flush()
    events = [e for piece in pieces for e in builder.feed(piece)]
    if chunk.finish_reason is not None:
        events += builder.finish(chunk)
    return events


def _counter(tokenizer: ChatTokenizer) -> Callable[[str], int]:
    # The reasoning's tokens, encoded again: a chunk's ids are not split where </think> falls.
    return lambda text: len(tokenizer.tokenizer.encode(text, add_special_tokens=False).ids) if text else 0


async def whole(session: Session, frame: o.ResponseObject, reply: ReplyFormat,
                tokenizer: ChatTokenizer) -> o.ResponseObject:
    builder = ResponseBuilder(frame, streaming=False, count_tokens=_counter(tokenizer))
    parser = reply.parser(reasoning=True, stream_arguments=True)
    async for chunk in session.chunks():
        _feed(builder, parser, chunk)
    return builder.response


async def stream(session: Session, frame: o.ResponseObject, reply: ReplyFormat,
                 tokenizer: ChatTokenizer) -> AsyncIterator[bytes]:
    """The events; an error after the stream started is its ``response.failed``."""
    builder = ResponseBuilder(frame, streaming=True, count_tokens=_counter(tokenizer))
    parser = reply.parser(reasoning=True, stream_arguments=True)
    async for e in stream_events(session, builder.start(), lambda chunk: _feed(builder, parser, chunk),
                                 builder.fail):
        yield e
