"""What the scheduler sends back, turned into client replies: token updates become chunks (through
each request's ``RequestState``), request errors become Errors, stats replies get the frontend's own
counts. Every frame, heartbeats included, tells ``SchedulerLiveness`` that the scheduler lives."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Callable, Protocol

from frontend.api import replies
from frontend.client_link import ClientLink
from frontend.launch import SchedulerProcess
from frontend.liveness import SchedulerLiveness
from frontend.request_table import RequestTable
from scheduler.messages import ProtocolError, from_scheduler
from scheduler.messages.from_scheduler import TokenUpdate
from scheduler.messages.to_scheduler import AbortRequest

log = logging.getLogger("sluice.frontend")


class RequestObserver(Protocol):
    """Told when tokens of a request arrive (latency metrics); times are ``time.monotonic()``."""

    def on_tokens(self, started_s: float, previous_s: float | None, now_s: float, count: int) -> None:
        ...


@dataclass(frozen=True)
class SchedulerReplies:
    scheduler: SchedulerProcess
    liveness: SchedulerLiveness
    table: RequestTable
    clients: ClientLink
    frontend_stats: Callable[[], dict]  # the frontend's part of a Stats reply
    observer: RequestObserver | None

    async def run(self) -> None:
        while True:
            frame = await self.scheduler.from_scheduler.recv()
            self.liveness.heard()
            try:
                message = from_scheduler.decode(frame)
            except ProtocolError as exc:
                log.error("bad frame from the scheduler: %s", exc)
                continue
            if isinstance(message, from_scheduler.TokenBatch):
                for update in message.updates:
                    await self._on_update_guarded(update)
            elif isinstance(message, from_scheduler.RequestError):
                await self._on_request_error(message)
            elif isinstance(message, from_scheduler.Heartbeat):
                self.liveness.heard(message.step_s)
            elif isinstance(message, from_scheduler.StatsReply):
                await self._on_stats(message)

    async def _on_update_guarded(self, update: TokenUpdate) -> None:
        try:
            await self._on_update(update)
        except Exception:  # one request's failure must not stop the others
            log.exception("failed to handle an update of request %s", update.rid)
            if update.rid in self.table.running:
                state = self.table.forget(update.rid)
                self.scheduler.send(AbortRequest(rid=update.rid))
                await self.clients.error(state.envelope, state.client_rid, replies.INTERNAL,
                                          "internal error while detokenizing")

    async def _on_update(self, update: TokenUpdate) -> None:
        state = self.table.running.get(update.rid)
        if state is None:
            return  # aborted here while the update was in flight
        if self.observer is not None and update.token_ids:
            now = time.monotonic()
            self.observer.on_tokens(state.started_s, state.last_token_s, now, len(update.token_ids))
            state.last_token_s = now
        chunk = state.on_update(update)
        if chunk is None:
            return
        if chunk.finish_reason is not None:
            self.table.forget(update.rid)
            if not update.finished:  # a stop string matched: free the scheduler's pages now
                self.scheduler.send(AbortRequest(rid=update.rid))
        await self.clients.send(state.envelope, chunk)

    async def _on_request_error(self, message: from_scheduler.RequestError) -> None:
        if message.rid not in self.table.running:
            return
        state = self.table.forget(message.rid)
        if message.internal:  # the scheduler failed while running it, and serves on
            code, text = replies.INTERNAL, f"request {state.client_rid!r} failed: {message.message}"
        else:
            code, text = replies.SCHEDULER_ERROR, message.message
        await self.clients.error(state.envelope, state.client_rid, code, text)

    async def _on_stats(self, message: from_scheduler.StatsReply) -> None:
        waiting = self.table.stats_waiting.pop(message.nonce, None)
        if waiting is None:
            return
        stats = {**message.stats, **self.frontend_stats()}
        await self.clients.send(waiting.envelope, replies.Stats(rid=waiting.client_rid, stats=stats))
