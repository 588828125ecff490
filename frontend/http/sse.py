"""Server-sent events as OpenAI streams them: one ``data: {json}`` event per chunk, then
``data: [DONE]``. An error after the response started is an event with the error object."""

from __future__ import annotations

from typing import Any, AsyncIterator

import msgspec
from starlette.responses import StreamingResponse

from frontend.http.errors import ApiError

DONE = b"data: [DONE]\n\n"
_encoder = msgspec.json.Encoder()


def event(body: Any) -> bytes:
    return b"data: " + _encoder.encode(body) + b"\n\n"


async def _guarded(events: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    try:
        async for e in events:
            yield e
    except ApiError as exc:  # the status line is sent already: the error travels as an event
        yield event(exc.body())
    yield DONE


def response(events: AsyncIterator[bytes]) -> StreamingResponse:
    return StreamingResponse(_guarded(events), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
