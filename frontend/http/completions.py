"""``/v1/completions`` replies, whole or streamed."""

from __future__ import annotations

from typing import AsyncIterator

from frontend.api.replies import Chunk
from frontend.http import responses as r
from frontend.http import sse
from frontend.http.session import Session

OBJECT = "text_completion"


async def whole(session: Session, ids: r.ResponseIds) -> r.Completion:
    last: Chunk | None = None
    async for last in session.chunks():
        pass
    assert last is not None and last.usage is not None
    choice = r.TextChoice(text=last.text, finish_reason=last.finish_reason)
    return ids.body(OBJECT, [choice], r.usage(last.usage))


async def stream(session: Session, ids: r.ResponseIds, include_usage: bool) -> AsyncIterator[bytes]:
    async for chunk in session.chunks():
        if chunk.text or chunk.finish_reason is not None:
            choice = r.TextChoice(text=chunk.text, finish_reason=chunk.finish_reason)
            yield sse.event(ids.body(OBJECT, [choice]))
        if chunk.finish_reason is not None and include_usage and chunk.usage is not None:
            yield sse.event(ids.body(OBJECT, [], r.usage(chunk.usage)))
