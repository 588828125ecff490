"""uvicorn inside the frontend's own event loop: the socket is bound up front (so a busy port
fails start-up at once and ``--http-port 0`` learns its port), and the frontend, not uvicorn,
owns the signals."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from typing import Iterator

import uvicorn

from frontend.http.app import build_app
from frontend.http.context import HttpContext


class _EmbeddedServer(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield  # the frontend's handlers stop everything, this server included


class HttpServer:
    def __init__(self, ctx: HttpContext, host: str, port: int) -> None:
        self.ctx = ctx
        self._socket = socket.create_server((host, port), family=_family(host), reuse_port=False)
        config = uvicorn.Config(build_app(ctx), loop="none", lifespan="off", log_config=None,
                                access_log=False, timeout_graceful_shutdown=1)
        self._server = _EmbeddedServer(config)
        self._task: asyncio.Task | None = None

    @property
    def url(self) -> str:
        host, port = self._socket.getsockname()[:2]
        return f"http://{f'[{host}]' if ':' in host else host}:{port}"

    def start(self) -> None:
        self._task = asyncio.create_task(self._server.serve(sockets=[self._socket]))

    async def stop(self) -> None:
        if self._task is None:
            self._socket.close()
            return
        self._server.should_exit = True
        await asyncio.gather(self._task, return_exceptions=True)
        self._socket.close()


def _family(host: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in host else socket.AF_INET
