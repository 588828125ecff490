"""The scheduler process's loop: ZMQ in, engine steps, ZMQ out; heartbeats from a thread.

It receives without blocking while there is work and blocks (up to a heartbeat interval) only
when idle, so a busy GPU is never left waiting on the socket. A request that fails inside a step
gets an internal RequestError and the loop goes on; an error that poisons the device ends the
process (exit code 3) with one line that says so.
"""
from __future__ import annotations

import logging
import os
import sys
import threading
import time

import msgspec
import zmq

from scheduler.engine import Engine
from scheduler.grammar import GrammarError, Grammars
from scheduler.heartbeat import HeartbeatThread
from scheduler.messages import ProtocolError, from_scheduler, to_scheduler
from scheduler.request import Request

log = logging.getLogger("sluice.scheduler")

DEVICE_POISONED_EXIT = 3


class SchedulerServer:
    def __init__(self, engine: Engine, model_info: from_scheduler.ModelInfo, pull_endpoint: str,
                 push_endpoint: str, check_pages: bool = False):
        self.engine = engine
        self.model_info = model_info
        self.check_pages = check_pages
        self.ctx = zmq.Context()
        self.pull = self.ctx.socket(zmq.PULL)
        self.pull.connect(pull_endpoint)
        self.push = self.ctx.socket(zmq.PUSH)
        self.push.setsockopt(zmq.LINGER, 1000)
        self.push.connect(push_endpoint)
        self.heartbeat = HeartbeatThread(self.ctx, push_endpoint)
        self.running = True
        # the tokenizer as llguidance reads it takes seconds for a 150k vocabulary: read beside the
        # loop from the start, so that the first constrained request does not stall every other
        self._grammars: Grammars | GrammarError | None = None
        self._grammars_loading = threading.Thread(target=self._load_grammars, name="grammars", daemon=True)
        self._grammars_loading.start()

    def send(self, message) -> None:
        self.push.send(from_scheduler.encode(message))

    def serve_forever(self) -> None:
        self.send(from_scheduler.Ready(pid=os.getpid(), model=self.model_info))
        self.heartbeat.start()
        log.info("scheduler ready, pid %d", os.getpid())
        try:
            while self.running:
                self.receive(block=not self.engine.has_work)
                if self.engine.has_work:
                    self.run_step()
        finally:
            self.heartbeat.stop()
            self.ctx.destroy(linger=1000)

    def receive(self, block: bool) -> None:
        timeout_ms = int(from_scheduler.HEARTBEAT_INTERVAL_S * 500) if block else 0
        while self.pull.poll(timeout_ms):
            timeout_ms = 0
            frame = self.pull.recv()
            try:
                self.handle(to_scheduler.decode(frame))
            except ProtocolError as err:
                log.warning("bad frame from frontend: %s", err)
                if err.rid:
                    self.send(from_scheduler.RequestError(rid=err.rid, message=str(err)))

    def run_step(self) -> None:
        self.heartbeat.step_started = time.monotonic()
        try:
            updates = self.engine.step()
        except Exception as exc:  # the engine contains all but errors that poison the device
            log.critical("the device is unusable after this error; exiting (code %d) so that the frontend "
                         "fails every request at once: %s", DEVICE_POISONED_EXIT, exc, exc_info=exc)
            sys.stderr.flush()
            os._exit(DEVICE_POISONED_EXIT)  # no clean-up that would touch the poisoned context
        finally:
            self.heartbeat.step_started = 0.0
        for failure in self.engine.take_failures():
            self.send(from_scheduler.RequestError(rid=failure.rid, message=failure.message,
                                                  internal=failure.internal))
        if updates:
            self.send(from_scheduler.TokenBatch(updates=updates))
        if self.check_pages and not self.engine.in_flight:
            self.engine.check_pages()

    def handle(self, msg) -> None:
        if isinstance(msg, to_scheduler.TokenizedRequest):
            self.add_request(msg)
        elif isinstance(msg, to_scheduler.AbortRequest):
            self.engine.abort(msg.rid)
        elif isinstance(msg, to_scheduler.StatsRequest):
            self.send(from_scheduler.StatsReply(nonce=msg.nonce, stats=self.stats()))
        elif isinstance(msg, to_scheduler.Shutdown):
            self.running = False

    def add_request(self, msg: to_scheduler.TokenizedRequest) -> None:
        s = msg.sampling
        seed = s.seed if s.seed is not None else int.from_bytes(os.urandom(4), "little")
        params = msgspec.structs.replace(s, seed=seed)
        error = self.refusal(msg, params)
        if error is None:
            req = Request(msg.rid, list(msg.input_ids), params, msg.max_tokens, frozenset(msg.eos_token_ids),
                          msg.ignore_eos)
            try:
                req.grammar = self.grammars().compile(msg.grammar) if msg.grammar is not None else None
            except GrammarError as exc:
                error = str(exc)
            error = error or self.engine.submit(req)
        if error:
            self.send(from_scheduler.RequestError(rid=msg.rid, message=error))

    def grammars(self) -> Grammars:
        """The compiler of grammars (waits for its loading); GrammarError when it cannot be made."""
        self._grammars_loading.join()
        if isinstance(self._grammars, GrammarError):
            raise self._grammars
        return self._grammars

    def _load_grammars(self) -> None:
        info = self.model_info
        try:
            self._grammars = Grammars.from_dir(info.tokenizer_path, info.vocab_size, info.eos_token_ids)
        except GrammarError as exc:
            self._grammars = exc

    def refusal(self, msg: to_scheduler.TokenizedRequest, params: to_scheduler.SamplingParams) -> str | None:
        """Why the engine cannot take ``msg`` (the frontend checked it already; this side must not
        crash on a frame that a client of its own makes)."""
        vocab = self.model_info.vocab_size
        try:
            params.validate()
        except ValueError as exc:
            return str(exc)
        if not msg.input_ids:
            return "empty prompt"
        if max(msg.input_ids) >= vocab:
            return f"token id {max(msg.input_ids)} is out of the vocabulary ({vocab})"
        return None

    def stats(self) -> dict:
        return {**self.engine.stats(), "scheduler_pid": os.getpid()}
