"""A Chat request as harmony tokens, rendered by openai-harmony: a system message (reasoning effort,
today's date), a developer message with the request's system / developer text as instructions and
its tools as the ``functions`` namespace, then the conversation: user text, assistant reasoning
(analysis), text (final, or commentary beside calls), calls (commentary to ``functions.NAME``),
and tool results (from ``functions.NAME``, the name read from the call that the result answers).
Once a final answer ends the conversation, the library drops the analysis before the first final
answer. The messages are rendered one by one, each one's ids kept (``render_for_completion``)."""

from __future__ import annotations

import datetime
import functools
from typing import Any

from openai_harmony import Author, Conversation, DeveloperContent, Message as HarmonyMessage
from openai_harmony import ReasoningEffort, RenderOptions, Role, SystemContent, ToolDescription

from frontend.http.errors import ApiError
from frontend.http.harmony.encoding import encoding
from frontend.http.schemas import ChatRequest, Message
from frontend.kept_ids import KeptIds

EFFORTS = ("low", "medium", "high")
CALL_CONTENT_TYPE = "<|constrain|>json"  # how gpt-oss marks JSON arguments


def check(body: ChatRequest) -> None:
    """What harmony rendering cannot honour is refused by name."""
    if body.reasoning_effort is not None and body.reasoning_effort not in EFFORTS:
        raise ApiError(400, f"reasoning_effort {body.reasoning_effort!r} is not supported by gpt-oss's harmony "
                       f"format (one of {', '.join(EFFORTS)}; it always reasons)", param="reasoning_effort")
    if body.chat_template_kwargs:
        raise ApiError(400, "chat_template_kwargs is not supported: gpt-oss's prompt is rendered by "
                       "openai-harmony, not by a chat template", param="chat_template_kwargs")
    param = constrained(body)
    if param is not None:
        raise ApiError(400, f"{param} is not supported with gpt-oss's harmony format: constrained decoding "
                       "would cut its reasoning or its calls' format", param=param)


def constrained(body: ChatRequest) -> str | None:
    """The field that asks for constrained output, if any."""
    strict = [t.function.name for t in body.tools or [] if t.function.strict and body.tool_choice != "none"]
    if body.tool_choice not in (None, "auto", "none"):
        return "tool_choice"
    if (body.response_format or {}).get("type", "text") != "text":
        return "response_format"
    if body.thinking_token_budget is not None:
        return "thinking_token_budget"
    return f"tools[{strict[0]!r}].strict" if strict else None


def prompt_ids(body: ChatRequest, tools: list[dict[str, Any]] | None, today: datetime.date | None = None, *,
               kept: KeptIds | None = None) -> list[int]:
    """The request's conversation rendered for the assistant's next message; ``kept``: its
    messages' ids are kept there and taken from there (``render_for_completion``)."""
    check(body)
    if not body.messages:
        raise ApiError(400, "messages is empty", param="messages")
    messages = [system_message(body.reasoning_effort or "medium", today or datetime.date.today())]
    lead = 0
    while lead < len(body.messages) and body.messages[lead].role in ("system", "developer"):
        lead += 1
    instructions = "\n\n".join(text_of(m) for m in body.messages[:lead])
    if instructions or tools:
        messages.append(developer_message(instructions, tools))
    names = {c.id: c.function.name for m in body.messages for c in m.tool_calls or []}
    for m in body.messages[lead:]:
        messages += conversation_messages(m, names)
    return render_for_completion(messages, kept)


def system_message(effort: str, today: datetime.date) -> HarmonyMessage:
    content = SystemContent.new().with_reasoning_effort(ReasoningEffort(effort.capitalize()))
    return HarmonyMessage.from_role_and_content(Role.SYSTEM, content.with_conversation_start_date(today.isoformat()))


def developer_message(instructions: str, tools: list[dict[str, Any]] | None) -> HarmonyMessage:
    content = DeveloperContent.new()
    if instructions:
        content = content.with_instructions(instructions)
    if tools:
        content = content.with_function_tools([ToolDescription.new(
            t["function"]["name"], t["function"].get("description") or "", parameters=t["function"].get("parameters"))
            for t in tools])
    return HarmonyMessage.from_role_and_content(Role.DEVELOPER, content)


def conversation_messages(m: Message, call_names: dict[str, str]) -> list[HarmonyMessage]:
    """One Chat message as harmony messages (an assistant turn may be several)."""
    if m.role in ("system", "developer"):  # past the lead: instructions where they were given
        content = DeveloperContent.new().with_instructions(text_of(m))
        return [HarmonyMessage.from_role_and_content(Role.DEVELOPER, content)]
    if m.role == "user":
        return [HarmonyMessage.from_role_and_content(Role.USER, text_of(m))]
    if m.role == "tool":
        name = m.name or call_names.get(m.tool_call_id or "")
        if name is None:
            raise ApiError(400, f"tool message {m.tool_call_id!r} answers no call in the conversation",
                           param="messages")
        author = Author.new(Role.TOOL, f"functions.{name}")
        return [HarmonyMessage.from_author_and_content(author, text_of(m)).with_channel("commentary")
                .with_recipient("assistant")]
    return assistant_messages(m)


def assistant_messages(m: Message) -> list[HarmonyMessage]:
    """Reasoning, then text (a preamble on the commentary channel when calls follow), then calls."""
    def said(text: str, channel: str) -> HarmonyMessage:
        return HarmonyMessage.from_role_and_content(Role.ASSISTANT, text).with_channel(channel)

    out = [said(m.reasoning_content, "analysis")] if m.reasoning_content else []
    text = text_of(m)
    if text:
        out.append(said(text, "commentary" if m.tool_calls else "final"))
    for call in m.tool_calls or []:
        out.append(said(call.function.arguments, "commentary").with_recipient(f"functions.{call.function.name}")
                   .with_content_type(CALL_CONTENT_TYPE))
    return out


def text_of(m: Message) -> str:
    if m.content is None or isinstance(m.content, str):
        return m.content or ""
    for part in m.content:
        if part.type != "text" or part.text is None:
            raise ApiError(400, f"content part of type {part.type!r} is not supported: Sluice serves text only",
                           param="messages")
    return "".join(part.text or "" for part in m.content)


# ==== rendering message by message ====

def render_for_completion(messages: list[HarmonyMessage], kept: KeptIds | None = None) -> list[int]:
    """``render_conversation_for_completion(Conversation.from_messages(messages), Role.ASSISTANT)``,
    with each message's ids from ``kept`` where it holds them (an agent resends its whole history
    every turn). openai-harmony renders a conversation as each message rendered alone, given one
    fact of the whole (``has_function_tools``: the system message then says where calls go),
    less the analysis it drops (``kept_for_completion``), then ``<|start|>assistant``;
    ``tests/test_harmony.py`` checks the two against each other."""
    if kept is None:
        return encoding().render_conversation_for_completion(Conversation.from_messages(messages), Role.ASSISTANT)
    options = RenderOptions(conversation_has_function_tools=has_function_tools(messages))
    messages = kept_for_completion(messages)
    keys = [f"{int(options.conversation_has_function_tools)}{m.to_json()}" for m in messages]
    found = kept.lookup(keys)
    fresh = {key: encoding().render(m, options) for m, key, ids in zip(messages, keys, found) if ids is None}
    kept.keep(fresh.items())
    out: list[int] = []
    for key, ids in zip(keys, found):
        out.extend(ids if ids is not None else fresh[key])
    return out + assistant_start()


def has_function_tools(messages: list[HarmonyMessage]) -> bool:
    """Whether a developer message declares function tools (harmony's ``functions`` namespace)."""
    return any(isinstance(c, DeveloperContent) and bool(getattr((c.tools or {}).get("functions"), "tools", None))
               for m in messages for c in m.content)


def kept_for_completion(messages: list[HarmonyMessage]) -> list[HarmonyMessage]:
    """The messages harmony renders by default (``auto_drop_analysis``): when the last assistant
    message is a final answer, the analysis messages before the first final answer are dropped."""
    last = next((m for m in reversed(messages) if m.author.role == Role.ASSISTANT), None)
    if last is None or last.channel != "final":
        return messages
    first_final = next(i for i, m in enumerate(messages) if m.channel == "final")
    return [m for i, m in enumerate(messages) if not (i < first_final and m.channel == "analysis")]


@functools.lru_cache(maxsize=1)
def assistant_start() -> list[int]:
    """``<|start|>assistant``: what a completion's render adds after the conversation."""
    return encoding().render_conversation_for_completion(Conversation.from_messages([]), Role.ASSISTANT)
