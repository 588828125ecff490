"""``/v1/messages`` replies, whole or as the event stream. Both are built by one ``MessageBuilder``
from the same text pieces and parsed calls, so a whole reply is exactly what the stream assembles.

    message_start, ping
    the thinking block, with thinking on:  content_block_start, content_block_delta (thinking_delta)...
        (none with display "omitted"), content_block_delta (signature_delta), content_block_stop
    per text block:  content_block_start, content_block_delta (text_delta)..., content_block_stop
    per tool use:    content_block_start, content_block_delta (input_json_delta), content_block_stop
    message_delta (stop_reason, usage), message_stop  |  error
    ping whenever the stream has been idle a while (sse.keepalive): a long prefill keeps it open
"""

from __future__ import annotations

import hashlib
import json
import uuid
from typing import AsyncIterator

import msgspec

from frontend.api.replies import Chunk
from frontend.http import messages_objects as o
from frontend.http import sse
from frontend.http.errors import ApiError
from frontend.http.session import Session, stream_events
from frontend.http.parsers import Reasoning, ReplyFormat, ReplyParser
from frontend.http.tool_calls import CLOSE, OPEN, ParsedCall

PING = sse.typed_event("ping", o.Ping())


def new_message(model: str, prompt_tokens: int) -> o.MessageOut:
    """The message before any content; its usage counts the whole prompt as input until the
    last chunk tells how much of it the cache held."""
    return o.MessageOut(id=f"msg_{uuid.uuid4().hex[:24]}", model=model, content=[],
                        usage=o.Usage(input_tokens=prompt_tokens, output_tokens=0))


class MessageBuilder:
    """The content blocks of one message, and (when streaming) the events that build them.

    Whitespace between text and a call's markup is markup: trailing whitespace is held until
    more text follows, and dropped when a call does. ``thinking``: how reasoning shows (its pieces
    come only with thinking on): "summarized" in full, "omitted" as a block with no text."""

    def __init__(self, message: o.MessageOut, streaming: bool, thinking: str | None = None) -> None:
        self.message = message
        self._streaming = streaming
        self._thinking = thinking
        self._open: o.TextOut | o.ThinkingOut | None = None  # the open text or thinking block
        self._thought = ""  # the open thinking block's text, shown or not: what its signature digests
        self._space = ""
        self._calls = 0

    def start(self) -> list[bytes]:
        return self._emit(o.MessageStart(message=self.message)) + [PING]

    def text(self, piece: str) -> list[bytes]:
        body = piece.rstrip()
        if not body:
            self._space += piece
            return []
        delta, self._space = self._space + body, piece[len(body):]
        return self._append(delta)

    def reasoning(self, piece: str) -> list[bytes]:
        events: list[bytes] = []
        if not isinstance(self._open, o.ThinkingOut):
            self._space = ""
            events = self._close() + self._start_block(o.ThinkingOut(thinking="", signature=""))
        self._thought += piece
        if self._thinking == "omitted":
            return events
        self._open.thinking += piece
        return events + self._emit(o.BlockDelta(index=self._index, delta=o.ThinkingDelta(thinking=piece)))

    def call(self, call: ParsedCall) -> list[bytes]:
        arguments = _json(call.arguments)
        if not isinstance(arguments, dict):  # a tool use's input is an object: else the text is kept
            return self.text(OPEN + json.dumps({"name": call.name, "arguments": arguments},
                                               ensure_ascii=False) + CLOSE)
        self._space = ""
        self._calls += 1
        block = o.ToolUseOut(id=f"toolu_{uuid.uuid4().hex[:24]}", name=call.name, input={})
        events = self._close() + self._start_block(block)
        block.input = arguments
        events += self._emit(o.BlockDelta(index=self._index, delta=o.InputJsonDelta(partial_json=call.arguments)))
        return events + self._emit(o.BlockStop(index=self._index))

    def finish(self, chunk: Chunk) -> list[bytes]:
        """The last chunk: close the content and report why it ended, with the usage."""
        assert chunk.usage is not None
        if chunk.finish_reason == "abort":  # the server gave it up (shutting down, a failure)
            raise ApiError(503, "the request was aborted before it finished")
        events: list[bytes] = []
        if self._space and (isinstance(self._open, o.TextOut) or not self.message.content):
            events, self._space = self._append(self._space), ""  # nothing but whitespace: kept
        events += self._close()
        reason, sequence = _stop_reason(chunk, self._calls)
        self.message = msgspec.structs.replace(self.message, stop_reason=reason, stop_sequence=sequence,
                                               usage=o.usage(chunk.usage))
        delta = o.MessageDelta(delta=o.StopDelta(stop_reason=reason, stop_sequence=sequence),
                               usage=self.message.usage)
        return events + self._emit(delta) + self._emit(o.MessageStop())

    def _append(self, delta: str) -> list[bytes]:
        events: list[bytes] = []
        if not isinstance(self._open, o.TextOut):
            events = self._close() + self._start_block(o.TextOut(text=""))
        self._open.text += delta
        return events + self._emit(o.BlockDelta(index=self._index, delta=o.TextDelta(text=delta)))

    def _start_block(self, block: o.Block) -> list[bytes]:
        self.message.content.append(block)
        self._open = block if isinstance(block, (o.TextOut, o.ThinkingOut)) else None
        return self._emit(o.BlockStart(index=self._index, content_block=block))

    def _close(self) -> list[bytes]:
        """The last block's stop, a thinking block's signature before it; nothing if none is open."""
        block, self._open = self._open, None
        if block is None:
            return []
        events: list[bytes] = []
        if isinstance(block, o.ThinkingOut):
            block.signature, self._thought = hashlib.sha256(self._thought.encode()).hexdigest(), ""
            events = self._emit(o.BlockDelta(index=self._index, delta=o.SignatureDelta(signature=block.signature)))
        return events + self._emit(o.BlockStop(index=self._index))

    @property
    def _index(self) -> int:
        return len(self.message.content) - 1

    def _emit(self, event: o.Event) -> list[bytes]:
        """The event, encoded now: later changes to the blocks it carries are not in it."""
        if not self._streaming:
            return []
        return [sse.typed_event(event.__struct_config__.tag, event)]


def _json(arguments: str) -> object:
    try:
        return json.loads(arguments)
    except ValueError:
        return arguments


def _stop_reason(chunk: Chunk, calls: int) -> tuple[o.StopReason, str | None]:
    if chunk.finish_reason == "length":
        return "max_tokens", None
    if chunk.matched_stop is not None:
        return "stop_sequence", chunk.matched_stop
    return ("tool_use" if calls else "end_turn"), None


def _feed(builder: MessageBuilder, parser: ReplyParser, chunk: Chunk) -> list[bytes]:
    pieces = parser.feed(chunk.text, chunk.token_ids)
    if chunk.finish_reason is not None:
        pieces += parser.flush()
    events = []
    for piece in pieces:
        if isinstance(piece, Reasoning):
            events += builder.reasoning(piece.text)
        else:
            events += builder.text(piece) if isinstance(piece, str) else builder.call(piece)
    if chunk.finish_reason is not None:
        events += builder.finish(chunk)
    return events


async def whole(session: Session, message: o.MessageOut, reply: ReplyFormat,
                thinking: str | None = None) -> o.MessageOut:
    builder, parser = MessageBuilder(message, False, thinking), reply.parser(reasoning=thinking is not None)
    async for chunk in session.chunks():
        _feed(builder, parser, chunk)
    return builder.message


async def stream(session: Session, message: o.MessageOut, reply: ReplyFormat,
                 thinking: str | None = None) -> AsyncIterator[bytes]:
    """The events (calls in the template's markup; reasoning as thinking blocks with thinking on,
    else left out); an error after the stream started is its ``error`` event."""
    builder, parser = MessageBuilder(message, True, thinking), reply.parser(reasoning=thinking is not None)
    async for e in stream_events(session, builder.start(), lambda chunk: _feed(builder, parser, chunk),
                                 lambda exc: [sse.typed_event("error", o.error(exc))]):
        yield e
