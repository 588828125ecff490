"""The frontend's side of its clients: the ROUTER socket of ZMQ clients and the reply queues of
local clients (the HTTP API in ``frontend.http``), behind one ``send``.

A ROUTER tells nothing of a peer that disconnects. With ROUTER_MANDATORY, once the socket has
processed the disconnect, a send to that peer raises EHOSTUNREACH: that is how a vanished client is
found (``on_gone``), at the next chunk of a stream or the next keep-alive of a whole reply."""

from __future__ import annotations

import asyncio
import itertools
from typing import Callable, NamedTuple

import zmq
import zmq.asyncio

from frontend.api import replies

LOCAL = b"local:"  # the identity prefix of local clients; a ROUTER's own identities start with 0


class Incoming(NamedTuple):
    """A client's message: its routing frames and the frames after them (one, when well-formed)."""

    envelope: list[bytes]
    frames: list[bytes]


class ClientLink:
    def __init__(self, router: zmq.asyncio.Socket, on_gone: Callable[[bytes], None]) -> None:
        self._router = router
        self._on_gone = on_gone
        self._local: dict[bytes, asyncio.Queue[replies.ServerReply]] = {}
        self._ids = itertools.count()
        self.counts = {"errors_total": 0, "client_disconnects_total": 0}

    def open_local(self) -> tuple[bytes, asyncio.Queue[replies.ServerReply]]:
        """A new local client: its identity, and the queue its replies arrive on."""
        identity = LOCAL + b"%d" % next(self._ids)
        queue: asyncio.Queue[replies.ServerReply] = asyncio.Queue()
        self._local[identity] = queue
        return identity, queue

    def close_local(self, identity: bytes) -> bool:
        """Forget a local client; False when it was closed already."""
        return self._local.pop(identity, None) is not None

    async def recv(self) -> Incoming:
        frames = await self._router.recv_multipart()
        # [identity, payload] from a DEALER; a REQ client adds an empty delimiter frame.
        envelope = frames[:2] if len(frames) > 2 and frames[1] == b"" else frames[:1]
        return Incoming(envelope, frames[len(envelope):])

    async def send(self, envelope: list[bytes], reply: replies.ServerReply) -> None:
        queue = self._local.get(envelope[0])
        if queue is not None:
            queue.put_nowait(reply)
            return
        if envelope[0].startswith(LOCAL):
            return  # a local client that has closed: nobody to tell
        try:
            await self._router.send_multipart([*envelope, replies.encode(reply)])
        except zmq.ZMQError as exc:
            if exc.errno != zmq.EHOSTUNREACH:
                raise
            self.counts["client_disconnects_total"] += 1
            self._on_gone(envelope[0])

    async def error(self, envelope: list[bytes], rid: str | None, code: str, message: str) -> None:
        self.counts["errors_total"] += 1
        await self.send(envelope, replies.Error(rid=rid, code=code, message=message))
