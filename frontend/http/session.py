"""One HTTP request as a local client of the ``Frontend``: submit, read the replies, and on the
way out (finished, failed, or the HTTP client gone) close, which aborts whatever still runs."""

from __future__ import annotations

from typing import AsyncIterator, Callable, Iterable

from frontend.api import replies, requests
from frontend.http.errors import ApiError, from_reply
from frontend.server import Frontend


class Session:
    def __init__(self, frontend: Frontend) -> None:
        self._frontend = frontend
        self._identity, self._queue = frontend.open_local()
        self._early: replies.ServerReply | None = None  # read by ``start``, not yet consumed

    async def start(self, request: requests.Generate | requests.GetStats) -> None:
        """Submit; a request that validation refuses raises its ApiError here, before any
        response has started (the Frontend answers a refused request at once)."""
        await self._frontend.submit(self._identity, request)
        if not self._queue.empty():
            self._early = self._queue.get_nowait()
            if isinstance(self._early, replies.Error):
                self.close()
                raise from_reply(self._early)

    async def _next(self) -> replies.ServerReply:
        if self._early is not None:
            reply, self._early = self._early, None
            return reply
        return await self._queue.get()

    async def chunks(self) -> AsyncIterator[replies.Chunk]:
        """The request's chunks up to the last one; an Error reply raises its ApiError."""
        while True:
            reply = await self._next()
            if isinstance(reply, replies.Error):
                raise from_reply(reply)
            if isinstance(reply, replies.Chunk):
                yield reply
                if reply.finish_reason is not None:
                    return

    async def stats(self) -> dict:
        while True:
            reply = await self._next()
            if isinstance(reply, replies.Error):
                raise from_reply(reply)
            if isinstance(reply, replies.Stats):
                return dict(reply.stats)

    def close(self) -> None:
        self._frontend.close_local(self._identity)

    async def __aenter__(self) -> Session:
        return self

    async def __aexit__(self, *exc) -> None:
        self.close()


async def stream_events(session: Session, start: Iterable[bytes], feed: Callable[[replies.Chunk], Iterable[bytes]],
                        fail: Callable[[ApiError], Iterable[bytes]]) -> AsyncIterator[bytes]:
    """A stream's events: ``start``, then ``feed``'s for each of ``session``'s chunks; an error after
    the stream started ends it with ``fail``'s (its API's error event)."""
    for e in start:
        yield e
    try:
        async for chunk in session.chunks():
            for e in feed(chunk):
                yield e
    except ApiError as exc:
        for e in fail(exc):
            yield e
