"""``/v1/responses`` replies, whole or as the typed event stream. Both are built by one
``ResponseBuilder`` from the same text pieces and parsed calls, so a whole reply is exactly the
``response.completed`` of the same stream.

    response.created, response.in_progress
    per message:  output_item.added, content_part.added, output_text.delta..., output_text.done,
                  content_part.done, output_item.done
    per call:     output_item.added, function_call_arguments.delta, .done, output_item.done
    response.completed | response.incomplete (max_output_tokens) | response.failed
"""

from __future__ import annotations

import uuid
from typing import AsyncIterator

import msgspec

from frontend.api.replies import Chunk
from frontend.http import responses_objects as o
from frontend.http import sse
from frontend.http.errors import ApiError
from frontend.http.session import Session
from frontend.http.tool_calls import ParsedCall, ToolCallStream


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class ResponseBuilder:
    """The output items of one response, and (when streaming) the events that build them.

    Whitespace between text and a call's markup is markup: trailing whitespace is held until
    more text follows, and dropped when a call does."""

    def __init__(self, frame: o.ResponseObject, streaming: bool) -> None:
        self.response = frame
        self._streaming = streaming
        self._sequence = 0
        self._output: list[o.OutputItem] = []
        self._message: o.MessageOut | None = None  # the open message, text still arriving
        self._space = ""
        self._namespaces = {f.get("name"): t["name"] for t in frame.tools if t.get("type") == "namespace"
                            for f in t.get("tools", [])}

    def start(self) -> list[bytes]:
        return self._emit(o.Created, response=self.response) + self._emit(o.InProgress, response=self.response)

    def text(self, piece: str) -> list[bytes]:
        body = piece.rstrip()
        if not body:
            self._space += piece
            return []
        delta, self._space = self._space + body, piece[len(body):]
        events = self._open_message() if self._message is None else []
        return events + self._append(delta)

    def call(self, call: ParsedCall) -> list[bytes]:
        self._space = ""
        events = self._close_message("completed")
        item = o.FunctionCallOut(id=_id("fc"), call_id=_id("call"), name=call.name, arguments="",
                                 status="in_progress", namespace=self._namespaces.get(call.name))
        index = len(self._output)
        events += self._emit(o.ItemAdded, output_index=index, item=item)
        item.arguments, item.status = call.arguments, "completed"
        self._output.append(item)
        events += self._emit(o.ArgumentsDelta, item_id=item.id, output_index=index, delta=call.arguments)
        events += self._emit(o.ArgumentsDone, item_id=item.id, output_index=index, arguments=call.arguments)
        return events + self._emit(o.ItemDone, output_index=index, item=item)

    def finish(self, chunk: Chunk) -> list[bytes]:
        """The last chunk: close the output and report the whole response with its usage."""
        assert chunk.usage is not None
        cut = chunk.finish_reason == "length"
        events: list[bytes] = []
        if not self._output and self._message is None:  # nothing but whitespace: still a message
            events += self._open_message()
        if self._message is not None and self._space:
            events += self._append(self._space)
        events += self._close_message("incomplete" if cut else "completed")
        self.response = msgspec.structs.replace(
            self.response, output=self._output, usage=o.usage(chunk.usage),
            status="incomplete" if cut else "completed",
            incomplete_details=o.IncompleteDetails(reason="max_output_tokens") if cut else None)
        if chunk.finish_reason == "abort":  # the scheduler gave it up (shutting down, a failure)
            return events + self.fail(ApiError(503, "the request was aborted before it finished"))
        return events + self._emit(o.Incomplete if cut else o.Completed, response=self.response)

    def fail(self, exc: ApiError) -> list[bytes]:
        self.response = msgspec.structs.replace(
            self.response, status="failed", error=o.ErrorInfo(code=exc.code or exc.type, message=str(exc)))
        return self._emit(o.Failed, response=self.response)

    def _open_message(self) -> list[bytes]:
        self._message = message = o.MessageOut(id=_id("msg"), status="in_progress", content=[])
        index = len(self._output)
        self._output.append(message)
        events = self._emit(o.ItemAdded, output_index=index, item=message)
        message.content.append(o.OutputText(text=""))
        return events + self._emit(o.PartAdded, item_id=message.id, output_index=index,
                                   part=message.content[0])

    def _append(self, delta: str) -> list[bytes]:
        assert self._message is not None
        self._message.content[0].text += delta
        return self._emit(o.TextDelta, item_id=self._message.id, output_index=len(self._output) - 1,
                          delta=delta)

    def _close_message(self, status: o.ItemStatus) -> list[bytes]:
        message, self._message = self._message, None
        if message is None:
            return []
        message.status = status
        index, part = self._output.index(message), message.content[0]
        return (self._emit(o.TextDone, item_id=message.id, output_index=index, text=part.text)
                + self._emit(o.PartDone, item_id=message.id, output_index=index, part=part)
                + self._emit(o.ItemDone, output_index=index, item=message))

    def _emit(self, kind: type[o.Event], **fields) -> list[bytes]:
        """The event, encoded now: later changes to the items it carries are not in it."""
        if not self._streaming:
            return []
        event = kind(sequence_number=self._sequence, **fields)
        self._sequence += 1
        return [sse.typed_event(kind.__struct_config__.tag, event)]


def _feed(builder: ResponseBuilder, parser: ToolCallStream | None, chunk: Chunk) -> list[bytes]:
    pieces = [chunk.text] if parser is None else parser.feed(chunk.text)
    if parser is not None and chunk.finish_reason is not None:
        pieces += parser.flush()
    events = []
    for piece in pieces:
        events += builder.text(piece) if isinstance(piece, str) else builder.call(piece)
    if chunk.finish_reason is not None:
        events += builder.finish(chunk)
    return events


async def whole(session: Session, frame: o.ResponseObject, tools: bool) -> o.ResponseObject:
    builder, parser = ResponseBuilder(frame, streaming=False), ToolCallStream() if tools else None
    async for chunk in session.chunks():
        _feed(builder, parser, chunk)
    return builder.response


async def stream(session: Session, frame: o.ResponseObject, tools: bool) -> AsyncIterator[bytes]:
    """The events; an error after the stream started is its ``response.failed``."""
    builder, parser = ResponseBuilder(frame, streaming=True), ToolCallStream() if tools else None
    for e in builder.start():
        yield e
    try:
        async for chunk in session.chunks():
            for e in _feed(builder, parser, chunk):
                yield e
    except ApiError as exc:
        for e in builder.fail(exc):
            yield e
