"""``python -m frontend``: bind the client endpoint and the HTTP API, spawn the scheduler, wait for
it, serve. The HTTP API answers /health (503) while the model loads.

Options the frontend does not know are passed to the scheduler verbatim (e.g. ``--model DIR``)."""

from __future__ import annotations

import argparse
import asyncio
import ipaddress
import logging
import os
import signal
import sys
from dataclasses import dataclass, fields

import zmq
import zmq.asyncio

from frontend.client import API_KEY_ENV
from frontend.generation_defaults import SamplingDefaults
from frontend.http.context import HttpContext
from frontend.http.harmony import encoding as harmony_encoding
from frontend.http.server import HttpServer
from frontend.launch import (SCHEDULER_CMD_ENV, SchedulerProcess, SchedulerStartError, engine_help,
                             scheduler_command, spawn_scheduler, wait_ready)
from frontend.server import Frontend
from frontend.tokenizer import ChatTokenizer
from frontend.validate import MAX_PROMPT_CHARS
from scheduler.messages.from_scheduler import ModelInfo

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
    client_heartbeat_timeout_s: float = 30.0  # a client connection silent this long is dropped; 0: never
    shutdown_grace_s: float = 10.0
    max_prompt_chars: int = MAX_PROMPT_CHARS
    max_message_mb: float = 64.0  # a 50 MB prompt still arrives, and is refused with a reason
    http_host: str = "127.0.0.1"
    http_port: int | None = 8000  # None: no HTTP API (--no-http); 0: any free port
    http_max_body_bytes: int = 32 << 20
    served_model_names: tuple[str, ...] = ()  # default: the model name the scheduler announces
    api_key: str | None = None  # default: $SLUICE_API_KEY
    engine_args: tuple[str, ...] = ()


def parse_args(argv: list[str] | None = None) -> FrontendConfig:
    """The frontend's options; the ones it does not know are the engine's, passed to the scheduler.
    ``--help`` lists both (the engine's from ``python -m scheduler.cli_options``) and exits."""
    p = _parser()
    known, engine_args = p.parse_known_args(argv)
    if getattr(known, "help", False):
        print(p.format_help())
        print(engine_help(), end="")
        sys.exit(0)
    if known.no_http:
        known.http_port = None
    if known.api_key is None:
        known.api_key = os.environ.get(API_KEY_ENV) or None
    known.served_model_names = tuple(known.served_model_names)
    values = {f.name: getattr(known, f.name) for f in fields(FrontendConfig) if f.name != "engine_args"}
    return FrontendConfig(**values, engine_args=tuple(engine_args))


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m frontend", usage="%(prog)s [-h] [server options] [engine options]",
                                description=__doc__, add_help=False, allow_abbrev=False,
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("-h", "--help", action="store_true", default=argparse.SUPPRESS,
                   help="show every option, the engine's too, and exit")
    server = p.add_argument_group("server", "the client endpoints, the scheduler process and its watchdog")
    _add_server_args(server, FrontendConfig)
    _add_http_args(server, FrontendConfig)
    return p


def _add_server_args(g: argparse._ArgumentGroup, d: type[FrontendConfig]) -> None:
    g.add_argument("--endpoint", default=d.endpoint, help="client ZMQ endpoint (tcp:// or ipc://)")
    g.add_argument("--pid-file", default=d.pid_file, help="write the scheduler's pid here")
    g.add_argument("--tokenizer", default=d.tokenizer, help="directory with tokenizer.json, if not the model's")
    g.add_argument("--scheduler-cmd", default=d.scheduler_cmd,
                   help=f"command that starts the scheduler, if not ${SCHEDULER_CMD_ENV} or python -m scheduler")
    g.add_argument("--ready-timeout", dest="ready_timeout_s", metavar="S", type=float, default=d.ready_timeout_s,
                   help="seconds the scheduler may take to load the model")
    g.add_argument("--heartbeat-timeout", dest="heartbeat_timeout_s", metavar="S", type=float,
                   default=d.heartbeat_timeout_s,
                   help="seconds of silence after which the scheduler is killed; it sends heartbeats from a "
                        "thread of its own, so a long step never counts, only a frozen process")
    g.add_argument("--shutdown-grace", dest="shutdown_grace_s", metavar="S", type=float, default=d.shutdown_grace_s,
                   help="seconds the scheduler gets to exit after a shutdown request, then after SIGTERM")
    g.add_argument("--max-prompt-chars", type=int, default=d.max_prompt_chars,
                   help="longest prompt (characters, all chat messages together) before tokenizing; the "
                        "tokens must also fit the model's context")
    g.add_argument("--max-message-mb", type=float, default=d.max_message_mb,
                   help="largest client frame (MB); ZMQ drops the connection of a client that sends more")
    g.add_argument("--client-keepalive", dest="client_keepalive_s", metavar="S", type=float,
                   default=d.client_keepalive_s,
                   help="seconds between Pending replies to each live request; a client that went away is "
                        "noticed when one cannot be delivered, and its requests are aborted")
    g.add_argument("--client-heartbeat-timeout", dest="client_heartbeat_timeout_s", metavar="S", type=float,
                   default=d.client_heartbeat_timeout_s,
                   help="seconds a client connection may leave ZMTP pings (sent every third of it) unanswered "
                        "before it is dropped and its requests aborted: a stopped client, or a host gone without "
                        "closing its connection; 0: never")


def _add_http_args(p: argparse._ArgumentGroup, d: type[FrontendConfig]) -> None:
    p.add_argument("--http-host", default=d.http_host, help="address of the OpenAI HTTP API")
    p.add_argument("--http-port", type=int, default=d.http_port, help="0: any free port (printed)")
    p.add_argument("--no-http", action="store_true", help="serve ZMQ clients only")
    p.add_argument("--http-max-body", dest="http_max_body_bytes", type=int,
                   default=d.http_max_body_bytes, help="largest HTTP request body, in bytes")
    p.add_argument("--served-model-name", dest="served_model_names", nargs="+", metavar="NAME",
                   default=d.served_model_names,
                   help="the model names HTTP clients may send (aliases, e.g. claude-sonnet-4-5); the first "
                        "is the one /v1/models lists; none: the model's path")
    p.add_argument("--api-key", default=d.api_key,
                   help=f"require this key from every client; None: ${API_KEY_ENV}")


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:  # "*", an interface or host name: assume it is reachable
        return False


def _warn_open_sockets(config: FrontendConfig) -> None:
    """Anyone who can reach a non-loopback socket can use the server: say so if no key guards it."""
    if config.api_key:
        return
    zmq_host = config.endpoint.split("://", 1)[-1].rsplit(":", 1)[0]
    if config.endpoint.startswith("tcp://") and not _is_loopback(zmq_host):
        log.warning("the ZMQ endpoint %s is not loopback and no --api-key is set", config.endpoint)
    if config.http_port is not None and not _is_loopback(config.http_host):
        log.warning("the HTTP API on %s is not loopback and no --api-key is set", config.http_host)


def _start_http(config: FrontendConfig) -> HttpServer | None:
    if config.http_port is None:
        return None
    ctx = HttpContext(config.api_key, config.http_max_body_bytes, config.served_model_names)
    http = HttpServer(ctx, config.http_host, config.http_port)
    http.start()
    log.info("HTTP API on %s (503 on /health until the model is loaded)", http.url)
    return http


def _bind_clients(ctx: zmq.asyncio.Context, config: FrontendConfig) -> zmq.asyncio.Socket:
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a send to a vanished client raises EHOSTUNREACH
    router.setsockopt(zmq.SNDHWM, 0)  # never EAGAIN: one slow client must not stall the others
    router.setsockopt(zmq.MAXMSGSIZE, int(config.max_message_mb * 1e6))
    if config.client_heartbeat_timeout_s > 0:
        # A client that closes its connection is noticed at once; one that goes silent with the
        # connection open (stopped, or its host gone) only once ZMTP pings go unanswered.
        timeout_ms = max(3, int(config.client_heartbeat_timeout_s * 1000))
        router.setsockopt(zmq.HEARTBEAT_IVL, timeout_ms // 3)
        router.setsockopt(zmq.HEARTBEAT_TIMEOUT, timeout_ms)
    try:
        router.bind(config.endpoint)
    except zmq.ZMQError as exc:
        router.close(linger=0)
        hint = " (another server is running there? pick another --endpoint)"
        raise OSError(
            f"cannot listen on {config.endpoint}: {zmq.strerror(exc.errno)}"
            f"{hint if exc.errno == zmq.EADDRINUSE else ''}"
        ) from None
    return router


def _load_tokenizer(path: str) -> ChatTokenizer:
    try:
        return ChatTokenizer.from_dir(path)
    except Exception as exc:  # tokenizers raises a bare Exception for a bad tokenizer.json
        raise OSError(f"cannot load the tokenizer from {path}: {exc}") from exc


async def run(config: FrontendConfig) -> int:
    _warn_open_sockets(config)
    try:
        http = _start_http(config)
    except OSError as exc:
        print(f"error: cannot serve HTTP on {config.http_host}:{config.http_port}: {exc}",
              file=sys.stderr, flush=True)
        return 1
    try:
        return await _run_zmq(config, http)
    finally:
        if http is not None:
            await http.stop()


async def _run_zmq(config: FrontendConfig, http: HttpServer | None) -> int:
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
        code = await _serve(config, http, router, scheduler, stop)
        return code
    except (SchedulerStartError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return 1
    finally:
        await _close(config, scheduler, code)
        router.close(linger=1000)  # let the last errors reach their clients
        ctx.term()


async def _serve(config: FrontendConfig, http: HttpServer | None, router: zmq.asyncio.Socket,
                 scheduler: SchedulerProcess, stop: asyncio.Event) -> int:
    """Wait for the scheduler's model, then serve until stopped; 0 when stopped while it loaded."""
    ready = asyncio.create_task(wait_ready(scheduler, config.ready_timeout_s))
    stopped = asyncio.create_task(stop.wait())
    await asyncio.wait([ready, stopped], return_when=asyncio.FIRST_COMPLETED)
    if stop.is_set():
        ready.cancel()
        return 0
    stopped.cancel()
    frontend = _frontend(config, http, router, scheduler, ready.result().model, stop)
    print(f"frontend endpoint {router.getsockopt(zmq.LAST_ENDPOINT).decode()}\n"
          f"scheduler pid {scheduler.pid}", flush=True)
    if http is not None:
        # gpt-oss: harmony's vocabulary loads for seconds, before the first request rather than in it
        await asyncio.get_running_loop().run_in_executor(None, harmony_encoding.preload, frontend.tokenizer)
        http.ctx.frontend = frontend
        print(f"http endpoint {http.url}", flush=True)
    code = await frontend.serve()
    if http is not None:  # its loops have stopped: new HTTP requests get 503 from here on
        http.ctx.frontend, http.ctx.stopping = None, True
    return code


def _frontend(config: FrontendConfig, http: HttpServer | None, router: zmq.asyncio.Socket,
              scheduler: SchedulerProcess, model: ModelInfo, stop: asyncio.Event) -> Frontend:
    tokenizer = _load_tokenizer(config.tokenizer or model.tokenizer_path)
    defaults = SamplingDefaults.from_model_dir(model.name)  # a checkpoint dir (a geometry has none)
    log.info("sampling defaults of the model: %s", defaults.describe())
    if config.pid_file:  # before the announcement, so a reader of stdout finds it
        with open(config.pid_file, "w") as f:
            f.write(f"{scheduler.pid}\n")
    return Frontend(
        router,
        scheduler,
        tokenizer,
        model,
        config.heartbeat_timeout_s,
        stop,
        config.client_keepalive_s,
        config.api_key,
        http.ctx.metrics if http is not None else None,
        max_prompt_chars=config.max_prompt_chars,
        sampling_defaults=defaults,
    )


async def _close(config: FrontendConfig, scheduler: SchedulerProcess, code: int) -> None:
    """Shut the scheduler down (kill it after a failure) and remove the pid file."""
    if code == 0:
        scheduler_code = await scheduler.shutdown(config.shutdown_grace_s)
        if scheduler_code != 0:
            log.warning("the scheduler exited with code %d at shutdown", scheduler_code)
    else:
        scheduler.kill()
    if config.pid_file and os.path.exists(config.pid_file):
        os.unlink(config.pid_file)  # a stale pid would point py-spy at another process


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    config = parse_args(argv)
    try:
        import uvloop
    except ImportError:
        return asyncio.run(run(config))
    return uvloop.run(run(config))
