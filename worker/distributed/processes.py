"""The rank processes rank 0 starts, one per extra GPU, and the thread that watches them.

A rank that dies takes its experts with it, and the others would wait in their next collective
forever (NCCL) or fail one by one (gloo): the watcher ends the whole run instead, with one line
that names the rank, and kills the other ranks first, so nothing is left behind. Each child also
asks the kernel to kill it when rank 0 dies (``PR_SET_PDEATHSIG``), for the case where rank 0 is
killed without a chance to clean up.
"""
from __future__ import annotations

import atexit
import ctypes
import multiprocessing
import multiprocessing.connection
import os
import signal
import sys
import threading
from typing import Callable

RANK_DIED_EXIT = 3  # rank 0's exit status when another rank died
JOIN_TIMEOUT_S = 10.0
PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """In a child: SIGKILL when the process that started it exits (Linux; elsewhere a no-op)."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def describe_exit(code: int | None) -> str:
    if code is None:
        return "is still running"
    if code < 0:
        return f"was killed by {signal.Signals(-code).name}"
    return f"exited with status {code}"


class RankProcesses:
    """Ranks ``1 .. world-1``, each ``target(rank, *args)`` in a spawned process."""

    def __init__(self, world: int, target: Callable[..., None], args: tuple):
        context = multiprocessing.get_context("spawn")  # a forked CUDA context is unusable
        self.procs = [context.Process(target=target, args=(rank, *args), name=f"rank {rank}", daemon=True)
                      for rank in range(1, world)]
        self.stopping = threading.Event()
        self.died = threading.Event()
        self.lock = threading.Lock()
        for proc in self.procs:
            proc.start()
        self.running = list(self.procs)
        atexit.register(self.stop)  # before multiprocessing's own exit hook terminates the daemons
        self.watcher = threading.Thread(target=self._watch, name="rank watcher", daemon=True)
        self.watcher.start()

    @property
    def pids(self) -> list[int]:
        return [proc.pid for proc in self.procs]

    def _watch(self) -> None:
        """Reap each rank as it exits (the only thread that reaps: no two threads race in
        ``waitpid``, and a pid in ``running`` is never a reused one)."""
        while self.running:
            ready = multiprocessing.connection.wait([proc.sentinel for proc in self.running])
            for proc in [p for p in self.running if p.sentinel in ready]:
                with self.lock:
                    proc.join()
                    self.running.remove(proc)
                if not self.stopping.is_set():
                    self._end_run(proc)

    def _end_run(self, dead: multiprocessing.Process) -> None:
        """A rank died mid-run: say so once, kill the others, end this process."""
        self.died.set()
        others = ", ".join(f"{p.name} (pid {p.pid})" for p in self.running) or "none left"
        line = (f"error: {dead.name} (pid {dead.pid}) {describe_exit(dead.exitcode)}; its experts are gone, so the "
                f"run stops: rank 0 (pid {os.getpid()}) exits and ends the other ranks: {others}\n")
        sys.stderr.flush()  # one write of the whole line: the engine's thread may be logging the failed step
        os.write(sys.stderr.fileno(), line.encode())
        self.kill()
        os._exit(RANK_DIED_EXIT)

    def wait_for_death(self, timeout: float = JOIN_TIMEOUT_S) -> None:
        """After a collective failed: give the watcher the time to notice a dead rank and end the
        run (it does not return then); returns when no rank died within ``timeout``."""
        self.died.wait(timeout)

    def kill(self) -> None:
        """SIGKILL every rank still running and wait until the watcher has reaped them."""
        with self.lock:
            for proc in self.running:
                os.kill(proc.pid, signal.SIGKILL)
        if threading.current_thread() is self.watcher:  # ending the run: reap them here
            for proc in list(self.running):
                proc.join(JOIN_TIMEOUT_S)
        else:
            self.watcher.join(JOIN_TIMEOUT_S)

    def stop(self, timeout: float = JOIN_TIMEOUT_S) -> None:
        """The run ends in order: wait ``timeout`` for the ranks to leave, then kill the rest."""
        self.stopping.set()
        self.watcher.join(timeout)
        self.kill()
