"""``/v1/responses`` reply bodies as msgspec Structs: the response object, its output items, usage,
and the typed stream events, each tagged with its ``type`` as OpenAI spells it."""

from __future__ import annotations

from typing import Any, Literal, Union

import msgspec

from frontend.api.replies import Usage as InternalUsage

ItemStatus = Literal["in_progress", "completed", "incomplete"]


class _Out(msgspec.Struct, kw_only=True):
    pass


class OutputText(_Out, kw_only=True, tag_field="type", tag="output_text"):
    text: str
    annotations: list = []


class MessageOut(_Out, kw_only=True, tag_field="type", tag="message"):
    id: str
    role: Literal["assistant"] = "assistant"
    status: ItemStatus
    content: list[OutputText]


class FunctionCallOut(_Out, kw_only=True, tag_field="type", tag="function_call", omit_defaults=True):
    id: str
    call_id: str
    name: str
    arguments: str
    status: ItemStatus
    namespace: str | None = None  # of a function declared in a namespace tool


class ReasoningText(_Out, kw_only=True, tag_field="type", tag="reasoning_text"):
    text: str


class ReasoningOut(_Out, kw_only=True, tag_field="type", tag="reasoning"):
    """The model's own reasoning (``<think>``), in full: there is no summary."""

    id: str
    summary: list = []
    content: list[ReasoningText]
    status: ItemStatus


TextItem = Union[MessageOut, ReasoningOut]  # an item of one text part, streamed as deltas
OutputItem = Union[MessageOut, ReasoningOut, FunctionCallOut]


class TextFormatOut(_Out, kw_only=True, frozen=True, omit_defaults=True):
    type: str = "text"  # text, json_object or json_schema, as requested
    name: str | None = None
    schema: dict[str, Any] | None = None
    strict: bool | None = None


class TextConfigOut(_Out, kw_only=True):
    format: TextFormatOut = TextFormatOut()


class CachedTokens(_Out, kw_only=True):
    """The prompt's usage details in both OpenAI APIs (Chat's ``prompt_tokens_details``)."""

    cached_tokens: int  # prompt tokens served from the prefix cache


class OutputTokensDetails(_Out, kw_only=True):
    reasoning_tokens: int


class Usage(_Out, kw_only=True):
    input_tokens: int
    input_tokens_details: CachedTokens
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int


def usage(u: InternalUsage, reasoning_tokens: int) -> Usage:
    # No cache_write_tokens: the scheduler reports the prompt tokens it read from its prefix cache,
    # not the ones it wrote.
    return Usage(input_tokens=u.prompt_tokens,
                 input_tokens_details=CachedTokens(cached_tokens=u.cached_prompt_tokens),
                 output_tokens=u.completion_tokens,
                 output_tokens_details=OutputTokensDetails(reasoning_tokens=reasoning_tokens),
                 total_tokens=u.prompt_tokens + u.completion_tokens)


class IncompleteDetails(_Out, kw_only=True):
    reason: Literal["max_output_tokens"]


class ErrorInfo(_Out, kw_only=True):
    code: str
    message: str


class ResponseObject(_Out, kw_only=True):
    id: str
    object: Literal["response"] = "response"
    created_at: int
    status: Literal["in_progress", "completed", "incomplete", "failed"]
    error: ErrorInfo | None = None
    incomplete_details: IncompleteDetails | None = None
    model: str
    instructions: str | None
    output: list[OutputItem]
    parallel_tool_calls: bool
    tool_choice: str | dict[str, Any]  # as the request sent it
    tools: list[dict[str, Any]]  # as declared, less the hosted tools that were dropped
    max_output_tokens: int | None
    temperature: float | None
    top_p: float | None
    metadata: dict[str, str]
    text: TextConfigOut
    store: bool = False
    usage: Usage | None


# ==== stream events ====

class Event(_Out, kw_only=True, tag_field="type"):
    sequence_number: int


class _ResponseEvent(Event, kw_only=True):
    response: ResponseObject


class Created(_ResponseEvent, tag="response.created"):
    pass


class InProgress(_ResponseEvent, tag="response.in_progress"):
    pass


class Completed(_ResponseEvent, tag="response.completed"):
    pass


class Incomplete(_ResponseEvent, tag="response.incomplete"):
    pass


class Failed(_ResponseEvent, tag="response.failed"):
    pass


class ItemAdded(Event, kw_only=True, tag="response.output_item.added"):
    output_index: int
    item: OutputItem


class ItemDone(Event, kw_only=True, tag="response.output_item.done"):
    output_index: int
    item: OutputItem


class _PartEvent(Event, kw_only=True):
    item_id: str
    output_index: int
    content_index: int = 0  # a message or reasoning item has one part, its text


class PartAdded(_PartEvent, kw_only=True, tag="response.content_part.added"):
    part: OutputText | ReasoningText


class PartDone(_PartEvent, kw_only=True, tag="response.content_part.done"):
    part: OutputText | ReasoningText


class TextDelta(_PartEvent, kw_only=True, tag="response.output_text.delta"):
    delta: str
    logprobs: list = []


class TextDone(_PartEvent, kw_only=True, tag="response.output_text.done"):
    text: str
    logprobs: list = []


class ReasoningDelta(_PartEvent, kw_only=True, tag="response.reasoning_text.delta"):
    delta: str


class ReasoningDone(_PartEvent, kw_only=True, tag="response.reasoning_text.done"):
    text: str


class ArgumentsDelta(Event, kw_only=True, tag="response.function_call_arguments.delta"):
    item_id: str
    output_index: int
    delta: str


class ArgumentsDone(Event, kw_only=True, tag="response.function_call_arguments.done"):
    item_id: str
    output_index: int
    arguments: str
