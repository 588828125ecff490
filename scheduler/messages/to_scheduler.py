"""Messages from the frontend to the scheduler (frontend PUSH -> scheduler PULL)."""

from __future__ import annotations

from typing import Annotated, Union

import msgspec

from scheduler.messages.codec import Codec

# 2: TokenizedRequest.grammar (a scheduler of version 1 would ignore it and not constrain the output)
PROTOCOL_VERSION = 2

NonNegInt = Annotated[int, msgspec.Meta(ge=0)]
_INT64_MAX = 2**63 - 1


class SamplingParams(msgspec.Struct, frozen=True, kw_only=True):
    """How a request samples: the one definition, read by the frontend (which fills every field
    from the request and the model's generation defaults), the scheduler and the worker's sampler."""

    temperature: Annotated[float, msgspec.Meta(ge=0.0)] = 0.0  # 0 means greedy (argmax)
    top_k: NonNegInt = 0  # 0 means no top-k cut
    top_p: Annotated[float, msgspec.Meta(gt=0.0, le=1.0)] = 1.0
    seed: int | None = None  # None: the scheduler draws one (an engine driven directly uses 0)

    def validate(self) -> None:
        """What the sampler's tensors can hold (finite floats, ints that fit int64), checked again
        on the scheduler's side: a frame built in Python skips the decoder's constraints."""
        if not 0 <= self.temperature < float("inf"):
            raise ValueError(f"temperature must be finite and >= 0, got {self.temperature}")
        if not 0 <= self.top_k <= _INT64_MAX:
            raise ValueError(f"top_k must be in [0, 2**63 - 1], got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")


class Grammar(msgspec.Struct, frozen=True, kw_only=True):
    """A constraint on the output, in llguidance's Lark dialect (a JSON schema is ``start: %json
    {...}``): the scheduler masks every token the grammar does not allow, and the request finishes
    ("stop") when the grammar is complete. ``what`` names it for errors ("response_format
    json_schema", "tool_choice required")."""

    lark: Annotated[str, msgspec.Meta(min_length=1)]
    what: str = "grammar"


class _Message(msgspec.Struct, frozen=True, kw_only=True, tag_field="type"):
    v: int = PROTOCOL_VERSION


class TokenizedRequest(_Message, tag="tokenized_request", kw_only=True):
    """A validated request: ``len(input_ids) + max_tokens <= max_context_tokens`` (from ``Ready``)
    and ``max_tokens >= 1`` already hold. ``rid`` is unique among the frontend's live requests."""

    rid: str
    input_ids: list[NonNegInt]
    sampling: SamplingParams = SamplingParams()
    max_tokens: Annotated[int, msgspec.Meta(ge=1)]
    eos_token_ids: list[NonNegInt] = []
    ignore_eos: bool = False
    grammar: Grammar | None = None  # constrained decoding (the scheduler refuses one it cannot compile)


class AbortRequest(_Message, tag="abort_request", kw_only=True):
    """Stop generating ``rid`` and free its pages. The frontend has already forgotten ``rid``;
    updates for it still in flight are ignored, and an unknown ``rid`` is not an error."""

    rid: str


class StatsRequest(_Message, tag="stats_request", kw_only=True):
    nonce: int  # echoed in StatsReply so the frontend can match concurrent requests


class Shutdown(_Message, tag="shutdown", kw_only=True):
    """Finish nothing, free the device and exit 0. The frontend kills the process after a grace
    period if it is still alive."""


ToScheduler = Union[TokenizedRequest, AbortRequest, StatsRequest, Shutdown]

codec: Codec[ToScheduler] = Codec(ToScheduler, PROTOCOL_VERSION, "frontend->scheduler")
encode = codec.encode
decode = codec.decode
