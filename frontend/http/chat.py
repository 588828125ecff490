"""``/v1/chat/completions`` replies, whole or streamed, with tool calls parsed out of the text."""

from __future__ import annotations

from typing import AsyncIterator

from frontend.api.replies import Chunk
from frontend.http import responses as r
from frontend.http import sse
from frontend.http.session import Session
from frontend.http.tool_calls import ParsedCall, ToolCallStream, parse_tool_calls

OBJECT, CHUNK_OBJECT = "chat.completion", "chat.completion.chunk"


def finish_reason(reason: str, calls: int) -> str:
    """A reply that ends (EOS or stop string) after tool calls finishes with "tool_calls"."""
    return "tool_calls" if calls and reason == "stop" else reason


async def whole(session: Session, ids: r.ResponseIds, tools: bool) -> r.Completion:
    last: Chunk | None = None
    async for last in session.chunks():
        pass
    assert last is not None and last.usage is not None
    content, calls = parse_tool_calls(last.text) if tools else (last.text, [])
    message = r.AssistantMessage(content=content,
                                 tool_calls=[r.tool_call(c) for c in calls] or None)
    choice = r.ChatChoice(message=message, finish_reason=finish_reason(last.finish_reason, len(calls)))
    return ids.body(OBJECT, [choice], r.usage(last.usage))


async def stream(session: Session, ids: r.ResponseIds, tools: bool,
                 include_usage: bool) -> AsyncIterator[bytes]:
    yield _delta(ids, r.Delta(role="assistant", content=""))
    parser = ToolCallStream() if tools else None
    async for chunk in session.chunks():
        events = [chunk.text] if parser is None else parser.feed(chunk.text)
        if parser is not None and chunk.finish_reason is not None:
            events += parser.flush()
        for e in events:
            if e:
                yield _delta(ids, _event_delta(e, parser.calls - 1 if parser else 0))
        if chunk.finish_reason is not None:
            reason = finish_reason(chunk.finish_reason, parser.calls if parser else 0)
            yield _delta(ids, r.Delta(), reason)
            if include_usage and chunk.usage is not None:
                yield sse.event(ids.body(CHUNK_OBJECT, [], r.usage(chunk.usage)))


def _event_delta(e: str | ParsedCall, index: int) -> r.Delta:
    if isinstance(e, str):
        return r.Delta(content=e)
    return r.Delta(tool_calls=[r.tool_call(e, index)])


def _delta(ids: r.ResponseIds, delta: r.Delta, reason: str | None = None) -> bytes:
    return sse.event(ids.body(CHUNK_OBJECT, [r.ChatChunkChoice(delta=delta, finish_reason=reason)]))
