"""The OpenAI error object (``{"error": {"message", "type", "param", "code"}}``) and the HTTP
status of each internal error code."""

from __future__ import annotations

import msgspec
from starlette.responses import Response

from frontend.api import replies


class ErrorBody(msgspec.Struct, kw_only=True):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorObject(msgspec.Struct, kw_only=True):
    error: ErrorBody


class ApiError(Exception):
    """Raised by a handler; becomes the error object with ``status``."""

    def __init__(self, status: int, message: str, code: str | None = None, param: str | None = None):
        super().__init__(message)
        self.status = status
        self.code = code
        self.param = param

    @property
    def type(self) -> str:
        if self.status == 401:
            return "authentication_error"
        if self.status == 404:
            return "not_found_error"
        return "invalid_request_error" if self.status < 500 else "server_error"

    def body(self) -> ErrorObject:
        return ErrorObject(
            error=ErrorBody(message=str(self), type=self.type, param=self.param, code=self.code)
        )

    def response(self) -> Response:
        headers = {"WWW-Authenticate": "Bearer"} if self.status == 401 else None
        return Response(
            msgspec.json.encode(self.body()),
            self.status,
            headers=headers,
            media_type="application/json",
        )


# Internal Error.code -> (HTTP status, OpenAI code).
_STATUS = {
    replies.BAD_REQUEST: (400, None),
    replies.CONTEXT_LENGTH: (400, "context_length_exceeded"),
    replies.SCHEDULER_ERROR: (400, None),  # the scheduler refuses requests it cannot hold
    replies.UNAUTHORIZED: (401, "invalid_api_key"),
    replies.SCHEDULER_DIED: (503, None),
    replies.SHUTTING_DOWN: (503, None),
    replies.INTERNAL: (500, None),
}


def from_reply(error: replies.Error) -> ApiError:
    status, code = _STATUS.get(error.code, (500, None))
    return ApiError(status, error.message, code or error.code)
