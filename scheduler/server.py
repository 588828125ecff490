"""The scheduler process's loop: ZMQ in, engine steps, ZMQ out, heartbeats.

It receives without blocking while there is work and blocks (up to a heartbeat interval) only
when idle, so a busy GPU is never left waiting on the socket.
"""
from __future__ import annotations

import logging
import os
import time

import zmq

from scheduler.engine import Engine
from scheduler.messages import ProtocolError, from_scheduler, to_scheduler
from scheduler.request import Request
from worker.sampling import SamplingParams

log = logging.getLogger("sluice.scheduler")


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
        self.last_sent = 0.0
        self.running = True

    def send(self, message) -> None:
        self.push.send(from_scheduler.encode(message))
        self.last_sent = time.monotonic()

    def serve_forever(self) -> None:
        self.send(from_scheduler.Ready(pid=os.getpid(), model=self.model_info))
        log.info("scheduler ready, pid %d", os.getpid())
        while self.running:
            self.receive(block=not self.engine.has_work)
            if self.engine.has_work:
                self.run_step()
            if time.monotonic() - self.last_sent >= from_scheduler.HEARTBEAT_INTERVAL_S / 2:
                self.send(from_scheduler.Heartbeat(pid=os.getpid(), time=time.time()))
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
        updates = self.engine.step()
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
        params = SamplingParams(s.temperature, s.top_k, s.top_p, seed)
        vocab = self.model_info.vocab_size
        error = None
        if not msg.input_ids:
            error = "empty prompt"
        elif max(msg.input_ids) >= vocab:
            error = f"token id {max(msg.input_ids)} is out of the vocabulary ({vocab})"
        else:
            req = Request(msg.rid, list(msg.input_ids), params, msg.max_tokens, frozenset(msg.eos_token_ids),
                          msg.ignore_eos)
            error = self.engine.submit(req)
        if error:
            self.send(from_scheduler.RequestError(rid=msg.rid, message=error))

    def stats(self) -> dict:
        stats = dict(self.engine.stats())
        stats["scheduler_pid"] = os.getpid()
        experts = self.engine.runner.experts
        pipeline = getattr(experts, "pipeline", None)
        if pipeline is not None:
            stats.update({f"prefill_{k}": v for k, v in pipeline.stats().items()})
        cache = getattr(experts, "cache", None)
        if cache is not None:
            moe = cache.stats()
            stats.update({f"moe_{k}": v for k, v in moe["total"].items()})
            stats.update(moe_hit_rate=moe["hit_rate"], moe_cache_slots=moe["slots"], moe_policy=moe["policy"])
        return stats
