"""The Starlette application: routes, the bearer-key check, and every failure as the OpenAI
error object (a handler's ApiError, an unknown path, a bug), so the server keeps serving."""

from __future__ import annotations

import hmac
import logging

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from frontend.http import routes
from frontend.http.context import HttpContext
from frontend.http.errors import ApiError

log = logging.getLogger("sluice.http")

OPEN_PATHS = frozenset({"/health"})  # load balancers probe it without a key


class BearerKey:
    """401 for a request without ``Authorization: Bearer KEY`` (paths in OPEN_PATHS excepted)."""

    def __init__(self, app: ASGIApp, key: str) -> None:
        self.app = app
        self._expected = f"Bearer {key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] not in OPEN_PATHS:
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(given, self._expected):
                error = ApiError(401, "missing or wrong API key (send Authorization: Bearer KEY)",
                                 "invalid_api_key")
                await error.response()(scope, receive, send)
                return
        await self.app(scope, receive, send)


async def _api_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, ApiError)
    return exc.response()


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    return ApiError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}").response()


async def _gone(request: Request, exc: Exception) -> Response:
    return Response(status_code=499)  # nginx's "client closed request"; nobody reads it


async def _bug(request: Request, exc: Exception) -> Response:
    log.error("failed to handle %s %s", request.method, request.url.path, exc_info=exc)
    return ApiError(500, "internal error").response()


def build_app(ctx: HttpContext) -> ASGIApp:
    app = Starlette(
        routes=[
            Route("/v1/chat/completions", routes.chat_completions, methods=["POST"]),
            Route("/v1/completions", routes.text_completions, methods=["POST"]),
            Route("/v1/responses", routes.responses, methods=["POST"]),
            Route("/v1/models", routes.models, methods=["GET"]),
            Route("/health", routes.health, methods=["GET"]),
            Route("/metrics", routes.metrics, methods=["GET"]),
        ],
        exception_handlers={ApiError: _api_error, HTTPException: _http_error,
                            ClientDisconnect: _gone, Exception: _bug},
    )
    app.state.ctx = ctx
    return BearerKey(app, ctx.api_key) if ctx.api_key else app
