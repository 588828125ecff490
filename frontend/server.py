"""The frontend's serving loop: client ROUTER <-> validation/tokenization <-> scheduler ipc.

Tasks on one asyncio loop: client frames in, scheduler frames in, a watchdog that notices a dead
or frozen scheduler, keep-alives to clients. Prompts are tokenized on worker threads, so a long one
never holds the loop. Requests are keyed twice: by the frontend's own ``rid`` (what the scheduler
sees) and by (client identity, client rid) (what a client may abort); a request being tokenized
holds its key already (an Abort or a duplicate sees it) but has no ``RequestState`` yet.

Local clients (the HTTP API in ``frontend.http``) speak the same ``requests`` structs through
``submit``; each has its own identity, and its replies go to an asyncio queue instead of the
ROUTER, so both front doors share one request table, one validation and one scheduler link."""

from __future__ import annotations

import asyncio
import concurrent.futures
import hmac
import itertools
import logging
import time
from typing import Protocol

import zmq
import zmq.asyncio

from frontend import validate
from frontend.api import replies, requests
from frontend.api.replies import Chunk, Error, Usage
from frontend.generation_defaults import SamplingDefaults
from frontend.launch import SchedulerProcess
from frontend.request_state import RequestState
from frontend.tokenizer import ChatTokenizer
from scheduler.messages import ProtocolError, from_scheduler
from scheduler.messages.from_scheduler import ModelInfo, TokenUpdate
from scheduler.messages.to_scheduler import AbortRequest, StatsRequest

log = logging.getLogger("sluice.frontend")

WATCHDOG_INTERVAL_S = 0.1
TOKENIZER_THREADS = 2


class RequestObserver(Protocol):
    """Told when tokens of a request arrive (latency metrics); times are ``time.monotonic()``."""

    def on_tokens(self, started_s: float, previous_s: float | None, now_s: float, count: int) -> None:
        ...


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
        self._router = router
        self._scheduler = scheduler
        self._tokenizer = tokenizer
        self._model = model
        self._heartbeat_timeout_s = heartbeat_timeout_s
        self._client_keepalive_s = client_keepalive_s
        self._stop = stop
        self._api_key = api_key
        self._observer = observer
        self._local: dict[bytes, asyncio.Queue[replies.ServerReply]] = {}
        self._max_prompt_chars = max_prompt_chars
        self._defaults = sampling_defaults
        self._pool = concurrent.futures.ThreadPoolExecutor(TOKENIZER_THREADS, "tokenize")
        self._admissions: set[asyncio.Task] = set()
        self._tokenizing: dict[str, tuple[list[bytes], str]] = {}  # rid -> (envelope, client rid)
        self._scheduler_step_s = 0.0  # of the step in progress, from the last heartbeat
        self._requests: dict[str, RequestState] = {}
        self._by_client: dict[tuple[bytes, str], str] = {}
        self._stats_waiting: dict[int, tuple[list[bytes], str]] = {}
        self._ids = itertools.count()
        self._last_heard = time.monotonic()
        self._counts = {"requests_total": 0, "errors_total": 0, "client_disconnects_total": 0}
        self.exit_code = 0

    async def serve(self) -> int:
        """Serve until ``stop`` is set (signal) or the scheduler dies; returns the exit code."""
        tasks = [
            asyncio.create_task(self._client_loop()),
            asyncio.create_task(self._scheduler_loop()),
            asyncio.create_task(self._watchdog()),
            asyncio.create_task(self._keepalive()),
        ]
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

    # ==== local clients ====

    def open_local(self) -> tuple[bytes, asyncio.Queue[replies.ServerReply]]:
        """A new local client: its identity, and the queue its replies arrive on."""
        identity = b"local:%d" % next(self._ids)
        queue: asyncio.Queue[replies.ServerReply] = asyncio.Queue()
        self._local[identity] = queue
        return identity, queue

    async def submit(self, identity: bytes, request: requests.ClientRequest) -> None:
        """A local client's request, handled as a ZMQ client's (authenticated by its caller)."""
        await self._dispatch([identity], request)

    def close_local(self, identity: bytes) -> None:
        """The local client is done or gone: abort whatever it still has running."""
        if self._local.pop(identity, None) is not None:
            self._abort_client(identity)

    # ==== clients ====

    async def _client_loop(self) -> None:
        while True:
            frames = await self._router.recv_multipart()
            # [identity, payload] from a DEALER; a REQ client adds an empty delimiter frame.
            envelope = frames[:2] if len(frames) > 2 and frames[1] == b"" else frames[:1]
            if len(frames) != len(envelope) + 1:
                await self._error(envelope, None, replies.BAD_REQUEST,
                                  f"a message is one frame; got {len(frames) - len(envelope)}")
                continue
            try:
                await self._on_client(envelope, frames[-1])
            except Exception:
                log.exception("failed to handle a client message")
                await self._send(
                    envelope, Error(rid=None, code=replies.INTERNAL, message="internal error")
                )

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
            self._stats_waiting[nonce] = (envelope, request.rid)
            self._scheduler.send(StatsRequest(nonce=nonce))

    async def _on_generate(self, envelope: list[bytes], request: requests.Generate) -> None:
        self._counts["requests_total"] += 1
        key = (envelope[0], request.rid)
        if key in self._by_client:
            await self._error(
                envelope,
                request.rid,
                replies.DUPLICATE_RID,
                f"request {request.rid!r} is still running",
            )
            return
        try:
            validate.check_request(request, self._model.vocab_size, self._max_prompt_chars,
                                   self._model.max_context_tokens)
        except validate.Rejected as exc:
            await self._error(envelope, request.rid, exc.code, str(exc))
            return
        rid = str(next(self._ids))
        self._by_client[key] = rid
        self._tokenizing[rid] = (envelope, request.rid)
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
            if self._tokenizing.pop(rid, None) is not None:
                del self._by_client[(envelope[0], request.rid)]
                await self._error(envelope, request.rid, exc.code, str(exc))
            return
        except Exception:
            log.exception("failed to tokenize request %s", request.rid)
            if self._tokenizing.pop(rid, None) is not None:
                del self._by_client[(envelope[0], request.rid)]
                await self._error(envelope, request.rid, replies.INTERNAL, "internal error while tokenizing")
            return
        if self._tokenizing.pop(rid, None) is None:
            return  # aborted while it was tokenized
        self._requests[rid] = RequestState(
            envelope=envelope,
            client_rid=request.rid,
            tokenizer=self._tokenizer,
            prompt_ids=ids,
            stream=request.stream,
            stop=request.stop,
            eos_token_ids=[] if request.ignore_eos else self._model.eos_token_ids,
        )
        self._requests[rid].started_s = received_s  # latency metrics count the tokenization too
        self._scheduler.send(message)

    async def _on_abort(self, identity: bytes, client_rid: str) -> None:
        rid = self._by_client.get((identity, client_rid))
        if rid is None:
            return  # finished already: aborting is idempotent
        tokenizing = self._tokenizing.pop(rid, None)
        if tokenizing is not None:  # it never reached the scheduler
            del self._by_client[(identity, client_rid)]
            usage = Usage(prompt_tokens=0, completion_tokens=0, cached_prompt_tokens=0)
            await self._send(tokenizing[0], Chunk(rid=client_rid, finish_reason="abort", usage=usage))
            return
        state = self._forget(rid)
        self._scheduler.send(AbortRequest(rid=rid))
        await self._send(state.envelope, state.finish("abort"))

    def _forget(self, rid: str) -> RequestState:
        state = self._requests.pop(rid)
        del self._by_client[(state.envelope[0], state.client_rid)]
        return state

    def _drop_client(self, identity: bytes) -> None:
        """The client is gone: abort its requests, forget its stats requests."""
        self._counts["client_disconnects_total"] += 1
        self._abort_client(identity)

    def _abort_client(self, identity: bytes) -> None:
        for rid in [r for r, s in self._requests.items() if s.envelope[0] == identity]:
            self._forget(rid)
            self._scheduler.send(AbortRequest(rid=rid))
        for rid in [r for r, (env, _) in self._tokenizing.items() if env[0] == identity]:
            _, client_rid = self._tokenizing.pop(rid)
            del self._by_client[(identity, client_rid)]
        for nonce in [n for n, (env, _) in self._stats_waiting.items() if env[0] == identity]:
            del self._stats_waiting[nonce]

    async def _send(self, envelope: list[bytes], reply: replies.ServerReply) -> None:
        queue = self._local.get(envelope[0])
        if queue is not None:
            queue.put_nowait(reply)
            return
        if envelope[0].startswith(b"local:"):
            return  # a local client that has closed: nobody to tell
        try:
            await self._router.send_multipart([*envelope, replies.encode(reply)])
        except zmq.ZMQError as exc:
            if exc.errno != zmq.EHOSTUNREACH:
                raise
            log.info("client %s is gone; aborting its requests", envelope[0].hex())
            self._drop_client(envelope[0])

    async def _keepalive(self) -> None:
        """A Pending reply to every live request: the send to a client that left fails, which
        aborts its requests (ROUTER sockets tell nothing of a peer that disconnects)."""
        while True:
            await asyncio.sleep(self._client_keepalive_s)
            for rid, state in list(self._requests.items()):
                if rid in self._requests:  # not dropped with its client a moment ago
                    await self._send(state.envelope, replies.Pending(rid=state.client_rid))

    async def _error(self, envelope: list[bytes], rid: str | None, code: str, message: str) -> None:
        self._counts["errors_total"] += 1
        await self._send(envelope, Error(rid=rid, code=code, message=message))

    # ==== scheduler ====

    async def _scheduler_loop(self) -> None:
        while True:
            frame = await self._scheduler.from_scheduler.recv()
            self._last_heard = time.monotonic()
            self._scheduler_step_s = 0.0
            try:
                message = from_scheduler.decode(frame)
            except ProtocolError as exc:
                log.error("bad frame from the scheduler: %s", exc)
                continue
            if isinstance(message, from_scheduler.TokenBatch):
                for update in message.updates:
                    try:
                        await self._on_update(update)
                    except Exception:  # one request's failure must not stop the others
                        log.exception("failed to handle an update of request %s", update.rid)
                        await self._fail_request(update.rid, "internal error while detokenizing")
            elif isinstance(message, from_scheduler.RequestError):
                await self._on_request_error(message)
            elif isinstance(message, from_scheduler.Heartbeat):
                self._scheduler_step_s = message.step_s
            elif isinstance(message, from_scheduler.StatsReply):
                await self._on_stats(message)

    async def _on_request_error(self, message: from_scheduler.RequestError) -> None:
        if message.rid not in self._requests:
            return
        state = self._forget(message.rid)
        if message.internal:  # the scheduler failed while running it, and serves on
            code, text = replies.INTERNAL, f"request {state.client_rid!r} failed: {message.message}"
        else:
            code, text = replies.SCHEDULER_ERROR, message.message
        await self._error(state.envelope, state.client_rid, code, text)

    def _info(self, rid: str) -> replies.Info:
        d = self._defaults
        return replies.Info(
            rid=rid,
            model=self._model.name,
            max_context_tokens=self._model.max_context_tokens,
            chat_template=self._tokenizer.has_chat_template,
            default_temperature=d.temperature,
            default_top_p=d.top_p,
            default_top_k=d.top_k,
        )

    async def _on_update(self, update: TokenUpdate) -> None:
        state = self._requests.get(update.rid)
        if state is None:
            return  # aborted here while the update was in flight
        if self._observer is not None and update.token_ids:
            now = time.monotonic()
            self._observer.on_tokens(state.started_s, state.last_token_s, now, len(update.token_ids))
            state.last_token_s = now
        chunk: Chunk | None = state.on_update(update)
        if chunk is None:
            return
        if chunk.finish_reason is not None:
            self._forget(update.rid)
            if not update.finished:  # a stop string matched: free the scheduler's pages now
                self._scheduler.send(AbortRequest(rid=update.rid))
        await self._send(state.envelope, chunk)

    async def _fail_request(self, rid: str, message: str) -> None:
        if rid in self._requests:
            state = self._forget(rid)
            self._scheduler.send(AbortRequest(rid=rid))
            await self._error(state.envelope, state.client_rid, replies.INTERNAL, message)

    async def _on_stats(self, message: from_scheduler.StatsReply) -> None:
        waiting = self._stats_waiting.pop(message.nonce, None)
        if waiting is None:
            return
        stats = dict(message.stats)
        stats.update({f"frontend_{k}": v for k, v in self._counts.items()})
        stats["frontend_active_requests"] = len(self._requests)
        stats["frontend_clients"] = len({s.envelope[0] for s in self._requests.values()})
        stats["scheduler_pid"] = self._scheduler.pid
        stats["frontend_tokenizing"] = len(self._tokenizing)
        await self._send(waiting[0], replies.Stats(rid=waiting[1], stats=stats))

    async def _watchdog(self) -> None:
        while True:
            await asyncio.sleep(WATCHDOG_INTERVAL_S)
            code = self._scheduler.process.poll()
            silent_s = time.monotonic() - self._last_heard
            if code is not None:
                reason = f"the scheduler (pid {self._scheduler.pid}) exited with code {code}"
            elif silent_s > self._heartbeat_timeout_s:
                # Heartbeats come from a thread of their own, whatever a step does: silence means
                # a frozen process (stopped, or a native call holding the GIL), never a long step.
                self._scheduler.process.kill()
                reason = (
                    f"the scheduler (pid {self._scheduler.pid}) sent nothing, not even a "
                    f"heartbeat, for {silent_s:.1f} s (--heartbeat-timeout); killed it"
                )
                if self._scheduler_step_s:
                    reason += f" (a step had run for {self._scheduler_step_s:.1f} s)"
            else:
                continue
            log.error("%s", reason)
            await self._fail_all(replies.SCHEDULER_DIED, reason)
            self.exit_code = 1
            self._stop.set()
            return

    async def _fail_all(self, code: str, message: str) -> None:
        """Answer every waiting request and stats request with an Error."""
        tokenizing, self._tokenizing = self._tokenizing, {}
        for envelope, client_rid in tokenizing.values():
            self._by_client.pop((envelope[0], client_rid), None)
            await self._error(envelope, client_rid, code, message)
        for rid in list(self._requests):
            if rid not in self._requests:
                continue  # dropped with its client while we were answering another request
            state = self._forget(rid)
            await self._error(state.envelope, state.client_rid, code, message)
        waiting, self._stats_waiting = self._stats_waiting, {}
        for envelope, rid in waiting.values():
            await self._error(envelope, rid, code, message)
