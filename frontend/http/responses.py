"""OpenAI response bodies (chat completion, text completion, their stream chunks, usage, models)
as msgspec Structs, and their builders from the frontend's ``Chunk`` replies."""

from __future__ import annotations

import time
import uuid
from typing import Literal

import msgspec

from frontend.api.replies import Usage as InternalUsage
from frontend.http.responses_objects import CachedTokens  # the prompt's usage details, as /v1/responses'
from frontend.http.schemas import CalledFunction, ToolCall  # a reply's calls, as the next request sends them back
from frontend.http.tool_calls import ParsedCall


class _Out(msgspec.Struct, kw_only=True):
    pass


class Usage(_Out, kw_only=True):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: CachedTokens


def usage(u: InternalUsage) -> Usage:
    return Usage(prompt_tokens=u.prompt_tokens, completion_tokens=u.completion_tokens,
                 total_tokens=u.prompt_tokens + u.completion_tokens,
                 prompt_tokens_details=CachedTokens(cached_tokens=u.cached_prompt_tokens))


class StreamedFunction(_Out, kw_only=True, omit_defaults=True):
    name: str | None = None  # in a call's first delta
    arguments: str | None = None


class StreamedToolCall(_Out, kw_only=True, omit_defaults=True):
    """One delta of a call: the first carries its id, type and name, the next pieces of its
    arguments (or the whole call in one delta)."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: StreamedFunction


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def tool_call(call: ParsedCall, index: int | None = None) -> ToolCall | StreamedToolCall:
    """A whole call, in a message or (``index`` given) as one delta."""
    if index is None:
        return ToolCall(id=new_call_id(), function=CalledFunction(name=call.name, arguments=call.arguments))
    return StreamedToolCall(index=index, id=new_call_id(), type="function",
                            function=StreamedFunction(name=call.name, arguments=call.arguments))


class AssistantMessage(_Out, kw_only=True):
    role: Literal["assistant"] = "assistant"
    content: str | None
    reasoning_content: str | None = None
    tool_calls: list[ToolCall] | None = None


class ChatChoice(_Out, kw_only=True):
    index: int = 0
    message: AssistantMessage
    finish_reason: str
    logprobs: None = None


class Delta(_Out, kw_only=True, omit_defaults=True):
    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[StreamedToolCall] | None = None


class ChatChunkChoice(_Out, kw_only=True):
    index: int = 0
    delta: Delta
    finish_reason: str | None = None
    logprobs: None = None


class TextChoice(_Out, kw_only=True):
    index: int = 0
    text: str
    finish_reason: str | None = None
    logprobs: None = None


class Completion(_Out, kw_only=True):
    """One body type for the four shapes: chat or text, whole or one stream chunk."""

    id: str
    object: Literal["chat.completion", "chat.completion.chunk", "text_completion"]
    created: int
    model: str
    choices: list[ChatChoice] | list[ChatChunkChoice] | list[TextChoice]
    usage: Usage | None = None


class ResponseIds(msgspec.Struct, frozen=True):
    """What every body and chunk of one response repeats."""

    id: str
    created: int
    model: str

    @classmethod
    def new(cls, prefix: str, model: str) -> ResponseIds:
        return cls(f"{prefix}-{uuid.uuid4().hex}", int(time.time()), model)

    def body(self, object_: str, choices: list, usage_: Usage | None = None) -> Completion:
        return Completion(id=self.id, object=object_, created=self.created, model=self.model,
                          choices=choices, usage=usage_)


class ModelCard(_Out, kw_only=True):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "sluice"
    max_model_len: int


class ModelList(_Out, kw_only=True):
    object: Literal["list"] = "list"
    data: list[ModelCard]
