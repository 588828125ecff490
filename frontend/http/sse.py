"""Server-sent events as OpenAI streams them: one ``data: {json}`` event per chunk, then
``data: [DONE]``. An error after the response started is an event with the error object.
APIs with typed streams (Responses) name each event and end and fail in their own way
(``typed_event``, ``stream``); ``keepalive`` holds any stream open through a long prefill."""

from __future__ import annotations

import asyncio
from typing import Any, AsyncGenerator, AsyncIterator

import msgspec
from starlette.responses import StreamingResponse

from frontend.http.errors import ApiError

DONE = b"data: [DONE]\n\n"
COMMENT = b": keep-alive\n\n"  # clients skip comment lines
KEEPALIVE_S = 5.0
_encoder = msgspec.json.Encoder()


def event(body: Any) -> bytes:
    return b"data: " + _encoder.encode(body) + b"\n\n"


def typed_event(name: str, body: Any) -> bytes:
    return b"event: " + name.encode() + b"\n" + event(body)


async def keepalive(events: AsyncGenerator[bytes, None], every_s: float = KEEPALIVE_S,
                    tick: bytes = COMMENT) -> AsyncIterator[bytes]:
    """``events``, with ``tick`` sent whenever ``every_s`` passes without one, so that proxies and
    clients with idle timeouts do not drop a stream while a long prompt prefills."""
    pending = asyncio.ensure_future(events.__anext__())
    try:
        while True:
            done, _ = await asyncio.wait([pending], timeout=every_s)
            if not done:
                yield tick
                continue
            try:
                e = pending.result()
            except StopAsyncIteration:
                return
            yield e
            pending = asyncio.ensure_future(events.__anext__())
    finally:  # ended, or the client is gone: the inner stream's own cleanup runs either way
        pending.cancel()  # a read in progress ends by this cancellation
        if pending.done():
            await events.aclose()


async def _guarded(events: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    try:
        async for e in events:
            yield e
    except ApiError as exc:  # the status line is sent already: the error travels as an event
        yield event(exc.body())
    yield DONE


def response(events: AsyncIterator[bytes]) -> StreamingResponse:
    """An OpenAI chat or text completion stream: errors as events, then ``[DONE]``."""
    return stream(_guarded(events))


def stream(events: AsyncIterator[bytes]) -> StreamingResponse:
    """``events`` as they are: they end, and report errors, in their API's own way."""
    return StreamingResponse(events, media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
