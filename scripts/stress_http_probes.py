"""The bad requests of ``scripts/stress_http.py``, as endless streams of probes per attack, on
/v1/chat/completions, /v1/completions, /v1/responses, /v1/messages and /v1/messages/count_tokens:
malformed JSON, huge bodies, a wrong type in every field, fields that would change the output, huge
and unsatisfiable schemas, forced tools that do not exist. Each probe says whether it is bad by
construction (a 4xx is due) or may be served."""
from __future__ import annotations

import json
import random
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import msgspec

from frontend.http.messages_api import MessagesPrompt, MessagesRequest
from frontend.http.responses_api import ResponsesRequest
from frontend.http.schemas import ChatRequest, CompletionRequest

CHAT, COMPLETIONS, RESPONSES = "/v1/chat/completions", "/v1/completions", "/v1/responses"
MESSAGES, COUNT = "/v1/messages", "/v1/messages/count_tokens"
PATHS = (CHAT, COMPLETIONS, RESPONSES, MESSAGES, COUNT)
BODIES: dict[str, type] = {CHAT: ChatRequest, COMPLETIONS: CompletionRequest, RESPONSES: ResponsesRequest,
                           MESSAGES: MessagesRequest, COUNT: MessagesPrompt}
ANY_FIELD = {CHAT: "metadata", COMPLETIONS: "metadata", RESPONSES: "client_metadata", MESSAGES: "metadata",
             COUNT: "cache_control"}  # a field of each body that takes any JSON object
HUGE = 20 << 20  # under the server's default --http-max-body (32 MiB) ...
OVER = 40 << 20  # ... and over it
ODD_VALUES: list[Any] = [None, True, "1", "", "x" * 1000, [], [1, 2], {}, {"a": 1}, 1.5, -1, 0, 2**63, 2**64 - 1,
                         10**30, -(2**63), [{"a": [1]}], [[]]]


@dataclass(frozen=True)
class Probe:
    path: str
    body: bytes | dict
    bad: bool = True  # False: a 2xx is fine too (a right-typed value, a large valid schema)
    chunked: bool = False  # sent without Content-Length


def good(path: str, model: str, /, **fields: Any) -> dict:
    """A small valid body for ``path`` (``fields`` replace or add to it)."""
    chat = [{"role": "user", "content": "hi"}]
    body = {CHAT: {"messages": chat, "max_tokens": 2}, COMPLETIONS: {"prompt": "hi", "max_tokens": 2},
            RESPONSES: {"input": "hi", "max_output_tokens": 2}, MESSAGES: {"messages": chat, "max_tokens": 2},
            COUNT: {"messages": chat}}[path]
    return {"model": model, **body, **fields}


def nested(path: str, model: str, depth: int) -> bytes:
    """A body of ``path`` with arrays ``depth`` deep in a field that takes any JSON."""
    text = json.dumps(good(path, model)).encode()
    return text[:-1] + f', "{ANY_FIELD[path]}": {{"a": '.encode() + b"[" * depth + b"]" * depth + b"}}"


def malformed(rng: random.Random, model: str) -> Iterator[Probe]:
    while True:
        path = rng.choice(PATHS)
        text = json.dumps(good(path, model)).encode()
        yield Probe(path, rng.choice([
            rng.randbytes(rng.choice([1, 37, 5000])), text[:rng.randrange(1, len(text))], b"", b"[]", b"7",
            b'"hi"', b"null", text + b"}", text.replace(b'"', b"'"), b"\xff" + text, text.replace(b"hi", b"\xc3\x28"),
            b"[" * 100_000, nested(path, model, rng.choice([2_000, 100_000]))]))


def huge_bodies(rng: random.Random, model: str) -> Iterator[Probe]:
    """Tens of MB: over the body limit (with and without Content-Length), and under it, where the
    prompt is too long (one huge message, many small ones, many tools): a 4xx, except that
    count_tokens may count it (a 200; a 400 / 413 is fine too, a 5xx or no reply is not)."""
    while True:
        path = rng.choice(PATHS)
        kind = rng.randrange(5)
        if kind < 2:
            yield Probe(path, _pad(json.dumps(good(path, model)).encode(), OVER), chunked=kind == 1)
        elif kind == 2 or path == COMPLETIONS:  # count_tokens counts a prompt past the context: a 200 is due
            yield Probe(path, with_messages(path, model, [{"role": "user", "content": "x " * (HUGE // 2)}]),
                        bad=path != COUNT)
        elif kind == 3:
            yield Probe(path, with_messages(path, model, [{"role": "user", "content": "hi"}] * 200_000),
                        bad=path != COUNT)
        else:
            tools = [_tool(path, f"t{i}", {"type": "object", "description": "d" * 1000}) for i in range(HUGE // 1100)]
            yield Probe(path, good(path, model, tools=tools), bad=False)  # a template may show no tools


def _pad(text: bytes, size: int) -> bytes:
    return text[:-1] + b" " * (size - len(text)) + b"}"


def with_messages(path: str, model: str, messages: list[dict], /, **fields: Any) -> dict:
    """A body of ``path`` whose prompt is ``messages`` (their texts joined for /v1/completions)."""
    if path == COMPLETIONS:
        return good(path, model, prompt="".join(str(m["content"]) for m in messages), **fields)
    return good(path, model, **{"input" if path == RESPONSES else "messages": messages}, **fields)


def _tool(path: str, name: str, schema: dict) -> dict:
    """A tool declared as ``path``'s API declares one."""
    if path in (MESSAGES, COUNT):
        return {"name": name, "input_schema": schema}
    if path == RESPONSES:
        return {"type": "function", "name": name, "parameters": schema}
    return {"type": "function", "function": {"name": name, "parameters": schema}}


# A right-typed null or huge value here asks for output up to the context (null: no limit; huge:
# clamped), which a CPU model of random weights, never sampling its end, takes minutes to write: a
# valid request, not a probe (a reply within REPLY_S is what the probes count). The clamping has
# its own test (tests/test_frontend.py::test_length_and_clamping_to_the_context).
LENGTH_FIELDS = frozenset({"max_tokens", "max_completion_tokens", "max_output_tokens"})


def wrong_types(rng: random.Random, model: str) -> Iterator[Probe]:
    """Every top-level field with values of the wrong type (a 4xx is due: the server's own body
    type says which are wrong) or of the right one (anything but a 5xx); and some nested fields.
    Right-typed values of a length field that would lift the probe's 2-token bound are left out."""
    while True:
        path = rng.choice(PATHS)
        value = rng.choice(ODD_VALUES)
        if rng.random() < 0.2:
            yield Probe(path, _nested_field(rng, path, model, value), bad=False)
            continue
        field = rng.choice(msgspec.structs.fields(BODIES[path]))
        try:
            msgspec.json.decode(msgspec.json.encode(value), type=field.type)
            wrong = False
        except msgspec.ValidationError:
            wrong = True
        if not wrong and field.encode_name in LENGTH_FIELDS and (value is None or value > 2):
            continue
        yield Probe(path, good(path, model, **{field.encode_name: value}), bad=wrong)


def _nested_field(rng: random.Random, path: str, model: str, value: Any) -> dict:
    message = {"role": "user", "content": "hi"}
    message[rng.choice(["role", "content", "name", "tool_calls", "type"])] = value
    if path == COMPLETIONS:
        return good(path, model, prompt=[value])
    return with_messages(path, model, [message])


CHANGES_OUTPUT: dict[str, list[dict]] = {
    CHAT: [{"n": 2}, {"logprobs": True}, {"presence_penalty": 0.5}, {"frequency_penalty": 0.5}, {"min_p": 0.1},
           {"logit_bias": {"1": 5}}, {"guided_regex": "a+"}, {"guided_choice": ["a"]}, {"top_logprobs": 2},
           {"best_of": 3}, {"functions": [{"name": "f"}]}, {"modalities": ["audio"]}, {"frobnicate": 1},
           {"response_format": {"type": "regex"}}, {"store": True}],
    COMPLETIONS: [{"echo": True}, {"suffix": "x"}, {"best_of": 2}, {"n": 3}, {"logprobs": 2}, {"frobnicate": 1}],
    RESPONSES: [{"previous_response_id": "resp_1"}, {"store": True}, {"background": True}, {"conversation": "c"},
                {"truncation": "auto"}, {"max_tool_calls": 1}, {"top_logprobs": 2}, {"prompt": {"id": "p"}},
                {"top_k": 5}, {"stop": ["x"]}, {"frobnicate": 1}, {"text": {"verbosity": "high"}},
                {"reasoning": {"effort": "high"}}, {"input": [{"type": "item_reference", "id": "x"}]}],
    MESSAGES: [{"output_format": {"type": "json_schema"}}, {"mcp_servers": [{"url": "x"}]}, {"container": "c"},
               {"context_management": {"edits": []}}, {"n": 2}, {"stop": "x"}, {"frobnicate": 1},
               {"tools": [{"type": "web_search_20250305", "name": "web_search"}]},
               {"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}],
    COUNT: [{"frobnicate": 1}, {"max_tokens": 5}, {"output_format": {"type": "json_schema"}}],
}


def unknown_fields(rng: random.Random, model: str) -> Iterator[Probe]:
    while True:
        path = rng.choice(PATHS)
        yield Probe(path, good(path, model, **rng.choice(CHANGES_OUTPUT[path])))


BAD_SCHEMAS: list[Any] = [
    {"type": "strin"}, {"allOf": [{"type": "string"}, {"type": "integer"}]}, {"$ref": "#/$defs/missing"},
    {"type": "string", "pattern": "("}, {"type": "integer", "minimum": 5, "maximum": 1}, "x", 7, [],
    {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(50_000)}},  # too large
    {"enum": [f"v{i}" * 10 for i in range(100_000)]},
]
LARGE_SCHEMAS: list[Any] = [  # valid: refused when too large, or served
    {"type": "object", "properties": {f"p{i}": {"type": "string", "pattern": "[a-z]{1,30}@[a-z]{2,9}"}
                                      for i in range(1500)}},
    {"type": "string", "pattern": "(a|b){1,100000}"}, {"type": "string", "minLength": 10**9},
    {"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]},  # no finite value: not seen
]


def _deep_schema(depth: int) -> dict:
    schema: dict = {"type": "object"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return schema


def schemas(rng: random.Random, model: str) -> Iterator[Probe]:
    """Schemas in every place that constrains: response_format, text.format, a forced tool's schema."""
    while True:
        path = rng.choice(PATHS)
        bad = rng.random() < 0.7
        schema = rng.choice(BAD_SCHEMAS) if bad else rng.choice(LARGE_SCHEMAS + [_deep_schema(rng.choice([50, 400]))])
        yield Probe(path, good(path, model, **_constrained(rng, path, schema)), bad=bad)


def _constrained(rng: random.Random, path: str, schema: Any) -> dict:
    if path in (MESSAGES, COUNT):
        return {"tools": [_tool(path, "f", schema)], "tool_choice": {"type": rng.choice(["any", "tool"]), "name": "f"}}
    if rng.random() < 0.5 and path != COMPLETIONS:
        choice = "required" if rng.random() < 0.5 else (
            {"type": "function", "name": "f"} if path == RESPONSES else {"type": "function", "function": {"name": "f"}})
        return {"tools": [_tool(path, "f", schema)], "tool_choice": choice}
    if path == RESPONSES:
        return {"text": {"format": {"type": "json_schema", "name": "out", "schema": schema, "strict": True}}}
    return {"response_format": {"type": "json_schema", "json_schema": {"name": "out", "schema": schema}}}


def forced_tools(rng: random.Random, model: str) -> Iterator[Probe]:
    """A call forced to a tool the request does not declare, or forced with no tools at all."""
    weather = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    while True:
        path = rng.choice([CHAT, RESPONSES, MESSAGES, COUNT])
        tools = [_tool(path, "get_weather", weather)] if rng.random() < 0.7 else None
        named = {CHAT: {"type": "function", "function": {"name": "nope"}},
                 RESPONSES: {"type": "function", "name": "nope"},
                 MESSAGES: {"type": "tool", "name": "nope"}, COUNT: {"type": "tool", "name": "nope"}}[path]
        if tools is None and rng.random() < 0.5:
            named = {"type": "any"} if path in (MESSAGES, COUNT) else "required"
        elif path in (MESSAGES, COUNT) and rng.random() < 0.2:
            named = {"type": "tool"}  # no name
        yield Probe(path, good(path, model, tool_choice=named, **({"tools": tools} if tools else {})))


ATTACKS: dict[str, Callable[[random.Random, str], Iterator[Probe]]] = {
    "http malformed JSON": malformed,
    "http huge bodies": huge_bodies,
    "http wrong types": wrong_types,
    "http output-changing fields": unknown_fields,
    "http schemas": schemas,
    "http forced tools": forced_tools,
}
