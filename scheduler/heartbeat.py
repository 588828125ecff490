"""Heartbeats from a thread of their own: the frontend hears from the scheduler however long a step
runs (a prefill chunk of the default model on a loaded 2-core machine takes tens of seconds), and
each heartbeat says how long the step in progress has run."""
from __future__ import annotations

import os
import threading
import time

import zmq

from scheduler.messages import from_scheduler


class HeartbeatThread(threading.Thread):
    def __init__(self, ctx: zmq.Context, endpoint: str):
        super().__init__(name="heartbeat", daemon=True)
        self.ctx = ctx
        self.endpoint = endpoint
        self.step_started = 0.0  # monotonic start of the step in progress; 0 between steps
        self._stopping = threading.Event()

    def run(self) -> None:
        push = self.ctx.socket(zmq.PUSH)  # its own socket: a ZMQ socket belongs to one thread
        push.setsockopt(zmq.LINGER, 0)
        push.connect(self.endpoint)
        try:
            while not self._stopping.wait(from_scheduler.HEARTBEAT_INTERVAL_S / 2):
                started = self.step_started
                step_s = time.monotonic() - started if started else 0.0
                beat = from_scheduler.Heartbeat(pid=os.getpid(), time=time.time(), step_s=step_s)
                try:  # never block: a frontend that reads nothing (or is gone) must not hang stop()
                    push.send(from_scheduler.encode(beat), flags=zmq.NOBLOCK)
                except zmq.Again:
                    pass
        finally:
            push.close()

    def stop(self) -> None:
        self._stopping.set()
        self.join()
