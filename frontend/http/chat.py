"""``/v1/chat/completions`` replies, whole or streamed, with reasoning and tool calls parsed out of
the text by the request's ``ReplyFormat``: reasoning as ``reasoning_content``, a streamed call as
a first delta with its id and name and then its arguments, piece by piece."""

from __future__ import annotations

from typing import AsyncIterator

from frontend.api.replies import Chunk
from frontend.http import responses as r
from frontend.http import sse
from frontend.http.parsers import CallArguments, CallStart, Event, ReplyFormat, Reasoning
from frontend.http.session import Session

OBJECT, CHUNK_OBJECT = "chat.completion", "chat.completion.chunk"


def finish_reason(reason: str, calls: int) -> str:
    """A reply that ends (EOS or stop string) after tool calls finishes with "tool_calls"."""
    return "tool_calls" if calls and reason == "stop" else reason


async def whole(session: Session, ids: r.ResponseIds, reply: ReplyFormat) -> r.Completion:
    last: Chunk | None = None
    async for last in session.chunks():
        pass
    assert last is not None and last.usage is not None
    parsed = reply.whole(last.text, last.token_ids)
    message = r.AssistantMessage(content=parsed.content, reasoning_content=parsed.reasoning,
                                 tool_calls=[r.tool_call(c) for c in parsed.calls] or None)
    choice = r.ChatChoice(message=message, finish_reason=finish_reason(last.finish_reason, len(parsed.calls)))
    return ids.body(OBJECT, [choice], r.usage(last.usage))


async def stream(session: Session, ids: r.ResponseIds, reply: ReplyFormat,
                 include_usage: bool) -> AsyncIterator[bytes]:
    yield _delta(ids, r.Delta(role="assistant", content=""))
    parser = reply.parser(reasoning=True, stream_arguments=True)
    async for chunk in session.chunks():
        events = parser.feed(chunk.text, chunk.token_ids)
        if chunk.finish_reason is not None:
            events += parser.flush()
        for e in events:
            delta = _event_delta(e)
            if delta is not None:
                yield _delta(ids, delta)
        if chunk.finish_reason is not None:
            yield _delta(ids, r.Delta(), finish_reason(chunk.finish_reason, parser.calls))
            if include_usage and chunk.usage is not None:
                yield sse.event(ids.body(CHUNK_OBJECT, [], r.usage(chunk.usage)))


def _event_delta(e: Event) -> r.Delta | None:
    if isinstance(e, Reasoning):
        return r.Delta(reasoning_content=e.text)
    if isinstance(e, str):
        return r.Delta(content=e)
    if isinstance(e, CallStart):
        function = r.StreamedFunction(name=e.name, arguments="")
        return r.Delta(tool_calls=[r.StreamedToolCall(index=e.index, id=r.new_call_id(), type="function",
                                                      function=function)])
    if isinstance(e, CallArguments):
        function = r.StreamedFunction(arguments=e.text)
        return r.Delta(tool_calls=[r.StreamedToolCall(index=e.index, function=function)])
    return None  # a ParsedCall: its deltas went out already


def _delta(ids: r.ResponseIds, delta: r.Delta, reason: str | None = None) -> bytes:
    return sse.event(ids.body(CHUNK_OBJECT, [r.ChatChunkChoice(delta=delta, finish_reason=reason)]))
