"""What the APIs constrain, as the scheduler's ``Grammar`` (llguidance's Lark, ``scheduler.grammar``
compiles it): ``response_format`` json_object / json_schema (Chat; ``text.format`` of Responses),
with tools offered either that output or a call; and forced tool calls (``tool_choice``
"required" or a named function; Anthropic's ``any`` and ``tool``), written in the model's call
markup, Hermes / Qwen JSON ``<tool_call>`` blocks, the arguments held to the tool's schema; and
free text held only where asked (``free_grammar``): a reasoning budget, and strict tools' calls
when the model may call or not (tool_choice auto).

Every grammar is checked here first, so that a schema with an unsupported keyword, an
unsatisfiable one or one too large gets a 400 naming what is wrong before anything is queued.
JSON is written as ``json.dumps`` writes it (", " and ": ", no other whitespace): whitespace left
free lets a model pad forever.
"""
from __future__ import annotations

import json
import re
from typing import Any

from frontend.http.errors import ApiError
from frontend.http.parsers import ReplyFormat
from frontend.http.parsers.reasoning import END_THINK, THINK
from frontend.validate import MAX_GRAMMAR_CHARS
from scheduler.messages.grammar_limits import parser_limits
from scheduler.messages.to_scheduler import Grammar

JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": ", "lenient": False}
OPEN_CALL, CLOSE_CALL = "<tool_call>\n", "\n</tool_call>"
ANY_TEXT = "/(.|\\n)*/"
# Where the template knows reasoning, free text may not open it: only the bounded think rule may.
NO_REASONING = " & ~/\\s*<think>(?s:.*)/"
# Reasoning as whole lexemes: not yet closed, or closed by the model (ending at its first </think>).
# A ``stop="</think>"`` lexeme followed by the tag makes llguidance (1.6, 1.9) panic computing the
# mask once the model writes the tag itself ("num_rows=3 row_infos=2").
OPEN_THOUGHT = "/(.|\\n)*/ & ~/(?s:.*)<\\/think>(?s:.*)/"
CLOSED_THOUGHT = "/(?s:.*)<\\/think>/ & ~/(?s:.*)<\\/think>(?s:.+)/"


def json_grammar(schema: Any, what: str, param: str) -> Grammar:
    """``schema`` (a JSON schema object; ``{"type": "object"}`` for json_object) as a grammar."""
    return checked(Grammar(lark=f"start: {_json_rule(schema, what, param)}", what=what), param)


def tool_call_grammar(tools: list[dict[str, Any]], name: str | None, reply: ReplyFormat, what: str,
                      param: str = "tool_choice") -> Grammar:
    """One call, of the tool ``name`` (None: any of ``tools``), in the template's markup."""
    return checked(Grammar(lark=f"start: {_call_rule(tools, name, reply, what, param)}", what=what), param)


def json_or_call_grammar(schema: Any, tools: list[dict[str, Any]], reply: ReplyFormat, what: str,
                         param: str) -> Grammar:
    """The output ``schema`` asks for, or one call of any of ``tools`` (a response format with
    tools the model may call: an agent with an output type and tools)."""
    output = _json_rule(schema, what, param)
    call = _call_rule(tools, None, reply, f"{what} with tools", param)
    return checked(Grammar(lark=f"start: output | call\noutput: {output}\ncall: {call}", what=what), param)


def free_grammar(tools: list[dict[str, Any]] | None, reply: ReplyFormat, budget: int | None, what: str,
                 param: str) -> Grammar:
    """Free text with two holds, either or both: the reasoning ends within ``budget`` tokens (its
    closing tag counted; at the limit ``</think>`` is forced), and once the model writes
    ``<tool_call>`` the call is one of ``tools`` with arguments by its schema (llguidance's lazy
    lexeme: the text before that trigger is free, and so is a call inside the reasoning)."""
    lines = [f"start: {_reasoning_rule(reply)}body"]
    free = ANY_TEXT
    if reply.markup.reasoning:
        lines += _think_rules(budget)
        free += NO_REASONING
    if not tools:
        return checked(Grammar(lark="\n".join(lines + ["body: TEXT", f"TEXT: {free}"]), what=what), param)
    trigger, rest = OPEN_CALL.split(">", 1)  # the tag, then what the template writes after it
    call = _call_body(tools, None, reply, what, param)
    lines += ["body: call* TAIL", f"call: call_head {json.dumps(rest)} {call}",
              f"call_head[lazy]: TEXT {json.dumps(trigger + '>')}", f"TEXT: {free}",
              f"TAIL: {free} & ~/(?s:.*)<tool_call>(?s:.*)/"]  # after the last call: no call opens
    return checked(Grammar(lark="\n".join(lines), what=what), param)


def _reasoning_rule(reply: ReplyFormat) -> str:
    """What comes before the body: the reasoning the prompt opened, one the model may open, or none."""
    if reply.in_reasoning:
        return "think "
    return f"({json.dumps(THINK)} think)? " if reply.markup.reasoning else ""


def _think_rules(budget: int | None) -> list[str]:
    """The reasoning up to and with its closing tag. With a budget both lexemes stop at ``budget + 1``
    tokens (the tag the model writes counted); llguidance ends a lexeme cut there as the first
    alternative, the open one, so the tag is forced after it."""
    if budget is None:
        return ["think: CLOSED_THOUGHT", f"CLOSED_THOUGHT: {CLOSED_THOUGHT}"]
    limit = f"[max_tokens={budget + 1}]"
    return [f"think: open_thought {json.dumps(END_THINK)} | closed_thought",
            f"open_thought{limit}: {OPEN_THOUGHT}", f"closed_thought{limit}: {CLOSED_THOUGHT}"]


def _json_rule(schema: Any, what: str, param: str) -> str:
    if not isinstance(schema, dict):
        raise ApiError(400, f"{what}: the schema must be a JSON object", param=param)
    return f"%json {_schema_text(schema)}"


def _call_rule(tools: list[dict[str, Any]], name: str | None, reply: ReplyFormat, what: str, param: str) -> str:
    return f"{json.dumps(OPEN_CALL)} {_call_body(tools, name, reply, what, param)}"


def _call_body(tools: list[dict[str, Any]], name: str | None, reply: ReplyFormat, what: str, param: str) -> str:
    """A call after its opening tag: the call object by the chosen tools' schemas, then the closing tag."""
    if reply.markup.calls != "json":
        raise ApiError(400, f"{what} is not supported for this model: its chat template writes calls in the "
                       "XML format, and constrained calls are built for the JSON <tool_call> format only",
                       param=param)
    chosen = [t for t in tools if name is None or t["function"]["name"] == name]
    if not chosen:
        raise ApiError(400, f"{what}: no tool named {name!r} among the request's tools", param=param)
    calls = [_call_schema(t["function"]) for t in chosen]
    schema = calls[0] if len(calls) == 1 else {"anyOf": calls}
    return f"%json {_schema_text(schema)} {json.dumps(CLOSE_CALL)}"


def refuse_in_reasoning(reply: ReplyFormat, what: str, param: str) -> None:
    """A prompt that opened ``<think>`` wants reasoning before the constrained output, which the
    grammars here do not allow for: refused rather than forcing JSON into the reasoning."""
    if reply.in_reasoning:
        raise ApiError(400, f"{what} is not supported while the model reasons first (the prompt opens <think>); "
                       "turn thinking off, e.g. chat_template_kwargs {\"enable_thinking\": false}", param=param)


def checked(grammar: Grammar, param: str) -> Grammar:
    """``grammar``, or a 400 with llguidance's reason (unimplemented keys, unsatisfiable, too large)."""
    if len(grammar.lark) > MAX_GRAMMAR_CHARS:
        raise ApiError(400, f"{grammar.what}: the schema is too large ({len(grammar.lark)} characters of grammar; "
                       f"at most {MAX_GRAMMAR_CHARS})", param=param)
    try:
        import llguidance  # here: a server that is never asked for a grammar never loads it
    except ImportError:
        raise ApiError(501, f"{grammar.what} needs the llguidance package, which this server lacks "
                       "(pip install llguidance)", param=param) from None

    try:
        failed, messages = llguidance.LLMatcher.validate_grammar_with_warnings(
            llguidance.LLMatcher.grammar_from_lark(grammar.lark), None, limits=parser_limits(llguidance))
    except BaseException as exc:  # a Rust panic comes as pyo3's PanicException, a BaseException
        if not (isinstance(exc, Exception) or type(exc).__name__ == "PanicException"):
            raise
        line = (str(exc).strip().splitlines() or [""])[0]
        raise ApiError(400, f"{grammar.what} is not supported: llguidance failed on it ({type(exc).__name__}: {line})",
                       param=param) from None
    if failed:
        reason = re.sub(r"^at \d+\(\d+\): ", "", messages[0].split("\n")[0]) if messages else "it does not compile"
        raise ApiError(400, f"{grammar.what} is not supported: {reason}", param=param)
    return grammar


def _call_schema(function: dict[str, Any]) -> dict[str, Any]:
    """A Hermes call object: ``{"name": NAME, "arguments": {...}}``, the arguments by the tool's schema."""
    parameters = function.get("parameters") or {"type": "object"}
    return {"type": "object", "properties": {"name": {"const": function["name"]}, "arguments": parameters},
            "required": ["name", "arguments"], "additionalProperties": False}


def _schema_text(schema: dict[str, Any]) -> str:
    """The schema with the JSON layout options, as JSON text (a client's own x-guidance is replaced)."""
    return json.dumps({**schema, "x-guidance": JSON_OPTIONS}, ensure_ascii=False)
