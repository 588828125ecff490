"""``/v1/messages`` and ``/v1/messages/count_tokens`` requests (Anthropic's Messages API): the body,
the refusals, and the adapter to a Chat request, so that a Messages request reaches the one internal
``Generate`` through Chat's conversion (model check, tools, chat template, sampling ranges).

Every field is typed and unknown ones are refused by name; content blocks and tools are read by
their ``type``, so that an image, a document or a server tool is refused in one line that says so.

``thinking`` turns the template's reasoning on or off (``enable_thinking``, where it reads it); a
``budget_tokens`` below ``max_tokens`` becomes Chat's ``thinking_token_budget``, which a grammar
holds (``frontend.http.grammars.free_grammar``). gpt-oss (harmony) always reasons: ``thinking``
picks its effort and whether its analysis shows, and a budget caps ``max_tokens``
(``_harmony_thinking`` says why). Thinking blocks sent back are the turn's ``reasoning_content``,
which the template (or harmony: analysis, kept before a tool result, dropped once a final answer
closed the turn) shows or drops as it does any past reasoning."""

from __future__ import annotations

import json
from typing import Any, Literal

import msgspec

from frontend.http.errors import ApiError
from frontend.http.parsers import template_markup
from frontend.http.schemas import (CalledFunction, ChatRequest, FunctionDef, Message, NamedFunction,
                                  NamedToolChoice, Tool, ToolCall)

THINKING_TYPES = ("enabled", "adaptive", "disabled")


class _In(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    pass


class TextBlock(_In, kw_only=True):
    type: Literal["text"]
    text: str
    cache_control: dict[str, Any] | None = None  # accepted: Sluice caches every prefix anyway
    citations: list[dict[str, Any]] | None = None  # accepted: they annotate the text, never change it


class ToolUseBlock(_In, kw_only=True):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]
    cache_control: dict[str, Any] | None = None


class ThinkingBlock(_In, kw_only=True):
    type: Literal["thinking"]
    thinking: str
    signature: str  # Sluice's digest of the text; not checked, as no key signs it


class RedactedThinkingBlock(_In, kw_only=True):
    type: Literal["redacted_thinking"]
    data: str  # Anthropic's encrypted reasoning: no local model can read it, so it is dropped


class ToolResultBlock(_In, kw_only=True):
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[dict[str, Any]] = ""
    is_error: bool = False  # the result's text says what failed; chat templates have no flag for it
    cache_control: dict[str, Any] | None = None


class InputMessage(_In, kw_only=True):
    role: Literal["user", "assistant"]
    content: str | list[dict[str, Any]]


class CustomTool(_In, kw_only=True):
    name: str
    input_schema: dict[str, Any]
    description: str | None = None
    type: Literal["custom"] | None = None
    cache_control: dict[str, Any] | None = None
    eager_input_streaming: bool | None = None  # accepted: how input streams, not what it is
    strict: bool | None = None  # held by a grammar: forced (any, tool) or once a call opens (auto)


class ToolChoice(_In, kw_only=True):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class Thinking(_In, kw_only=True):
    type: str  # enabled, adaptive or disabled; others (between_tools) are refused by name
    budget_tokens: int | None = None
    display: Literal["summarized", "omitted"] | None = None

    @property
    def on(self) -> bool:
        return self.type in ("enabled", "adaptive")


class MessagesPrompt(_In, kw_only=True):
    """What makes the prompt: the body of ``count_tokens``, and the start of every request."""

    model: str
    messages: list[InputMessage]
    system: str | list[TextBlock] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None
    cache_control: dict[str, Any] | None = None  # accepted, as on a block
    # Declared only to be refused when set.
    output_config: dict[str, Any] | None = None
    output_format: dict[str, Any] | None = None
    context_management: dict[str, Any] | None = None
    mcp_servers: list[dict[str, Any]] | None = None
    container: str | dict[str, Any] | None = None


class MessagesRequest(MessagesPrompt, kw_only=True):
    max_tokens: int
    stop_sequences: list[str] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    stream: bool = False
    # Accepted: they do not change the output.
    metadata: dict[str, Any] | None = None
    service_tier: str | None = None
    inference_geo: str | None = None


def check(body: MessagesPrompt) -> None:
    """Every field that would change the output and is not implemented is refused by name."""
    for name in ("output_config", "output_format", "context_management", "mcp_servers", "container"):
        if getattr(body, name):
            raise ApiError(400, f"{name} is not supported", param=name)
    if body.thinking is not None:
        _check_thinking(body.thinking)
    choice = body.tool_choice
    if choice is not None and choice.type in ("any", "tool") and body.thinking is not None and body.thinking.on:
        raise ApiError(400, f"tool_choice {choice.type!r} cannot be used with thinking (as at Anthropic: a "
                       "forced call leaves no room to reason); use 'auto' or 'none'", param="tool_choice")
    if choice is not None and choice.type == "tool" and not choice.name:
        raise ApiError(400, "tool_choice 'tool' needs the tool's name", param="tool_choice.name")
    if choice is not None and choice.disable_parallel_tool_use and choice.type not in ("any", "tool"):
        raise ApiError(400, "tool_choice.disable_parallel_tool_use is not supported with 'auto' (the model "
                       "decides how many calls it makes; 'any' and 'tool' force exactly one)", param="tool_choice")


def _check_thinking(thinking: Thinking) -> None:
    if thinking.type not in THINKING_TYPES:
        raise ApiError(400, f"thinking {thinking.type!r} is not supported (enabled, adaptive or disabled)",
                       param="thinking.type")
    if (thinking.type == "enabled") != (thinking.budget_tokens is not None):
        raise ApiError(400, "thinking.budget_tokens goes with 'enabled', and only with it",
                       param="thinking.budget_tokens")
    if thinking.budget_tokens is not None and thinking.budget_tokens < 1:
        raise ApiError(400, "thinking.budget_tokens must be at least 1", param="thinking.budget_tokens")


def thinking_display(body: MessagesPrompt) -> str | None:
    """How the reply shows the reasoning: None with thinking off (left out, also where the template
    cannot turn it off), "summarized" (whole: Sluice does not summarise) or "omitted"."""
    if body.thinking is None or not body.thinking.on:
        return None
    return body.thinking.display or "summarized"


def _thinking_fields(body: MessagesPrompt, template: str | None) -> dict[str, Any]:
    """Chat's fields for ``thinking``: the template's switch, and the reasoning budget."""
    on = body.thinking is not None and body.thinking.on
    if on and not template_markup(template).reasoning:
        raise ApiError(400, f"thinking {body.thinking.type!r} is not supported for this model: its chat "
                       "template has no reasoning (<think>)", param="thinking")
    fields: dict[str, Any] = {}
    if "enable_thinking" in (template or ""):
        fields["chat_template_kwargs"] = {"enable_thinking": on}
    if on:
        fields["thinking_token_budget"] = body.thinking.budget_tokens
    return fields


def _harmony_thinking(body: MessagesPrompt) -> dict[str, Any]:
    """Chat's fields for ``thinking`` on gpt-oss, whose harmony format has no switch for its
    reasoning (the analysis channel), only an effort: thinking on renders harmony's default effort
    (medium) and the reply shows the analysis as thinking blocks; off (disabled or absent, as
    Anthropic's default is) renders the lowest effort, low, the nearest harmony has to Qwen's
    reasoning off, and the analysis is left out of the reply.

    A ``budget_tokens`` below ``max_tokens`` caps ``max_tokens`` (``_max_tokens``): harmony cannot
    end its analysis at a budget (the Qwen path's budget grammar would force the end of the
    reasoning, and a grammar is refused with harmony), and a budget a server let the reasoning run
    past would break the one promise it makes, that thinking costs at most that many tokens. Held
    as the reply's cap it is kept: a reply that thinks that long ends as any cut reply does
    (stop_reason ``max_tokens``, as at Anthropic when max_tokens falls inside the thinking).
    Refusing it instead would refuse every Anthropic client, which must send a budget below
    max_tokens; a client that wants room for the answer after long thinking sends a larger one."""
    on = body.thinking is not None and body.thinking.on
    return {"reasoning_effort": "medium" if on else "low"}


def _max_tokens(body: MessagesRequest, harmony: bool) -> int:
    """``max_tokens``, capped by a harmony request's thinking budget (``_harmony_thinking``)."""
    budget = body.thinking.budget_tokens if harmony and body.thinking is not None else None
    return body.max_tokens if budget is None else min(body.max_tokens, budget)


def to_chat(body: MessagesPrompt, template: str | None, harmony: bool = False) -> ChatRequest:
    """The Chat request that asks for the same output from a model with chat ``template`` (or, with
    ``harmony``, gpt-oss's format); raises ApiError for what it cannot."""
    check(body)
    messages = [Message(role="system", content=_text(body.system, "system"))] if body.system else []
    for i, m in enumerate(body.messages):
        messages += _turn(m, f"messages[{i}]")
    if body.messages and body.messages[-1].role == "assistant":
        raise ApiError(400, "the last message is the assistant's: continuing it (a prefill) is not "
                       "supported", param="messages")
    sampling: dict[str, Any] = {}
    if isinstance(body, MessagesRequest):
        sampling = dict(max_tokens=_max_tokens(body, harmony), stop=body.stop_sequences,
                        temperature=body.temperature, top_p=body.top_p, top_k=body.top_k, stream=body.stream)
    thinking = _harmony_thinking(body) if harmony else _thinking_fields(body, template)
    return ChatRequest(model=body.model, messages=messages, tools=chat_tools(body.tools) or None,
                       tool_choice=_tool_choice(body.tool_choice), **sampling, **thinking)


def _tool_choice(choice: ToolChoice | None) -> str | NamedToolChoice | None:
    """Chat's tool_choice: ``any`` is "required", ``tool`` names its function (both constrained)."""
    if choice is None or choice.type in ("auto", "none"):
        return choice.type if choice else None
    if choice.type == "any":
        return "required"
    return NamedToolChoice(type="function", function=NamedFunction(name=choice.name))


def chat_tools(tools: list[dict[str, Any]] | None) -> list[Tool]:
    """Custom tools in the OpenAI function form that chat templates render."""
    out = []
    for i, tool in enumerate(tools or []):
        where, kind = f"tools[{i}]", tool.get("type")
        if kind not in (None, "custom"):
            raise ApiError(400, f"{where} of type {kind!r} is not supported: Sluice runs no server "
                           "tools (custom tools are served)", param=where)
        t = _typed(tool, CustomTool, where)
        out.append(Tool(type="function", function=FunctionDef(
            name=t.name, description=t.description, parameters=t.input_schema, strict=t.strict)))
    return out


def _turn(m: InputMessage, where: str) -> list[Message]:
    """One Messages turn as Chat messages: a user turn's tool results are tool messages (in their
    order among its text), an assistant turn's tool uses are its tool calls."""
    if isinstance(m.content, str):
        return [Message(role=m.role, content=m.content)]
    if m.role == "assistant":
        return [_assistant(m.content, where)]
    out: list[Message] = []
    for j, raw in enumerate(m.content):
        block = _block(raw, f"{where}.content[{j}]", (TextBlock, ToolResultBlock))
        if isinstance(block, ToolResultBlock):
            out.append(Message(role="tool", tool_call_id=block.tool_use_id,
                               content=_text(block.content, f"{where}.content[{j}].content")))
        elif out and out[-1].role == "user":
            out[-1].content = f"{out[-1].content}{block.text}"
        else:
            out.append(Message(role="user", content=block.text))
    return out


def _assistant(content: list[dict[str, Any]], where: str) -> Message:
    """An assistant turn: its text, its tool uses as calls, its thinking as the reasoning."""
    texts, calls, thoughts = [], [], []
    allowed = (TextBlock, ToolUseBlock, ThinkingBlock, RedactedThinkingBlock)
    for j, raw in enumerate(content):
        block = _block(raw, f"{where}.content[{j}]", allowed)
        if isinstance(block, TextBlock):
            texts.append(block.text)
        elif isinstance(block, ThinkingBlock):
            thoughts.append(block.thinking)
        elif isinstance(block, ToolUseBlock):
            calls.append(ToolCall(id=block.id, function=CalledFunction(
                name=block.name, arguments=json.dumps(block.input, ensure_ascii=False))))
    return Message(role="assistant", content="".join(texts), tool_calls=calls or None,
                   reasoning_content="\n\n".join(thoughts) if thoughts else None)


BLOCK_TYPES = {"text": TextBlock, "tool_use": ToolUseBlock, "tool_result": ToolResultBlock,
               "thinking": ThinkingBlock, "redacted_thinking": RedactedThinkingBlock}


def _block(raw: dict[str, Any], where: str, allowed: tuple[type, ...]) -> Any:
    kind = raw.get("type")
    type_ = BLOCK_TYPES.get(kind) if isinstance(kind, str) else None
    if type_ is None:
        raise ApiError(400, f"{where}: content block of type {kind!r} is not supported: Sluice serves "
                       "text, tool_use, tool_result and thinking blocks (images and documents are refused)",
                       param=where)
    if type_ not in allowed:
        raise ApiError(400, f"{where}: a {kind} block does not belong in this role's message", param=where)
    return _typed(raw, type_, where)


def _text(content: str | list[Any], where: str) -> str:
    """A string, or text blocks (typed already, or raw as in a tool result) joined."""
    if isinstance(content, str):
        return content
    blocks = [b if isinstance(b, TextBlock) else _block(b, f"{where}[{i}]", (TextBlock,))
              for i, b in enumerate(content)]
    return "".join(b.text for b in blocks)


def _typed(item: dict[str, Any], type_: type, where: str) -> Any:
    try:
        return msgspec.convert(item, type_)
    except msgspec.ValidationError as exc:
        raise ApiError(400, f"invalid request: {exc} (in {where})", param=where) from None
