"""OpenAI bodies -> the internal ``requests.Generate``, through the same typed conversion (field
ranges) and, in ``Frontend``, the same ``frontend.validate`` checks as a ZMQ request: both front
doors share one set of rules. Chat messages, tools and tool results are rendered here with the
model's chat template, since the ZMQ protocol's messages carry text only; and here the reply's
format is read (``reply_format``), for the parser of the reply."""

from __future__ import annotations

import json
from typing import Any, Sequence

import msgspec

from frontend.api import requests
from frontend.http.errors import ApiError
from frontend.http.harmony import render as harmony_render
from frontend.http.harmony.encoding import speaks_harmony
from frontend.http.harmony.reply import HarmonyFormat
from frontend.http.parsers import ReplyFormat
from frontend.http.schemas import ChatRequest, CompletionRequest, ContentPart, Message, _Sampling
from frontend.tokenizer import RENDER_VARIABLES, ChatTemplateError, ChatTokenizer
from scheduler.messages.to_scheduler import Grammar

COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
_CONSTRAINED = "use response_format (json_object or json_schema) for constrained output"
_SAMPLER = "the sampler does not implement it"
# Fields that would change the output and that Sluice does not implement: refused unless absent
# or set to the value that changes nothing (which some clients always send).
_REFUSED: dict[str, tuple[Any, str]] = {
    "n": (1, "one choice per request is served (n must be 1)"),
    "logprobs": (False, "log-probabilities are not reported"),
    "top_logprobs": (0, "log-probabilities are not reported"),
    "presence_penalty": (0.0, _SAMPLER),
    "frequency_penalty": (0.0, _SAMPLER),
    "repetition_penalty": (1.0, _SAMPLER),
    "min_p": (0.0, _SAMPLER),
    "logit_bias": ({}, _SAMPLER),
    "structured_outputs": (None, _CONSTRAINED),
    **{f"guided_{kind}": (None, _CONSTRAINED) for kind in (
        "json", "regex", "choice", "grammar", "decoding_backend", "whitespace_pattern")},
    "store": (False, "Sluice keeps no completions"),
}
_PROMPT_TAIL_TOKENS = 32  # enough to see the generation prompt's end (e.g. "<think>\n")


def check_request(body: _Sampling, served_name: str) -> None:
    """The model is the one served and no unimplemented option is set; else an ApiError."""
    if body.model != served_name:
        raise ApiError(404, f"model {body.model!r} is not served here (this server serves "
                       f"{served_name!r})", "model_not_found", "model")
    for name, (neutral, reason) in _REFUSED.items():
        value = getattr(body, name)
        if value is not None and value != neutral:
            raise ApiError(400, f"{name} is not supported: {reason}", param=name)


def chat_tools(body: ChatRequest) -> list[dict[str, Any]] | None:
    """The tools the template sees (a forced call, "required" or a named function, is constrained
    by ``frontend.http.constrain``)."""
    if not body.tools or body.tool_choice == "none":
        return None
    return [msgspec.to_builtins(t) for t in body.tools]


def tool_schemas(tools: list[dict[str, Any]] | None) -> dict[str, Any] | None:
    """Each tool's parameters schema by name, as the reply parser types call arguments by them."""
    if tools is None:
        return None
    return {t["function"]["name"]: t["function"].get("parameters") or {} for t in tools}


def chat_prompt_ids(body: ChatRequest, tools: list[dict] | None, tokenizer: ChatTokenizer) -> list[int]:
    if speaks_harmony(tokenizer):  # gpt-oss: rendered by openai-harmony, not by its chat template
        return harmony_render.prompt_ids(body, tools, kept=tokenizer.harmony_messages)
    if not body.messages:
        raise ApiError(400, "messages is empty", param="messages")
    # A tool result names its function in many templates (Hermes); OpenAI sends only the call id.
    names = {c.id: c.function.name for m in body.messages for c in m.tool_calls or []}
    messages = [_template_message(m, names) for m in body.messages]
    kwargs = template_kwargs(body, tokenizer.chat_template)
    try:
        return tokenizer.encode_chat(messages, tools, kwargs)
    except ChatTemplateError as exc:
        raise ApiError(400, str(exc), param="messages") from None


def check_prompt_chars(body: ChatRequest, limit: int) -> None:
    """Refuse messages whose text (content, reasoning, tool-call arguments) is longer than ``limit``
    characters before the template renders it and the tokenizer reads it: tens of MB take a worker
    thread tens of seconds (``--max-prompt-chars``, the limit of the ZMQ socket's prompts too)."""
    chars = 0
    for m in body.messages or ():
        content = m.content
        chars += sum(len(_text_of(p)) for p in content) if isinstance(content, list) else len(content or "")
        chars += len(m.reasoning_content or "") + sum(len(c.function.arguments) for c in m.tool_calls or ())
    if chars > limit:
        raise ApiError(400, f"the messages hold {chars} characters of text; this server takes at most {limit} "
                       "(--max-prompt-chars)", param="messages")


def template_kwargs(body: ChatRequest, template: str | None) -> dict[str, Any]:
    """``chat_template_kwargs``, and ``reasoning_effort`` where it means something real: "none"
    turns thinking off in a template that reads ``enable_thinking`` (a budget is not built)."""
    kwargs = dict(body.chat_template_kwargs or {})
    reserved = sorted(RENDER_VARIABLES & kwargs.keys())
    if reserved:
        raise ApiError(400, f"chat_template_kwargs may not set {reserved[0]!r}: the server sets it",
                       param="chat_template_kwargs")
    if body.reasoning_effort is not None:
        if body.reasoning_effort != "none" or "enable_thinking" not in (template or ""):
            raise ApiError(400, f"reasoning_effort {body.reasoning_effort!r} is not supported: only "
                           "'none', on a model whose chat template reads enable_thinking",
                           param="reasoning_effort")
        kwargs.setdefault("enable_thinking", False)
    return kwargs


def reply_format(body: ChatRequest, input_ids: Sequence[int],
                 tokenizer: ChatTokenizer) -> ReplyFormat | HarmonyFormat:
    """How the reply to ``body`` reads: the template's markup, whether the prompt's last tokens
    opened reasoning, and the tools' schemas (None when the template was given no tools); or
    harmony's channels, read from the reply's tokens."""
    if speaks_harmony(tokenizer):
        return HarmonyFormat(tool_schemas(chat_tools(body)))
    tail = tokenizer.decode(input_ids[-_PROMPT_TAIL_TOKENS:], skip_special_tokens=False)
    return ReplyFormat.of(tokenizer.chat_template, tail, tool_schemas(chat_tools(body)))


def _text_of(part: ContentPart) -> str:
    if part.type != "text" or part.text is None:
        raise ApiError(400, f"content part of type {part.type!r} is not supported: Sluice serves text only "
                       f"(image, video and audio inputs are refused)", param="messages")
    return part.text


def _template_message(m: Message, call_names: dict[str, str]) -> dict[str, Any]:
    """A message as transformers' chat templates expect it: text content, tool-call arguments as
    a mapping, "developer" spoken as "system"."""
    content = m.content
    if isinstance(content, list):
        content = "".join(_text_of(part) for part in content)
    out: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role,
                           "content": content or ""}
    if m.reasoning_content is not None:
        out["reasoning_content"] = m.reasoning_content
    name = m.name if m.name is not None else call_names.get(m.tool_call_id or "")
    if name is not None:
        out["name"] = name
    if m.tool_call_id is not None:
        out["tool_call_id"] = m.tool_call_id
    if m.tool_calls:
        out["tool_calls"] = [{"id": c.id, "type": "function", "function": {
            "name": c.function.name, "arguments": _arguments(c.function.arguments)}}
            for c in m.tool_calls]
    return out


def _arguments(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text  # templates print a string as is


def completion_prompt(body: CompletionRequest) -> dict[str, Any]:
    """``prompt`` or ``input_ids`` for Generate: one text, or one list of token ids."""
    prompt = body.prompt
    if isinstance(prompt, str):
        return {"prompt": prompt}
    if all(isinstance(p, int) for p in prompt):
        return {"input_ids": prompt}
    if len(prompt) == 1 and isinstance(prompt[0], str):
        return {"prompt": prompt[0]}
    raise ApiError(400, "prompt must be one text or one list of token ids (a batch of prompts "
                   "is not supported)", param="prompt")


def to_generate(body: _Sampling, prompt: dict[str, Any], max_tokens: int | None,
                default_max_tokens: int, grammar: Grammar | None = None) -> requests.Generate:
    """The internal request, converted (and so range-checked) as a decoded ZMQ frame would be."""
    fields: dict[str, Any] = {"rid": "http", **prompt, "stream": body.stream,
                              "ignore_eos": body.ignore_eos, "grammar": grammar,
                              "max_tokens": default_max_tokens if max_tokens is None else max_tokens}
    for name in ("temperature", "top_p", "top_k", "seed"):
        if getattr(body, name) is not None:
            fields[name] = getattr(body, name)
    if body.stop is not None:
        fields["stop"] = [body.stop] if isinstance(body.stop, str) else body.stop
    try:
        return msgspec.convert(fields, requests.Generate)
    except msgspec.ValidationError as exc:
        raise ApiError(400, str(exc)) from None


def chat_max_tokens(body: ChatRequest) -> int | None:
    return body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens

