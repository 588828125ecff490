"""Messages from a client to the frontend (client DEALER -> frontend ROUTER), one per frame."""

from __future__ import annotations

from typing import Annotated, Union

import msgspec

from scheduler.messages.codec import Codec
from scheduler.messages.to_scheduler import Grammar

API_VERSION = 1

NonNegInt = Annotated[int, msgspec.Meta(ge=0)]
RequestId = Annotated[str, msgspec.Meta(min_length=1, max_length=256)]


class ChatMessage(msgspec.Struct, frozen=True, kw_only=True):
    role: str  # "system", "user", "assistant", ... as the model's chat template knows them
    content: str


class _Message(msgspec.Struct, frozen=True, kw_only=True, tag_field="type"):
    v: int = API_VERSION
    api_key: str | None = None  # required when the server runs with --api-key


class Generate(_Message, tag="generate", kw_only=True):
    """Exactly one of ``prompt`` (raw text, tokenized as is), ``messages`` (rendered with the
    model's chat template, generation prompt added) or ``input_ids`` is given.

    ``max_tokens`` is clamped to the context left after the prompt; a prompt that leaves no room
    for one token is an error, and so is a ``max_tokens`` past the model's whole context. The reply is a ``Chunk`` per scheduler step when ``stream``, else
    one ``Chunk`` at the end; the last one has ``finish_reason`` and ``usage``."""

    rid: RequestId  # chosen by the client, unique among its own live requests
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    input_ids: list[NonNegInt] | None = None
    # None: the model's default (frontend.generation_defaults); every number is checked again by
    # frontend.validate.check_request, against what the engine can hold
    temperature: Annotated[float, msgspec.Meta(ge=0.0)] | None = None  # 0 means greedy
    top_k: NonNegInt | None = None  # 0 means off
    top_p: Annotated[float, msgspec.Meta(gt=0.0, le=1.0)] | None = None
    seed: int | None = None
    max_tokens: Annotated[int, msgspec.Meta(ge=1)] = 256
    stop: list[Annotated[str, msgspec.Meta(min_length=1)]] = []
    # ids that end the request as EOS does, beside the model's own (harmony's <|call|>, <|return|>)
    stop_token_ids: list[NonNegInt] = []
    stream: bool = False
    ignore_eos: bool = False
    grammar: Grammar | None = None  # constrained decoding (the HTTP APIs build it; see frontend.http.grammars)

    def __post_init__(self) -> None:
        given = [n for n in ("prompt", "messages", "input_ids") if getattr(self, n) is not None]
        if len(given) != 1:
            raise ValueError(
                f"exactly one of prompt, messages, input_ids must be given, got {given or 'none'}"
            )
        if not getattr(self, given[0]):
            raise ValueError(f"{given[0]} is empty")


class Abort(_Message, tag="abort", kw_only=True):
    """Abort a live request of this client; it ends with a ``Chunk`` whose finish_reason is
    "abort". Aborting an unknown or finished request does nothing."""

    rid: RequestId


class GetStats(_Message, tag="get_stats", kw_only=True):
    rid: RequestId  # echoed in the Stats reply


class GetInfo(_Message, tag="get_info", kw_only=True):
    """Answered by the frontend at once, never after a scheduler step: a client's first contact
    (is a server there?) and what it should know of the model (``Info``)."""

    rid: RequestId  # echoed in the Info reply


ClientRequest = Union[Generate, Abort, GetStats, GetInfo]

codec: Codec[ClientRequest] = Codec(ClientRequest, API_VERSION, "client->frontend")
encode = codec.encode
decode = codec.decode
