"""``/v1/responses`` requests (OpenAI's Responses API, stateless): the body, the refusals, and the
adapter to a Chat request, so that a Responses request reaches the one internal ``Generate``
through Chat's conversion (model check, tools, chat template, sampling ranges) and no other.

Fields are typed at the top level and unknown ones refused by name; input items and tools are
read by their ``type``, since clients send back the items of earlier replies with every field
those had (ids, statuses, annotations) and declare hosted tools with their own settings."""

from __future__ import annotations

import logging
import time
import uuid
from typing import Any, Literal

import msgspec

from frontend.http.errors import ApiError
from frontend.http.harmony.render import EFFORTS as HARMONY_EFFORTS
from frontend.http.responses_objects import ResponseObject, TextConfigOut, TextFormatOut
from frontend.http.schemas import (CalledFunction, ChatRequest, FunctionDef, Message, NamedFunction,
                                   NamedToolChoice, Tool, ToolCall)

log = logging.getLogger("sluice.http")

# Tools that OpenAI runs on its side; clients (Codex, agents) declare some on every request.
HOSTED_TOOLS = ("web_search", "file_search", "computer", "code_interpreter", "image_generation",
                "mcp", "tool_search")
TEXT_PARTS = ("input_text", "output_text", "text")


class _In(msgspec.Struct, kw_only=True):
    pass


class TextFormat(_In, kw_only=True):
    type: str  # text, json_object or json_schema (with name, schema, strict)
    name: str | None = None
    schema: dict[str, Any] | None = None
    strict: bool | None = None
    description: str | None = None

    def response_format(self) -> dict[str, Any]:
        """Chat's ``response_format`` for it (``frontend.http.constrain`` reads that)."""
        if self.type != "json_schema":
            return {"type": self.type}
        return {"type": "json_schema", "json_schema": {"name": self.name, "schema": self.schema, "strict": self.strict}}


class TextConfig(_In, kw_only=True):
    format: TextFormat | None = None
    verbosity: str | None = None


class Reasoning(_In, kw_only=True):
    effort: str | None = None
    summary: str | None = None  # what is reported, not what is generated: accepted
    generate_summary: str | None = None


class ResponsesRequest(_In, kw_only=True, forbid_unknown_fields=True):
    model: str
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None  # accepted; the model decides how many calls it makes
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool = False
    text: TextConfig | None = None
    reasoning: Reasoning | None = None
    # Accepted: they do not change the output.
    metadata: dict[str, str] | None = None
    client_metadata: dict[str, Any] | None = None  # Codex's ids of its session and turn
    user: str | None = None
    store: bool | None = None  # only false: nothing is stored
    include: list[str] | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    safety_identifier: str | None = None
    service_tier: str | None = None
    stream_options: dict[str, Any] | None = None
    truncation: Literal["auto", "disabled"] | None = None  # "auto" is refused
    # Declared only to be refused when set.
    previous_response_id: str | None = None
    conversation: str | dict[str, Any] | None = None
    prompt: dict[str, Any] | None = None
    background: bool | None = None
    max_tool_calls: int | None = None
    top_logprobs: int | None = None
    context_management: list[dict[str, Any]] | None = None


class _Part(_In, kw_only=True):
    type: str
    text: str | None = None
    refusal: str | None = None


class _MessageItem(_In, kw_only=True):
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[_Part]


class _FunctionCall(_In, kw_only=True):
    call_id: str
    name: str
    arguments: str


class _FunctionCallOutput(_In, kw_only=True):
    call_id: str
    output: str | list[_Part]


class _ReasoningItem(_In, kw_only=True):
    content: list[_Part] | None = None


class _FunctionTool(_In, kw_only=True):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class _NamespaceTool(_In, kw_only=True):
    name: str
    tools: list[dict[str, Any]]


def check(body: ResponsesRequest, harmony: bool = False) -> None:
    """Every field that would change the output and is not implemented is refused by name
    (``harmony``: for gpt-oss, whose reasoning effort is low, medium or high)."""
    stateless = "stateless: {} is not supported; send the whole conversation in input"
    for name in ("previous_response_id", "conversation", "prompt"):
        if getattr(body, name) is not None:
            raise ApiError(400, stateless.format(name), param=name)
    if body.store:
        raise ApiError(400, "stateless: store is not supported (send store: false)", param="store")
    if body.text is not None and body.text.verbosity not in (None, "medium"):
        raise ApiError(400, "text.verbosity is not supported (only 'medium', the default)",
                       param="text.verbosity")
    _check_effort(_effort(body), harmony)
    if body.top_logprobs:
        raise ApiError(400, "top_logprobs: logprobs are not supported", param="top_logprobs")
    if "message.output_text.logprobs" in (body.include or []):
        raise ApiError(400, "include 'message.output_text.logprobs': logprobs are not supported",
                       param="include")
    if body.truncation == "auto":
        raise ApiError(400, "truncation 'auto' is not supported: an input longer than the "
                       "context is refused, never cut", param="truncation")
    for name in ("background", "max_tool_calls", "context_management"):
        if getattr(body, name):
            raise ApiError(400, f"{name} is not supported", param=name)


def _check_effort(effort: str | None, harmony: bool) -> None:
    if harmony and effort not in (None, *HARMONY_EFFORTS):
        raise ApiError(400, f"reasoning.effort {effort!r} is not supported by gpt-oss's harmony format "
                       f"({', '.join(HARMONY_EFFORTS)}: it always reasons)", param="reasoning.effort")
    if not harmony and effort not in (None, "medium", "none"):
        # "none" is Chat's reasoning_effort (thinking off); a budget is not built.
        raise ApiError(400, f"reasoning.effort {effort!r} is not supported (only 'medium', "
                       "the default, and 'none')", param="reasoning.effort")


def to_chat(body: ResponsesRequest, harmony: bool = False) -> ChatRequest:
    """The Chat request that asks for the same output (``harmony``: from gpt-oss, whose reasoning
    effort is harmony's); raises ApiError for what it cannot."""
    check(body, harmony)
    effort = _effort(body)
    messages = [Message(role="system", content=body.instructions)] if body.instructions else []
    messages += input_messages(body.input, harmony)
    return ChatRequest(model=body.model, messages=messages, tools=chat_tools(body.tools) or None,
                       tool_choice=_tool_choice(body.tool_choice), response_format=_format(body),
                       max_completion_tokens=body.max_output_tokens, temperature=body.temperature,
                       top_p=body.top_p, stream=body.stream,
                       reasoning_effort=effort if harmony or effort == "none" else None)


def _effort(body: ResponsesRequest) -> str | None:
    return body.reasoning.effort if body.reasoning is not None else None


def _format(body: ResponsesRequest) -> dict[str, Any] | None:
    fmt = body.text.format if body.text is not None else None
    return fmt.response_format() if fmt is not None else None


def _tool_choice(choice: str | dict[str, Any] | None) -> str | NamedToolChoice:
    """Chat's tool_choice: "required" and ``{"type": "function", "name": ...}`` force a call
    (constrained decoding); hosted and allowed-tools choices are refused."""
    if choice in (None, "auto", "none", "required"):
        return choice or "auto"
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return NamedToolChoice(type="function", function=NamedFunction(name=choice["name"]))
    what = repr(choice) if isinstance(choice, str) else f"of type {choice.get('type')!r}"
    raise ApiError(400, f"tool_choice {what} is not supported (auto, none, required, or a function by "
                   "name)", param="tool_choice")


def chat_tools(tools: list[dict[str, Any]] | None) -> list[Tool]:
    """Function tools as Chat declares them, a namespace's functions among them under their own
    names (the reply names the namespace of a call again); hosted tools are dropped with one log
    line."""
    out: list[Tool] = []
    dropped = []
    for i, tool in enumerate(tools or []):
        kind = tool.get("type")
        if kind == "namespace":
            ns = _typed(tool, _NamespaceTool, f"tools[{i}]")
            out += [_function(t, f"tools[{i}].tools[{j}]") for j, t in enumerate(ns.tools)]
        elif _hosted(tool):
            dropped.append(kind)
        else:
            out.append(_function(tool, f"tools[{i}]"))
    names = [t.function.name for t in out]
    if len(set(names)) < len(names):
        raise ApiError(400, "two tools have one name (a namespace's functions are given to the "
                       "model under their own names)", param="tools")
    if dropped:
        log.info("responses: dropped hosted tools %s (Sluice runs none)", ", ".join(dropped))
    return out


def _hosted(tool: dict[str, Any]) -> bool:
    return str(tool.get("type")).startswith(HOSTED_TOOLS)


def _function(tool: dict[str, Any], where: str) -> Tool:
    if tool.get("type") != "function":
        raise ApiError(400, f"{where} of type {tool.get('type')!r} is not supported (function "
                       "tools are; hosted tools are dropped)", param=where)
    f = _typed(tool, _FunctionTool, where)
    return Tool(type="function", function=FunctionDef(
        name=f.name, description=f.description, parameters=f.parameters, strict=f.strict))


def declared_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    """The tools a reply repeats: those declared, less the hosted ones it dropped."""
    return [t for t in tools or [] if not _hosted(t)]


def input_messages(input_: str | list[dict[str, Any]], harmony: bool = False) -> list[Message]:
    """Input items as Chat messages: a ``function_call`` joins the assistant message before it
    (or starts one), a ``function_call_output`` is a tool message for the call with its id. With
    ``harmony``, a ``reasoning`` item's text is the next assistant message's reasoning (harmony's
    analysis, which it keeps before a tool result and drops once a final answer closed the turn)."""
    if isinstance(input_, str):
        return [Message(role="user", content=input_)]
    conversation = _Conversation(harmony)
    for i, item in enumerate(input_):
        conversation.add(item, f"input[{i}]")
    if not conversation.messages:
        raise ApiError(400, "input has no message", param="input")
    return conversation.messages


class _Conversation:
    """The Chat messages of the input items read so far."""

    def __init__(self, harmony: bool) -> None:
        self.harmony = harmony
        self.messages: list[Message] = []
        self.calls: set[str] = set()  # the call ids an output may answer
        self.thought: str | None = None  # a reasoning item's text, for the assistant message that follows

    def add(self, item: dict[str, Any], where: str) -> None:
        kind = item.get("type", "message")
        if kind == "message":
            self._message(_typed(item, _MessageItem, where), where)
        elif kind == "function_call":
            self._call(_typed(item, _FunctionCall, where))
        elif kind == "function_call_output":
            self._output(_typed(item, _FunctionCallOutput, where), where)
        elif kind == "reasoning":
            # Else dropped: chat templates leave earlier turns' reasoning out of the prompt, and an
            # item from OpenAI carries it encrypted (no content), which no local model can read.
            self.thought = _reasoning_text(item, where) if self.harmony else None
        elif kind == "item_reference":
            raise ApiError(400, f"stateless: {where} item_reference is not supported; send the "
                           "item itself", param=where)
        else:
            raise ApiError(400, f"{where}: input item of type {kind!r} is not supported", param=where)

    def _message(self, m: _MessageItem, where: str) -> None:
        self.messages.append(Message(role=m.role, content=_text(m.content, where)))
        if m.role == "assistant":
            self.messages[-1].reasoning_content, self.thought = self.thought, None

    def _call(self, c: _FunctionCall) -> None:
        call = ToolCall(id=c.call_id, function=CalledFunction(name=c.name, arguments=c.arguments))
        if not self.messages or self.messages[-1].role != "assistant" or self.thought is not None:
            self.messages.append(Message(role="assistant", tool_calls=[], reasoning_content=self.thought))
            self.thought = None
        self.messages[-1].tool_calls = [*(self.messages[-1].tool_calls or []), call]
        self.calls.add(c.call_id)

    def _output(self, o: _FunctionCallOutput, where: str) -> None:
        if o.call_id not in self.calls:
            raise ApiError(400, f"{where}: no function_call with call_id {o.call_id!r} comes "
                           "before this output", param=where)
        self.messages.append(Message(role="tool", tool_call_id=o.call_id, content=_text(o.output, where)))


def _reasoning_text(item: dict[str, Any], where: str) -> str | None:
    """A reasoning item's ``reasoning_text`` parts (as Sluice returns them), None if it has none."""
    parts = _typed(item, _ReasoningItem, where).content or []
    return "".join(p.text or "" for p in parts if p.type == "reasoning_text") or None


def _text(content: str | list[_Part], where: str) -> str:
    if isinstance(content, str):
        return content
    texts = []
    for part in content:
        if part.type not in (*TEXT_PARTS, "refusal"):
            raise ApiError(400, f"{where}: content part of type {part.type!r} is not supported: "
                           "Sluice serves text only", param=where)
        texts.append((part.refusal if part.type == "refusal" else part.text) or "")
    return "".join(texts)


def _typed(item: dict[str, Any], type_: type, where: str) -> Any:
    try:
        return msgspec.convert(item, type_)
    except msgspec.ValidationError as exc:
        raise ApiError(400, f"invalid request: {exc} (in {where})", param=where) from None


def frame(body: ResponsesRequest) -> ResponseObject:
    """The response object before any output: what the reply repeats of the request."""
    return ResponseObject(
        id=f"resp_{uuid.uuid4().hex}", created_at=int(time.time()), status="in_progress",
        model=body.model, instructions=body.instructions, output=[],
        parallel_tool_calls=body.parallel_tool_calls is not False,
        tool_choice=body.tool_choice or "auto",
        tools=declared_tools(body.tools),
        max_output_tokens=body.max_output_tokens, temperature=body.temperature, top_p=body.top_p,
        metadata=body.metadata or {}, text=_text_out(body), usage=None)


def _text_out(body: ResponsesRequest) -> TextConfigOut:
    fmt = body.text.format if body.text is not None else None
    if fmt is None:
        return TextConfigOut()
    return TextConfigOut(format=TextFormatOut(type=fmt.type, name=fmt.name, schema=fmt.schema, strict=fmt.strict))
