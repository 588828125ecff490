"""The Starlette application: routes, the API-key check, and every failure as its API's error
object (a handler's ApiError, an unknown path, a bug): Anthropic's under /v1/messages, OpenAI's
elsewhere, so the server keeps serving and each client reads its errors."""

from __future__ import annotations

import hmac
import logging

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from frontend.http import messages_objects, routes
from frontend.http.context import HttpContext
from frontend.http.errors import ApiError

log = logging.getLogger("sluice.http")

OPEN_PATHS = frozenset({"/health"})  # load balancers probe it without a key
MESSAGES = "/v1/messages"


def error_response(path: str, exc: ApiError) -> Response:
    if path == MESSAGES or path.startswith(MESSAGES + "/"):
        return messages_objects.error_response(exc)
    return exc.response()


class ApiKey:
    """401 for a request without ``Authorization: Bearer KEY`` or ``x-api-key: KEY`` (Anthropic's
    clients send the latter); paths in OPEN_PATHS excepted."""

    def __init__(self, app: ASGIApp, key: str) -> None:
        self.app = app
        self._bearer, self._key = f"Bearer {key}".encode(), key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] not in OPEN_PATHS:
            headers = dict(scope["headers"])
            if not (hmac.compare_digest(headers.get(b"authorization", b""), self._bearer)
                    or hmac.compare_digest(headers.get(b"x-api-key", b""), self._key)):
                error = ApiError(401, "missing or wrong API key (send Authorization: Bearer KEY or "
                                 "x-api-key: KEY)", "invalid_api_key")
                await error_response(scope["path"], error)(scope, receive, send)
                return
        await self.app(scope, receive, send)


async def _api_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, ApiError)
    return error_response(request.url.path, exc)


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    return error_response(request.url.path, ApiError(
        exc.status_code, f"{request.method} {request.url.path}: {exc.detail}"))


async def _gone(request: Request, exc: Exception) -> Response:
    return Response(status_code=499)  # nginx's "client closed request"; nobody reads it


async def _bug(request: Request, exc: Exception) -> Response:
    log.error("failed to handle %s %s", request.method, request.url.path, exc_info=exc)
    return error_response(request.url.path, ApiError(500, "internal error"))


def build_app(ctx: HttpContext) -> ASGIApp:
    app = Starlette(
        routes=[
            Route("/v1/chat/completions", routes.chat_completions, methods=["POST"]),
            Route("/v1/completions", routes.text_completions, methods=["POST"]),
            Route("/v1/responses", routes.responses, methods=["POST"]),
            Route(MESSAGES, routes.messages, methods=["POST"]),
            Route(MESSAGES + "/count_tokens", routes.count_tokens, methods=["POST"]),
            Route("/v1/models", routes.models, methods=["GET"]),
            Route("/health", routes.health, methods=["GET"]),
            Route("/metrics", routes.metrics, methods=["GET"]),
        ],
        exception_handlers={ApiError: _api_error, HTTPException: _http_error,
                            ClientDisconnect: _gone, Exception: _bug},
    )
    app.state.ctx = ctx
    return ApiKey(app, ctx.api_key) if ctx.api_key else app
