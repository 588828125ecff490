"""Is the scheduler alive? It sends heartbeats from a thread of its own, whatever a step does, so
its silence means a frozen process (stopped, or a native call holding the GIL), never a long step;
a frozen scheduler is killed. ``until_dead`` returns why the scheduler is gone."""

from __future__ import annotations

import asyncio
import time

from frontend.launch import SchedulerProcess

WATCHDOG_INTERVAL_S = 0.1


class SchedulerLiveness:
    def __init__(self, scheduler: SchedulerProcess, heartbeat_timeout_s: float) -> None:
        self._scheduler = scheduler
        self._timeout_s = heartbeat_timeout_s
        self._last_heard = time.monotonic()
        self._step_s = 0.0  # of the step in progress, from the last heartbeat

    def heard(self, step_s: float = 0.0) -> None:
        """A frame came from the scheduler; a heartbeat says how long its step has run."""
        self._last_heard = time.monotonic()
        self._step_s = step_s

    async def until_dead(self) -> str:
        while True:
            await asyncio.sleep(WATCHDOG_INTERVAL_S)
            reason = self._death()
            if reason is not None:
                return reason

    def _death(self) -> str | None:
        pid = self._scheduler.pid
        code = self._scheduler.process.poll()
        if code is not None:
            return f"the scheduler (pid {pid}) exited with code {code}"
        silent_s = time.monotonic() - self._last_heard
        if silent_s <= self._timeout_s:
            return None
        self._scheduler.process.kill()
        reason = (f"the scheduler (pid {pid}) sent nothing, not even a heartbeat, for {silent_s:.1f} s "
                  "(--heartbeat-timeout); killed it")
        if self._step_s:
            reason += f" (a step had run for {self._step_s:.1f} s)"
        return reason
