"""``/v1/messages`` reply bodies as msgspec Structs: the message, its content blocks, usage, the
stream events (each tagged with its ``type`` as Anthropic spells it) and Anthropic's error shape."""

from __future__ import annotations

from typing import Any, Literal, Union

import msgspec
from starlette.responses import Response

from frontend.api.replies import Usage as InternalUsage
from frontend.http.errors import ApiError

StopReason = Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"]


class _Out(msgspec.Struct, kw_only=True):
    pass


class TextOut(_Out, kw_only=True, tag_field="type", tag="text"):
    text: str


class ToolUseOut(_Out, kw_only=True, tag_field="type", tag="tool_use"):
    id: str
    name: str
    input: dict[str, Any]


class ThinkingOut(_Out, kw_only=True, tag_field="type", tag="thinking"):
    thinking: str
    signature: str


Block = Union[TextOut, ToolUseOut, ThinkingOut]


class Usage(_Out, kw_only=True):
    """Anthropic's split: ``input_tokens`` are the prompt tokens not read from the cache, so that
    a client adding the three input counts gets the prompt's length."""

    input_tokens: int
    output_tokens: int
    cache_read_input_tokens: int = 0
    cache_creation_input_tokens: int = 0


def usage(u: InternalUsage) -> Usage:
    return Usage(input_tokens=u.prompt_tokens - u.cached_prompt_tokens, output_tokens=u.completion_tokens,
                 cache_read_input_tokens=u.cached_prompt_tokens)


class MessageOut(_Out, kw_only=True, tag_field="type", tag="message"):
    id: str
    role: Literal["assistant"] = "assistant"
    model: str
    content: list[Block]
    stop_reason: StopReason | None = None
    stop_sequence: str | None = None
    usage: Usage


class TokenCount(_Out, kw_only=True):
    input_tokens: int


# ==== stream events ====

class TextDelta(_Out, kw_only=True, tag_field="type", tag="text_delta"):
    text: str


class InputJsonDelta(_Out, kw_only=True, tag_field="type", tag="input_json_delta"):
    partial_json: str


class ThinkingDelta(_Out, kw_only=True, tag_field="type", tag="thinking_delta"):
    thinking: str


class SignatureDelta(_Out, kw_only=True, tag_field="type", tag="signature_delta"):
    signature: str


class StopDelta(_Out, kw_only=True):
    stop_reason: StopReason
    stop_sequence: str | None


class _Event(_Out, kw_only=True, tag_field="type"):
    pass


class MessageStart(_Event, kw_only=True, tag="message_start"):
    message: MessageOut


class _BlockEvent(_Event, kw_only=True):
    index: int  # the content block's place in the message


class BlockStart(_BlockEvent, kw_only=True, tag="content_block_start"):
    content_block: Block


class BlockDelta(_BlockEvent, kw_only=True, tag="content_block_delta"):
    delta: Union[TextDelta, InputJsonDelta, ThinkingDelta, SignatureDelta]


class BlockStop(_BlockEvent, kw_only=True, tag="content_block_stop"):
    pass


class MessageDelta(_Event, kw_only=True, tag="message_delta"):
    delta: StopDelta
    usage: Usage


class MessageStop(_Event, kw_only=True, tag="message_stop"):
    pass


class Ping(_Event, kw_only=True, tag="ping"):
    pass


Event = Union[MessageStart, BlockStart, BlockDelta, BlockStop, MessageDelta, MessageStop, Ping]


# ==== errors ====

class ErrorInfo(_Out, kw_only=True):
    type: str
    message: str


class ErrorEvent(_Event, kw_only=True, tag="error"):
    """The error body, whole or as the ``error`` event of a stream that had started."""

    error: ErrorInfo


_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error",
                503: "overloaded_error"}


def error(exc: ApiError) -> ErrorEvent:
    kind = _ERROR_TYPES.get(exc.status, "invalid_request_error" if exc.status < 500 else "api_error")
    return ErrorEvent(error=ErrorInfo(type=kind, message=str(exc)))


def error_response(exc: ApiError) -> Response:
    headers = {"WWW-Authenticate": "Bearer"} if exc.status == 401 else None
    return Response(msgspec.json.encode(error(exc)), exc.status, headers=headers,
                    media_type="application/json")
