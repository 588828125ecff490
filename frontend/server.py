"""The frontend's serving loop: clients <-> validation/tokenization <-> scheduler ipc.

Tasks on one asyncio loop: client frames in, scheduler frames in, a watchdog that notices a dead
or frozen scheduler (``liveness``), keep-alives to clients. Prompts are tokenized on worker
threads, so a long one never holds the loop. Live requests sit in a ``RequestTable``; replies go
out through the ``ClientLink``, to the ROUTER or to a local client's queue.

Local clients (the HTTP API in ``frontend.http``) speak the same ``requests`` structs through
``submit``; each has its own identity, so both front doors share one request table, one
validation and one scheduler link."""

from __future__ import annotations

import asyncio
import concurrent.futures
import hmac
import itertools
import logging
import time

import zmq.asyncio

from frontend import validate
from frontend.api import replies, requests
from frontend.api.replies import Chunk, Error, Usage
from frontend.client_link import ClientLink
from frontend.generation_defaults import SamplingDefaults
from frontend.launch import SchedulerProcess
from frontend.liveness import SchedulerLiveness
from frontend.request_state import RequestState
from frontend.request_table import RequestTable, Waiting
from frontend.scheduler_replies import RequestObserver, SchedulerReplies
from frontend.tokenizer import ChatTokenizer
from scheduler.messages import ProtocolError
from scheduler.messages.from_scheduler import ModelInfo
from scheduler.messages.to_scheduler import AbortRequest, StatsRequest

log = logging.getLogger("sluice.frontend")

TOKENIZER_THREADS = 2


class Frontend:
    def __init__(
        self,
        router: zmq.asyncio.Socket,
        scheduler: SchedulerProcess,
        tokenizer: ChatTokenizer,
        model: ModelInfo,
        heartbeat_timeout_s: float,
        stop: asyncio.Event,
        client_keepalive_s: float = 2.0,
        api_key: str | None = None,
        observer: RequestObserver | None = None,
        max_prompt_chars: int = validate.MAX_PROMPT_CHARS,
        sampling_defaults: SamplingDefaults = SamplingDefaults(),
    ) -> None:
        self._clients = ClientLink(router, self._drop_client)
        self._scheduler = scheduler
        self._liveness = SchedulerLiveness(scheduler, heartbeat_timeout_s)
        self._table = RequestTable()
        self._replies = SchedulerReplies(scheduler, self._liveness, self._table, self._clients,
                                         self._frontend_stats, observer)
        self._tokenizer = tokenizer
        self._model = model
        self._client_keepalive_s = client_keepalive_s
        self._stop = stop
        self._api_key = api_key
        self._max_prompt_chars = max_prompt_chars
        self._defaults = sampling_defaults
        self._pool = concurrent.futures.ThreadPoolExecutor(TOKENIZER_THREADS, "tokenize")
        self._admissions: set[asyncio.Task] = set()
        self._ids = itertools.count()
        self._requests_total = 0
        self.exit_code = 0

    async def serve(self) -> int:
        """Serve until ``stop`` is set (signal) or the scheduler dies; returns the exit code."""
        loops = [self._client_loop, self._replies.run, self._watchdog, self._keepalive]
        tasks = [asyncio.create_task(loop()) for loop in loops]
        for task in tasks:
            task.add_done_callback(self._on_task_done)
        await self._stop.wait()
        for task in [*tasks, *self._admissions]:
            task.cancel()
        await asyncio.gather(*tasks, *self._admissions, return_exceptions=True)
        self._pool.shutdown(wait=False, cancel_futures=True)
        # No-op after the watchdog's own errors: it has answered everyone already.
        await self._fail_all(replies.SHUTTING_DOWN, "the server is shutting down")
        return self.exit_code

    def _on_task_done(self, task: asyncio.Task) -> None:
        if task.cancelled() or task.exception() is None:
            return
        log.error("a frontend task failed; stopping", exc_info=task.exception())
        self.exit_code = 1
        self._stop.set()

    @property
    def model(self) -> ModelInfo:
        return self._model

    @property
    def tokenizer(self) -> ChatTokenizer:
        return self._tokenizer

    @property
    def max_prompt_chars(self) -> int:
        """``--max-prompt-chars``: the longest prompt text taken, checked before it is tokenized."""
        return self._max_prompt_chars

    # ==== local clients ====

    def open_local(self) -> tuple[bytes, asyncio.Queue[replies.ServerReply]]:
        """A new local client: its identity, and the queue its replies arrive on."""
        return self._clients.open_local()

    async def submit(self, identity: bytes, request: requests.ClientRequest) -> None:
        """A local client's request, handled as a ZMQ client's (authenticated by its caller)."""
        await self._dispatch([identity], request)

    def close_local(self, identity: bytes) -> None:
        """The local client is done or gone: abort whatever it still has running."""
        if self._clients.close_local(identity):
            self._abort_client(identity)

    # ==== clients ====

    async def _client_loop(self) -> None:
        while True:
            envelope, frames = await self._clients.recv()
            if len(frames) != 1:
                await self._error(envelope, None, replies.BAD_REQUEST,
                                  f"a message is one frame; got {len(frames)}")
                continue
            try:
                await self._on_client(envelope, frames[0])
            except Exception:
                log.exception("failed to handle a client message")
                await self._send(envelope, Error(rid=None, code=replies.INTERNAL, message="internal error"))

    async def _on_client(self, envelope: list[bytes], payload: bytes) -> None:
        try:
            request = requests.decode(payload)
        except ProtocolError as exc:
            await self._error(envelope, exc.rid, replies.BAD_REQUEST, str(exc))
            return
        if not self._authorized(request):
            rid = getattr(request, "rid", None)
            await self._error(envelope, rid, replies.UNAUTHORIZED, "missing or wrong api_key")
            return
        await self._dispatch(envelope, request)

    def _authorized(self, request: requests.ClientRequest) -> bool:
        if self._api_key is None:
            return True
        given = (request.api_key or "").encode()
        return hmac.compare_digest(given, self._api_key.encode())

    async def _dispatch(self, envelope: list[bytes], request: requests.ClientRequest) -> None:
        if isinstance(request, requests.Generate):
            await self._on_generate(envelope, request)
        elif isinstance(request, requests.Abort):
            await self._on_abort(envelope[0], request.rid)
        elif isinstance(request, requests.GetInfo):
            await self._send(envelope, self._info(request.rid))
        else:
            nonce = next(self._ids)
            self._table.stats_waiting[nonce] = Waiting(envelope, request.rid)
            self._scheduler.send(StatsRequest(nonce=nonce))

    async def _on_generate(self, envelope: list[bytes], request: requests.Generate) -> None:
        self._requests_total += 1
        if self._table.rid_of(envelope[0], request.rid) is not None:
            message = f"request {request.rid!r} is still running"
            await self._error(envelope, request.rid, replies.DUPLICATE_RID, message)
            return
        try:
            validate.check_request(request, self._model.vocab_size, self._max_prompt_chars,
                                   self._model.max_context_tokens)
        except validate.Rejected as exc:
            await self._error(envelope, request.rid, exc.code, str(exc))
            return
        rid = str(next(self._ids))
        self._table.add_tokenizing(rid, envelope, request.rid)
        task = asyncio.create_task(self._admit(envelope, request, rid, time.monotonic()))
        self._admissions.add(task)
        task.add_done_callback(self._admissions.discard)

    async def _admit(self, envelope: list[bytes], request: requests.Generate, rid: str,
                     received_s: float) -> None:
        """Tokenize on a worker thread, then hand the request to the scheduler unless it was
        aborted (or its client left) meanwhile."""
        loop = asyncio.get_running_loop()
        try:
            ids = await loop.run_in_executor(self._pool, validate.prompt_ids, request, self._tokenizer)
            message = validate.to_scheduler(request, rid, ids, self._model, self._defaults)
        except validate.Rejected as exc:
            await self._refuse_tokenizing(rid, exc.code, str(exc))
            return
        except Exception:
            log.exception("failed to tokenize request %s", request.rid)
            await self._refuse_tokenizing(rid, replies.INTERNAL, "internal error while tokenizing")
            return
        if not self._table.tokenized(rid):
            return  # aborted while it was tokenized
        state = RequestState(envelope=envelope, client_rid=request.rid, tokenizer=self._tokenizer,
                             prompt_ids=ids, stream=request.stream, stop=request.stop,
                             eos_token_ids=[] if request.ignore_eos else validate.end_ids(request, self._model))
        state.started_s = received_s  # latency metrics count the tokenization too
        self._table.start(rid, state)
        self._scheduler.send(message)

    async def _refuse_tokenizing(self, rid: str, code: str, message: str) -> None:
        waiting = self._table.drop_tokenizing(rid)
        if waiting is not None:  # not aborted meanwhile
            await self._error(waiting.envelope, waiting.client_rid, code, message)

    async def _on_abort(self, identity: bytes, client_rid: str) -> None:
        rid = self._table.rid_of(identity, client_rid)
        if rid is None:
            return  # finished already: aborting is idempotent
        waiting = self._table.drop_tokenizing(rid)
        if waiting is not None:  # it never reached the scheduler
            usage = Usage(prompt_tokens=0, completion_tokens=0, cached_prompt_tokens=0)
            await self._send(waiting.envelope, Chunk(rid=client_rid, finish_reason="abort", usage=usage))
            return
        state = self._table.forget(rid)
        self._scheduler.send(AbortRequest(rid=rid))
        await self._send(state.envelope, state.finish("abort"))

    def _drop_client(self, identity: bytes) -> None:
        """A send found the client gone: abort its requests, forget its stats requests."""
        log.info("client %s is gone; aborting its requests", identity.hex())
        self._abort_client(identity)

    def _abort_client(self, identity: bytes) -> None:
        for rid in self._table.remove_client(identity):
            self._scheduler.send(AbortRequest(rid=rid))

    async def _send(self, envelope: list[bytes], reply: replies.ServerReply) -> None:
        await self._clients.send(envelope, reply)

    async def _keepalive(self) -> None:
        """A Pending reply to every live request: the send to a client that left fails, which
        aborts its requests (ROUTER sockets tell nothing of a peer that disconnects)."""
        while True:
            await asyncio.sleep(self._client_keepalive_s)
            for rid, state in list(self._table.running.items()):
                if rid in self._table.running:  # not dropped with its client a moment ago
                    await self._send(state.envelope, replies.Pending(rid=state.client_rid))

    async def _error(self, envelope: list[bytes], rid: str | None, code: str, message: str) -> None:
        await self._clients.error(envelope, rid, code, message)

    def _info(self, rid: str) -> replies.Info:
        d = self._defaults
        return replies.Info(rid=rid, model=self._model.name, max_context_tokens=self._model.max_context_tokens,
                            chat_template=self._tokenizer.has_chat_template, default_temperature=d.temperature,
                            default_top_p=d.top_p, default_top_k=d.top_k)

    # ==== scheduler ====

    def _frontend_stats(self) -> dict:
        """The frontend's part of a Stats reply."""
        counts = {"requests_total": self._requests_total, **self._clients.counts}
        return {
            **{f"frontend_{k}": v for k, v in counts.items()},
            "frontend_active_requests": len(self._table.running),
            "frontend_clients": self._table.clients(),
            "scheduler_pid": self._scheduler.pid,
            "frontend_tokenizing": len(self._table.tokenizing),
            "frontend_prompt_tokens_reused": sum(k.reused_tokens for k in self._tokenizer.kept),
            "frontend_prompt_pieces_kept_tokens": sum(k.tokens for k in self._tokenizer.kept),
        }

    async def _watchdog(self) -> None:
        reason = await self._liveness.until_dead()
        log.error("%s", reason)
        await self._fail_all(replies.SCHEDULER_DIED, reason)
        self.exit_code = 1
        self._stop.set()

    async def _fail_all(self, code: str, message: str) -> None:
        """Answer every waiting request and stats request with an Error."""
        dropped = self._table.take_all()
        for envelope, client_rid in [*dropped.tokenizing, *dropped.stats]:
            await self._error(envelope, client_rid, code, message)
        for state in dropped.running:
            await self._error(state.envelope, state.client_rid, code, message)
