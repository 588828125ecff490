"""Messages from the frontend to a client (frontend ROUTER -> client DEALER), one per frame."""

from __future__ import annotations

from typing import Literal, Union

import msgspec

from frontend.api.requests import API_VERSION
from scheduler.messages.codec import Codec

# "stop": EOS or a stop string; "length": max_tokens (after clamping to the context) reached;
# "abort": aborted by the client or the scheduler; "error" is never in a Chunk, an Error is sent.
FinishReason = Literal["stop", "length", "abort", "error"]

# Error.code values.
BAD_REQUEST = "bad_request"  # malformed frame, wrong field, failed validation
CONTEXT_LENGTH = "context_length"  # no room for one generated token, or max_tokens past the context
DUPLICATE_RID = "duplicate_rid"  # the client already has a live request with this rid
SCHEDULER_ERROR = "scheduler_error"  # the scheduler rejected or failed the request
SCHEDULER_DIED = "scheduler_died"  # the scheduler process exited or stopped answering
SHUTTING_DOWN = "shutting_down"  # the frontend is stopping
UNAUTHORIZED = "unauthorized"  # the server has an --api-key and the request lacks it
INTERNAL = "internal"  # a bug in the frontend; the server keeps serving


class Usage(msgspec.Struct, frozen=True, kw_only=True):
    prompt_tokens: int
    completion_tokens: int  # every sampled token, the EOS that ended the request included
    cached_prompt_tokens: int  # prompt tokens served from the scheduler's prefix cache


class _Message(msgspec.Struct, frozen=True, kw_only=True, tag_field="type"):
    v: int = API_VERSION


class Chunk(_Message, tag="chunk", kw_only=True):
    """New text and token ids of ``rid``. Text is held back while it ends in an incomplete UTF-8
    sequence or could be the start of a stop string, so a chunk may carry ids but no text.
    After a stop string the text is cut before it; ``token_ids`` keeps every sampled id."""

    rid: str
    text: str = ""
    token_ids: list[int] = []
    finish_reason: FinishReason | None = None  # set on the last chunk of a request only
    usage: Usage | None = None  # set on the last chunk of a request only
    matched_stop: str | None = None  # the stop string that ended the request (last chunk only)


class Error(_Message, tag="error", kw_only=True):
    """A request failed (``rid`` set when known); it gets no further reply."""

    rid: str | None
    code: str
    message: str


class Stats(_Message, tag="stats", kw_only=True):
    rid: str
    stats: dict[str, Union[bool, int, float, str, None]]


class Info(_Message, tag="info", kw_only=True):
    """The served model: its name, context, whether it has a chat template, and the sampling that
    a request leaving temperature, top_p and top_k unset gets (its generation_config.json)."""

    rid: str
    model: str
    max_context_tokens: int
    chat_template: bool
    default_temperature: float
    default_top_p: float
    default_top_k: int


class Pending(_Message, tag="pending", kw_only=True):
    """``rid`` is still running. Sent every few seconds for each live request: a client that went
    away is noticed (the send fails) and its request aborted even while no chunk is due. Clients
    skip it."""

    rid: str


ServerReply = Union[Chunk, Error, Stats, Info, Pending]

codec: Codec[ServerReply] = Codec(ServerReply, API_VERSION, "frontend->client")
encode = codec.encode
decode = codec.decode
