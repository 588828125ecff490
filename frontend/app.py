"""``python -m frontend``: bind the client endpoint, spawn the scheduler, wait for it, serve.

Options the frontend does not know are passed to the scheduler verbatim (e.g. ``--model DIR``)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
from dataclasses import dataclass, fields

import zmq
import zmq.asyncio

from frontend.generation_defaults import SamplingDefaults
from frontend.launch import SCHEDULER_CMD_ENV, SchedulerStartError, scheduler_command, spawn_scheduler, wait_ready
from frontend.server import Frontend
from frontend.tokenizer import ChatTokenizer
from frontend.validate import MAX_PROMPT_CHARS

log = logging.getLogger("sluice.frontend")


@dataclass(frozen=True)
class FrontendConfig:
    endpoint: str = "tcp://127.0.0.1:5557"
    pid_file: str | None = None
    tokenizer: str | None = None  # default: the tokenizer_path the scheduler announces in Ready
    scheduler_cmd: str | None = None  # default: $SLUICE_SCHEDULER_CMD, else python -m scheduler
    ready_timeout_s: float = 900.0
    heartbeat_timeout_s: float = 30.0
    client_keepalive_s: float = 2.0  # a Pending reply per live request this often (finds vanished clients)
    shutdown_grace_s: float = 10.0
    max_prompt_chars: int = MAX_PROMPT_CHARS
    max_message_mb: float = 64.0  # a 50 MB prompt still arrives, and is refused with a reason
    engine_args: tuple[str, ...] = ()


def parse_args(argv: list[str] | None = None) -> FrontendConfig:
    d = FrontendConfig
    p = argparse.ArgumentParser(
        prog="python -m frontend",
        description=__doc__,
        allow_abbrev=False,
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--endpoint", default=d.endpoint, help="client ZMQ endpoint (tcp:// or ipc://)")
    p.add_argument("--pid-file", default=d.pid_file, help="write the scheduler's pid here")
    p.add_argument(
        "--tokenizer", default=d.tokenizer, help="directory with tokenizer.json, if not the model's"
    )
    p.add_argument(
        "--scheduler-cmd",
        default=d.scheduler_cmd,
        help=f"command that starts the scheduler, if not ${SCHEDULER_CMD_ENV} or python -m scheduler",
    )
    p.add_argument(
        "--ready-timeout",
        dest="ready_timeout_s",
        metavar="S",
        type=float,
        default=d.ready_timeout_s,
        help="seconds the scheduler may take to load the model",
    )
    p.add_argument(
        "--heartbeat-timeout",
        dest="heartbeat_timeout_s",
        metavar="S",
        type=float,
        default=d.heartbeat_timeout_s,
        help="seconds of silence after which the scheduler is killed; it sends heartbeats from a "
        "thread of its own, so a long step never counts, only a frozen process",
    )
    p.add_argument(
        "--shutdown-grace",
        dest="shutdown_grace_s",
        metavar="S",
        type=float,
        default=d.shutdown_grace_s,
        help="seconds the scheduler gets to exit after a shutdown request, then after SIGTERM",
    )
    p.add_argument(
        "--max-prompt-chars",
        type=int,
        default=d.max_prompt_chars,
        help="longest prompt (characters, all chat messages together) before tokenizing; the "
        "tokens must also fit the model's context",
    )
    p.add_argument(
        "--max-message-mb",
        type=float,
        default=d.max_message_mb,
        help="largest client frame (MB); ZMQ drops the connection of a client that sends more",
    )
    p.add_argument(
        "--client-keepalive",
        dest="client_keepalive_s",
        metavar="S",
        type=float,
        default=d.client_keepalive_s,
        help="seconds between Pending replies to each live request; a client that went away is "
        "noticed when one cannot be delivered, and its requests are aborted",
    )
    known, engine_args = p.parse_known_args(argv)
    values = {
        f.name: getattr(known, f.name) for f in fields(FrontendConfig) if f.name != "engine_args"
    }
    return FrontendConfig(**values, engine_args=tuple(engine_args))


def _bind_clients(ctx: zmq.asyncio.Context, config: FrontendConfig) -> zmq.asyncio.Socket:
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a send to a vanished client raises EHOSTUNREACH
    router.setsockopt(zmq.SNDHWM, 0)  # never EAGAIN: one slow client must not stall the others
    router.setsockopt(zmq.MAXMSGSIZE, int(config.max_message_mb * 1e6))
    try:
        router.bind(config.endpoint)
    except zmq.ZMQError as exc:
        router.close(linger=0)
        hint = " (another server is running there? pick another --endpoint)"
        raise OSError(
            f"cannot listen on {config.endpoint}: {exc}{hint if exc.errno == zmq.EADDRINUSE else ''}"
        ) from None
    return router


def _load_tokenizer(path: str) -> ChatTokenizer:
    try:
        return ChatTokenizer.from_dir(path)
    except Exception as exc:  # tokenizers raises a bare Exception for a bad tokenizer.json
        raise OSError(f"cannot load the tokenizer from {path}: {exc}") from exc


async def run(config: FrontendConfig) -> int:
    ctx = zmq.asyncio.Context()
    try:
        router = _bind_clients(ctx, config)
    except OSError as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        ctx.term()
        return 1
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    scheduler = spawn_scheduler(
        ctx, scheduler_command(config.scheduler_cmd), list(config.engine_args), config.pid_file
    )
    log.info("started the scheduler (pid %d); it loads the model now", scheduler.pid)
    code = 1
    try:
        ready = asyncio.create_task(wait_ready(scheduler, config.ready_timeout_s))
        stopped = asyncio.create_task(stop.wait())
        await asyncio.wait([ready, stopped], return_when=asyncio.FIRST_COMPLETED)
        if stop.is_set():
            ready.cancel()
            code = 0
            return code
        stopped.cancel()
        model = ready.result().model
        tokenizer = _load_tokenizer(config.tokenizer or model.tokenizer_path)
        defaults = SamplingDefaults.from_model_dir(model.tokenizer_path)
        log.info("sampling defaults of the model: %s", defaults.describe())
        endpoint = router.getsockopt(zmq.LAST_ENDPOINT).decode()
        if config.pid_file:  # before the announcement, so a reader of stdout finds it
            with open(config.pid_file, "w") as f:
                f.write(f"{scheduler.pid}\n")
        print(f"frontend endpoint {endpoint}\nscheduler pid {scheduler.pid}", flush=True)
        frontend = Frontend(
            router,
            scheduler,
            tokenizer,
            model,
            config.heartbeat_timeout_s,
            stop,
            config.client_keepalive_s,
            config.max_prompt_chars,
            defaults,
        )
        code = await frontend.serve()
        return code
    except (SchedulerStartError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return 1
    finally:
        if code == 0:
            scheduler_code = await scheduler.shutdown(config.shutdown_grace_s)
            if scheduler_code != 0:
                log.warning("the scheduler exited with code %d at shutdown", scheduler_code)
        else:
            scheduler.kill()
        if config.pid_file and os.path.exists(config.pid_file):
            os.unlink(config.pid_file)  # a stale pid would point py-spy at another process
        router.close(linger=1000)  # let the last errors reach their clients
        ctx.term()


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    config = parse_args(argv)
    try:
        import uvloop
    except ImportError:
        return asyncio.run(run(config))
    return uvloop.run(run(config))
