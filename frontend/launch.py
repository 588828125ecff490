"""Spawning the scheduler process and the two ipc sockets that connect it to the frontend.

The frontend binds both sockets in a private temp dir and the scheduler connects, so a scheduler
that dies and is restarted finds them still there. The scheduler runs in its own session (a
terminal's Ctrl-C reaches only the frontend, which then shuts it down through the protocol) and,
on Linux, gets SIGTERM if the frontend dies without doing so; it then removes the socket dir and
the pid file ($SLUICE_REMOVE_ON_EXIT), which the dead frontend cannot."""

from __future__ import annotations

import asyncio
import ctypes
import logging
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import zmq
import zmq.asyncio

import scheduler.messages
from scheduler.messages import ProtocolError, from_scheduler, to_scheduler

SCHEDULER_CMD_ENV = "SLUICE_SCHEDULER_CMD"
REMOVE_ON_EXIT_ENV = "SLUICE_REMOVE_ON_EXIT"  # paths (os.pathsep-separated) the scheduler removes at exit
LOAD_PROGRESS_S = 15.0  # a line this often while the scheduler loads the model

log = logging.getLogger("sluice.frontend")
# scheduler/messages/__init__.py -> the directory that holds the ``scheduler`` package.
_SOURCE_ROOT = Path(scheduler.messages.__file__).resolve().parents[2]


class SchedulerStartError(RuntimeError):
    pass


def scheduler_command(override: str | None) -> list[str]:
    """``override`` (e.g. ``--scheduler-cmd``), else $SLUICE_SCHEDULER_CMD, else the real one."""
    spec = override or os.environ.get(SCHEDULER_CMD_ENV)
    return shlex.split(spec) if spec else [sys.executable, "-m", "scheduler"]


def _die_with_parent() -> None:
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


@dataclass
class SchedulerProcess:
    process: subprocess.Popen
    to_scheduler: zmq.asyncio.Socket  # PUSH
    from_scheduler: zmq.asyncio.Socket  # PULL
    ipc_dir: str

    @property
    def pid(self) -> int:
        return self.process.pid

    def send(self, message: to_scheduler.ToScheduler) -> None:
        # PUSH to one connected peer: queues without blocking up to the (unbounded) HWM.
        self.to_scheduler.send(to_scheduler.encode(message), flags=zmq.NOBLOCK)

    async def shutdown(self, grace_s: float) -> int:
        """Ask for a clean exit, then terminate, then kill. Returns the exit code."""
        if self.process.poll() is None:
            try:
                self.send(to_scheduler.Shutdown())
            except zmq.ZMQError:
                pass
            if not await self._wait(grace_s):
                self.process.terminate()
                if not await self._wait(grace_s):
                    self.process.kill()
        code = self.process.wait()
        self.close()
        return code

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()
        self.close()

    def close(self) -> None:
        self.to_scheduler.close(linger=0)
        self.from_scheduler.close(linger=0)
        shutil.rmtree(self.ipc_dir, ignore_errors=True)

    async def _wait(self, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while self.process.poll() is None and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        return self.process.poll() is not None


def _child_env() -> dict[str, str]:
    """The environment of a scheduler-side child: ours, with the source root importable, and torch's
    CPU threads waiting passively unless ``OMP_WAIT_POLICY`` is set: spinning, they spin against any
    other process on the cores: a CPU model's request took 1.7 s beside two busy processes on two
    cores, 0.3-0.5 s alone (docs/architecture.md, "Processes")."""
    env = dict(os.environ)
    env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(_SOURCE_ROOT), env.get("PYTHONPATH")) if p)
    return env


def engine_help() -> str:
    """The help of the engine options the frontend passes through to the scheduler, in their groups
    (``python -m scheduler.cli_options``: without torch, so it answers at once)."""
    done = subprocess.run([sys.executable, "-m", "scheduler.cli_options"], env=_child_env(), stdout=subprocess.PIPE,
                          stdin=subprocess.DEVNULL, text=True, timeout=120)
    if done.returncode != 0:
        return f"(the engine options could not be listed: python -m scheduler.cli_options exited {done.returncode})\n"
    return done.stdout


def spawn_scheduler(
    ctx: zmq.asyncio.Context,
    command: list[str],
    engine_args: list[str],
    pid_file: str | None = None,
) -> SchedulerProcess:
    ipc_dir = tempfile.mkdtemp(prefix="sluice-")
    push = ctx.socket(zmq.PUSH)
    pull = ctx.socket(zmq.PULL)
    for sock in (push, pull):
        sock.setsockopt(zmq.SNDHWM, 0)
        sock.setsockopt(zmq.RCVHWM, 0)
    push_ep, pull_ep = f"ipc://{ipc_dir}/to-scheduler", f"ipc://{ipc_dir}/from-scheduler"
    push.bind(push_ep)
    pull.bind(pull_ep)
    argv = [
        *command,
        "--frontend-to-scheduler",
        push_ep,
        "--scheduler-to-frontend",
        pull_ep,
        *engine_args,
    ]
    env = _child_env()
    env[REMOVE_ON_EXIT_ENV] = os.pathsep.join(p for p in (ipc_dir, pid_file) if p)
    try:
        process = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            env=env,
            start_new_session=True,
            preexec_fn=_die_with_parent if sys.platform == "linux" else None,
        )
    except OSError as exc:
        push.close(linger=0)
        pull.close(linger=0)
        shutil.rmtree(ipc_dir, ignore_errors=True)
        raise SchedulerStartError(f"cannot start the scheduler {shlex.join(argv)}: {exc}") from exc
    return SchedulerProcess(process, push, pull, ipc_dir)


async def wait_ready(scheduler: SchedulerProcess, timeout_s: float) -> from_scheduler.Ready:
    """The scheduler's ``Ready``; raises SchedulerStartError if it exits or times out first."""
    started = time.monotonic()
    deadline, next_note = started + timeout_s, started + LOAD_PROGRESS_S
    while True:
        if time.monotonic() > next_note:
            next_note += LOAD_PROGRESS_S
            log.info("the scheduler (pid %d) is still loading the model (%.0f s so far; --ready-timeout %g)",
                     scheduler.pid, time.monotonic() - started, timeout_s)
        if scheduler.process.poll() is not None:
            raise SchedulerStartError(
                f"the scheduler (pid {scheduler.pid}) exited with code "
                f"{scheduler.process.returncode} "
                "before it was ready; its stderr is above"
            )
        if time.monotonic() > deadline:
            raise SchedulerStartError(f"the scheduler was not ready within {timeout_s:g} s")
        if await scheduler.from_scheduler.poll(100, zmq.POLLIN):
            try:
                message = from_scheduler.decode(await scheduler.from_scheduler.recv())
            except ProtocolError as exc:
                raise SchedulerStartError(f"the scheduler sent a bad frame: {exc}") from exc
            if isinstance(message, from_scheduler.Ready):
                return message
