"""Messages from the scheduler to the frontend (scheduler PUSH -> frontend PULL)."""

from __future__ import annotations

from typing import Literal, Union

import msgspec

from scheduler.messages.codec import Codec

PROTOCOL_VERSION = 1

# The scheduler sends a Heartbeat at least this often once Ready is sent; any message counts as one.
HEARTBEAT_INTERVAL_S = 1.0

# "stop": an EOS id was sampled (it is the last id of token_ids), or the request's grammar is
# complete; "length": max_tokens reached; "abort": the scheduler gave the request up on its own (it never needs to answer AbortRequest).
FinishReason = Literal["stop", "length", "abort"]

StatValue = Union[bool, int, float, str, None]


class TokenUpdate(msgspec.Struct, frozen=True, kw_only=True):
    """New tokens of one request since its previous update. ``prompt_tokens`` and
    ``cached_prompt_tokens`` (prompt tokens served from the prefix cache) are exact on the first
    update of a request and repeated after."""

    rid: str
    token_ids: list[int]
    finished: bool = False
    finish_reason: FinishReason | None = None  # set exactly when finished
    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0


class ModelInfo(msgspec.Struct, frozen=True, kw_only=True):
    name: str
    tokenizer_path: str  # a directory with tokenizer.json (and tokenizer_config.json, if any)
    max_context_tokens: int  # prompt + generated tokens of one request
    vocab_size: int
    eos_token_ids: list[int]


class _Message(msgspec.Struct, frozen=True, kw_only=True, tag_field="type"):
    v: int = PROTOCOL_VERSION


class Ready(_Message, tag="ready", kw_only=True):
    """Sent once, when the model is loaded and requests are accepted."""

    pid: int
    model: ModelInfo


class TokenBatch(_Message, tag="token_batch", kw_only=True):
    """One scheduler step's output: an update per request that produced tokens or finished."""

    updates: list[TokenUpdate]


class RequestError(_Message, tag="request_error", kw_only=True):
    """The scheduler rejected or failed ``rid``; it holds nothing for it any more."""

    rid: str
    message: str
    internal: bool = False  # the request failed inside a step (a bug); the scheduler serves on


class StatsReply(_Message, tag="stats_reply", kw_only=True):
    nonce: int
    stats: dict[str, StatValue]


class Heartbeat(_Message, tag="heartbeat", kw_only=True):
    """Sent by a thread of its own, so it keeps coming during a long step."""

    pid: int
    time: float  # time.time() when sent
    step_s: float = 0.0  # how long the step in progress has run; 0 between steps


FromScheduler = Union[Ready, TokenBatch, RequestError, StatsReply, Heartbeat]

codec: Codec[FromScheduler] = Codec(FromScheduler, PROTOCOL_VERSION, "scheduler->frontend")
encode = codec.encode
decode = codec.decode
