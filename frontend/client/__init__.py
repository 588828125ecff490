"""Client library: ``Client`` (blocking, one request at a time) and ``AsyncClient`` (asyncio,
many concurrent requests on one socket). Both use a DEALER socket and time out every wait.

``python -m frontend.client --prompt TEXT`` prints a completion; ``--chat`` is an interactive chat.
"""

from __future__ import annotations

import asyncio
import os
import time
import uuid
from dataclasses import dataclass
from typing import AsyncIterator, Iterable, Iterator, Mapping, Sequence

import msgspec
import zmq
import zmq.asyncio

from frontend.api import ProtocolError, replies, requests
from frontend.api.replies import Chunk, Usage

DEFAULT_ENDPOINT = "tcp://127.0.0.1:5557"
DEFAULT_TIMEOUT_S = 120.0
# The first request of a client waits at most this long for the server to answer at all (an Info
# reply comes from the frontend at once, however busy the scheduler is) before its own timeout.
FIRST_CONTACT_S = 5.0
API_KEY_ENV = "SLUICE_API_KEY"


class NoServer(TimeoutError):
    """Nothing answered at the endpoint."""

    def __init__(self, endpoint: str, waited_s: float) -> None:
        super().__init__(
            f"no Sluice server answers at {endpoint} (waited {waited_s:g} s); is it running "
            "(scripts/serve.sh), and is the endpoint right?"
        )


def _keyed(message: requests.ClientRequest, api_key: str | None) -> bytes:
    """The frame for ``message``, carrying the api key when there is one."""
    if api_key is not None:
        message = msgspec.structs.replace(message, api_key=api_key)
    return requests.encode(message)


class ServerError(RuntimeError):
    def __init__(self, error: replies.Error) -> None:
        super().__init__(f"{error.code}: {error.message}")
        self.code = error.code
        self.rid = error.rid


@dataclass(frozen=True)
class Completion:
    text: str
    token_ids: list[int]
    finish_reason: str
    usage: Usage | None


def collect(chunks: Iterable[Chunk]) -> Completion:
    """A Completion from a request's chunks (a stream's, or the single non-streaming one)."""
    text, ids, last = [], [], None
    for last in chunks:
        text.append(last.text)
        ids.extend(last.token_ids)
    if last is None or last.finish_reason is None:
        raise ValueError("the chunks do not include the last one of the request")
    return Completion("".join(text), ids, last.finish_reason, last.usage)


def build_generate(
    *,
    rid: str | None = None,
    prompt: str | None = None,
    messages: Sequence[Mapping[str, str]] | None = None,
    input_ids: Sequence[int] | None = None,
    max_tokens: int = 256,
    temperature: float | None = None,  # None: the model's default (see replies.Info)
    top_p: float | None = None,
    top_k: int | None = None,
    seed: int | None = None,
    stop: Sequence[str] = (),
    ignore_eos: bool = False,
    stream: bool = False,
    grammar: requests.Grammar | None = None,  # constrained decoding (llguidance's Lark; frontend.http.grammars)
) -> requests.Generate:
    chat = None
    if messages is not None:
        chat = [requests.ChatMessage(role=m["role"], content=m["content"]) for m in messages]
    return requests.Generate(
        rid=rid or uuid.uuid4().hex,
        prompt=prompt,
        messages=chat,
        input_ids=list(input_ids) if input_ids is not None else None,
        max_tokens=max_tokens,
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        seed=seed,
        stop=list(stop),
        ignore_eos=ignore_eos,
        stream=stream,
        grammar=grammar,
    )


def _dealer(ctx: zmq.Context, endpoint: str) -> zmq.Socket:
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    return sock


class _Connection:
    """What both clients hold: the endpoint, the waits, the api key, a DEALER socket."""

    _context_type: type[zmq.Context] = zmq.Context

    def __init__(
        self,
        endpoint: str = DEFAULT_ENDPOINT,
        timeout: float = DEFAULT_TIMEOUT_S,
        api_key: str | None = None,  # default: $SLUICE_API_KEY
        first_contact: float = FIRST_CONTACT_S,
    ) -> None:
        self.timeout = timeout
        self.endpoint = endpoint
        self.first_contact = first_contact
        self.api_key = api_key if api_key is not None else os.environ.get(API_KEY_ENV)
        self._ctx = self._context_type()
        self._sock = _dealer(self._ctx, endpoint)


class Client(_Connection):
    """Blocking client. ``timeout`` bounds each wait for a reply (each chunk, when streaming)."""

    _info: replies.Info | None = None  # asked once

    def info(self) -> replies.Info:
        """The served model (asked once); raises NoServer when nothing answers soon."""
        if self._info is None:
            rid = uuid.uuid4().hex
            self._send(requests.GetInfo(rid=rid))
            wait = min(self.timeout, self.first_contact)
            try:
                self._info = self._next(rid, wait)
            except TimeoutError:
                raise NoServer(self.endpoint, wait) from None
        return self._info

    def generate(self, *, timeout: float | None = None, **params) -> Completion:
        """Keyword arguments as ``build_generate``; raises ServerError or TimeoutError."""
        self.info()
        request = build_generate(**params, stream=False)
        self._send(request)
        try:
            return collect([self._next(request.rid, timeout)])
        except TimeoutError:
            self.abort(request.rid)
            raise

    def stream(self, *, timeout: float | None = None, **params) -> Stream:
        self.info()
        request = build_generate(**params, stream=True)
        self._send(request)
        return Stream(self, request.rid, timeout)

    def stats(self, timeout: float | None = None) -> dict:
        self.info()
        rid = uuid.uuid4().hex
        self._send(requests.GetStats(rid=rid))
        return dict(self._next(rid, timeout).stats)

    def abort(self, rid: str) -> None:
        self._send(requests.Abort(rid=rid))

    def close(self) -> None:
        self._sock.close(linger=0)
        self._ctx.term()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _send(self, message: requests.ClientRequest) -> None:
        self._sock.send(_keyed(message, self.api_key))

    def _next(self, rid: str, timeout: float | None) -> Chunk | replies.Stats | replies.Info:
        """The next reply for ``rid``; replies to earlier, abandoned requests are skipped."""
        deadline = time.monotonic() + (self.timeout if timeout is None else timeout)
        while True:
            left_ms = int(1000 * (deadline - time.monotonic()))
            if left_ms <= 0 or not self._sock.poll(left_ms):
                raise TimeoutError(f"no reply for request {rid} from the server in time")
            try:
                reply = replies.decode(self._sock.recv())
            except ProtocolError:
                continue
            if isinstance(reply, replies.Error) and reply.rid in (rid, None):
                raise ServerError(reply)
            if isinstance(reply, (Chunk, replies.Stats, replies.Info)) and reply.rid == rid:
                return reply


class Stream:
    """The chunks of one streaming request. Closing it (or leaving a ``with`` block) before the
    last chunk aborts the request."""

    def __init__(self, client: Client, rid: str, timeout: float | None) -> None:
        self.rid = rid
        self._client = client
        self._timeout = timeout
        self._done = False

    def __iter__(self) -> Iterator[Chunk]:
        return self

    def __next__(self) -> Chunk:
        if self._done:
            raise StopIteration
        try:
            chunk = self._client._next(self.rid, self._timeout)
        except ServerError:
            self._done = True  # the server has dropped the request already
            raise
        except BaseException:
            self.close()
            raise
        self._done = chunk.finish_reason is not None
        return chunk

    def close(self) -> None:
        if not self._done:
            self._done = True
            self._client.abort(self.rid)

    def __enter__(self) -> Stream:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class AsyncClient(_Connection):
    """asyncio client (arguments as ``Client``); concurrent requests share one socket, a reader
    task routes replies."""

    _context_type = zmq.asyncio.Context
    _info: asyncio.Task | None = None  # asks once
    _reader: asyncio.Task | None = None  # started by the first request

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._queues: dict[str, asyncio.Queue] = {}

    async def info(self) -> replies.Info:
        """The served model (asked once); raises NoServer when nothing answers soon."""
        if self._info is None:
            self._info = asyncio.create_task(self._ask_info())
        return await asyncio.shield(self._info)

    async def _ask_info(self) -> replies.Info:
        request = requests.GetInfo(rid=uuid.uuid4().hex)
        wait = min(self.timeout, self.first_contact)
        async with _Pending(self, request):
            try:
                return await self._next(request.rid, wait)
            except TimeoutError:
                raise NoServer(self.endpoint, wait) from None

    async def generate(self, *, timeout: float | None = None, **params) -> Completion:
        request = build_generate(**params, stream=False)
        async with self._request(request):
            return collect([await self._next(request.rid, timeout)])

    async def stream(self, *, timeout: float | None = None, **params) -> AsyncIterator[Chunk]:
        """Async generator of chunks; leaving it early aborts the request."""
        request = build_generate(**params, stream=True)
        async with self._request(request):
            while True:
                chunk = await self._next(request.rid, timeout)
                yield chunk
                if chunk.finish_reason is not None:
                    return

    async def stats(self, timeout: float | None = None) -> dict:
        request = requests.GetStats(rid=uuid.uuid4().hex)
        async with self._request(request):
            return dict((await self._next(request.rid, timeout)).stats)

    async def abort(self, rid: str) -> None:
        await self._sock.send(_keyed(requests.Abort(rid=rid), self.api_key))

    async def close(self) -> None:
        if self._info is not None and not self._info.done():
            self._info.cancel()
        if self._reader is not None:
            self._reader.cancel()
            await asyncio.gather(self._reader, return_exceptions=True)
        self._sock.close(linger=0)
        self._ctx.term()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    def _request(self, request: requests.ClientRequest) -> _Pending:
        return _Pending(self, request)

    async def _next(self, rid: str, timeout: float | None) -> Chunk | replies.Stats | replies.Info:
        try:
            reply = await asyncio.wait_for(
                self._queues[rid].get(), self.timeout if timeout is None else timeout
            )
        except asyncio.TimeoutError:
            raise TimeoutError(f"no reply for request {rid} from the server in time") from None
        if isinstance(reply, replies.Error):
            raise ServerError(reply)
        return reply

    async def _read_loop(self) -> None:
        while True:
            try:
                reply = replies.decode(await self._sock.recv())
            except ProtocolError:
                continue
            if isinstance(reply, replies.Pending):
                continue
            queue = self._queues.get(reply.rid) if reply.rid is not None else None
            if queue is not None:
                queue.put_nowait(reply)


class _Pending:
    """Registers a request's reply queue, sends it, and on exit forgets it (aborting a generation
    that did not finish)."""

    def __init__(self, client: AsyncClient, request: requests.ClientRequest) -> None:
        self._client = client
        self._request = request

    async def __aenter__(self) -> _Pending:
        client = self._client
        if client._reader is None:
            client._reader = asyncio.create_task(client._read_loop())
        if not isinstance(self._request, requests.GetInfo):
            await client.info()
        self._client._queues[self._request.rid] = asyncio.Queue()
        await self._client._sock.send(_keyed(self._request, self._client.api_key))
        return self

    async def __aexit__(self, exc_type, exc, tb) -> None:
        self._client._queues.pop(self._request.rid, None)
        if exc_type is not None and isinstance(self._request, requests.Generate):
            if not isinstance(exc, ServerError):
                await self._client.abort(self._request.rid)
