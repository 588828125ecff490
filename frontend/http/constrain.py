"""A Chat request's constraint on its output (Responses and Messages adapt into Chat requests, so
this is theirs too): ``response_format`` json_object / json_schema, or a forced tool call
(``tool_choice`` "required" or a named function), as the scheduler's ``Grammar``; else free output held where the
request asks (``thinking_token_budget``, tools with ``strict``); None when the output is free. The
grammars themselves are built and checked in ``frontend.http.grammars``."""

from __future__ import annotations

from typing import Any

from frontend.http import grammars
from frontend.http.convert import chat_max_tokens
from frontend.http.errors import ApiError
from frontend.http.parsers import ReplyFormat
from frontend.http.schemas import ChatRequest, NamedToolChoice
from scheduler.messages.to_scheduler import Grammar


def chat_grammar(body: ChatRequest, tools: list[dict[str, Any]] | None, reply: ReplyFormat) -> Grammar | None:
    """A forced call wins over ``response_format``, which shapes text the reply then has none of;
    a format with tools the model may call allows either the format or a call."""
    call = forced_call(body, tools, reply)
    if call is not None:
        return call
    output = response_format_grammar(body.response_format, reply)
    if output is None:
        return free_output(body, tools, reply)
    if not tools:
        return output
    return grammars.json_or_call_grammar(_schema(body.response_format), tools, reply, output.what, "response_format")


def free_output(body: ChatRequest, tools: list[dict[str, Any]] | None, reply: ReplyFormat) -> Grammar | None:
    """Free text, held only where the request asks: the reasoning within ``thinking_token_budget``
    tokens, and calls of tools with ``strict`` by their schemas (the model may call or not). A
    forced call or a response format needs neither: its grammar leaves no room to reason, and
    every call it allows is held to its schema already."""
    budget = _budget(body, reply)
    strict = [t["function"]["name"] for t in tools or [] if t["function"].get("strict")]
    if budget is None and not strict:
        return None
    what = f"tools[{strict[0]!r}].strict with tool_choice auto" if strict else f"thinking_token_budget {budget}"
    param = "tools" if strict else "thinking_token_budget"
    return grammars.free_grammar(tools if strict else None, reply, budget, what, param)


def _budget(body: ChatRequest, reply: ReplyFormat) -> int | None:
    """The reasoning budget a grammar must hold: none at or above max_tokens (the reply cannot pass it)."""
    budget = body.thinking_token_budget
    limit = chat_max_tokens(body)
    if budget is None or (limit is not None and budget >= limit):
        return None
    if budget < 0:
        raise ApiError(400, "thinking_token_budget must be at least 0", param="thinking_token_budget")
    if not reply.markup.reasoning:
        raise ApiError(400, "thinking_token_budget needs a model that reasons (<think> in its chat template)",
                       param="thinking_token_budget")
    return budget


def forced_call(body: ChatRequest, tools: list[dict[str, Any]] | None, reply: ReplyFormat) -> Grammar | None:
    choice = body.tool_choice
    if choice is None or choice in ("auto", "none"):
        return None
    name = choice.function.name if isinstance(choice, NamedToolChoice) else None
    what = f"tool_choice {name!r}" if name else f"tool_choice {choice!r}"
    if not tools:
        raise ApiError(400, f"{what} needs tools", param="tool_choice")
    grammars.refuse_in_reasoning(reply, what, "tool_choice")
    return grammars.tool_call_grammar(tools, name, reply, what)


def response_format_grammar(fmt: dict[str, Any] | None, reply: ReplyFormat | None) -> Grammar | None:
    """``{"type": "text"}`` (None), ``json_object`` or ``json_schema`` (``{"json_schema": {"name",
    "schema", "strict"}}``); any other type is a 400."""
    kind = (fmt or {}).get("type", "text")
    if kind == "text":
        return None
    what, param = f"response_format {kind}", "response_format"
    schema = _schema(fmt)
    if reply is not None:
        grammars.refuse_in_reasoning(reply, what, param)
    return grammars.json_grammar(schema, what, param)


def _schema(fmt: dict[str, Any]) -> Any:
    """The schema of a json_object or json_schema ``response_format``."""
    kind = fmt.get("type")
    if kind == "json_object":
        return {"type": "object"}
    if kind != "json_schema":
        raise ApiError(400, f"response_format of type {kind!r} is not supported (text, json_object or "
                       "json_schema)", param="response_format")
    spec = fmt.get("json_schema")
    if not isinstance(spec, dict) or "schema" not in spec:
        raise ApiError(400, "response_format json_schema needs json_schema.schema", param="response_format")
    return spec["schema"]
