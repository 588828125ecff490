"""Anthropic ``thinking`` and strict tools on ``/v1/messages``, end to end with the official
``anthropic`` client, the frontend process and tests/fake_scheduler.py (which echoes the rendered
prompt, then EOS). The template here reads ``enable_thinking`` as Qwen3's does: on, the prompt ends
by opening ``<think>``, so the echo is reasoning up to the ``</think>`` a message carries; off, it
ends with an empty ``<think></think>``. The fake never applies a grammar; its stats show the one it
was given (what the grammars accept is tests/test_constrain.py's)."""

from __future__ import annotations

import hashlib
import sys
from pathlib import Path

import anthropic
import httpx
import pytest

sys.path.insert(0, str(Path(__file__).parent))
from test_http import WAIT_S, start, stop  # noqa: E402

from frontend.client import Client  # noqa: E402

# Each message as "role:[r:REASONING]content|", then the generation prompt.
TEMPLATE = ("{% for m in messages %}{{ m.role }}:{% if m.reasoning_content %}[r:{{ m.reasoning_content }}]"
            "{% endif %}{{ m.content }}|{% endfor %}"
            "{% if enable_thinking is defined and not enable_thinking %}<think></think>{% else %}<think>\n{% endif %}")
ASK = [{"role": "user", "content": "plan</think>answer"}]
WEATHER = {"name": "get_weather", "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}
SIGNATURE = hashlib.sha256(b"user:plan").hexdigest()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    proc, endpoint, url = start(tmp_path_factory.mktemp("thinking"), "--http-port", "0", template=TEMPLATE)
    yield url, endpoint
    assert stop(proc) == 0


@pytest.fixture
def claude(server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server[0], api_key="none", max_retries=0, timeout=WAIT_S)


def _create(claude: anthropic.Anthropic, **fields) -> anthropic.types.Message:
    return claude.messages.create(**{"model": "fake", "max_tokens": 300, "messages": ASK, **fields})


def _last_grammar(server) -> str | None:
    with Client(server[1], timeout=WAIT_S) as c:
        return c.stats()["last_grammar"]


def test_reasoning_is_a_thinking_block_before_the_text(claude, server):
    reply = _create(claude, thinking={"type": "enabled", "budget_tokens": 100})
    thought, text = reply.content
    assert (thought.type, thought.thinking, thought.signature) == ("thinking", "user:plan", SIGNATURE)
    assert (text.type, text.text) == ("text", "answer|<think>\n")  # the echo's own generation prompt is text
    assert "max_tokens=101" in _last_grammar(server)  # the budget, its closing tag counted, held by a grammar
    assert [b.type for b in _create(claude, thinking={"type": "enabled", "budget_tokens": 300}).content] == [
        "thinking", "text"]
    assert _last_grammar(server) is None  # a budget at max_tokens needs no grammar
    counted = claude.messages.count_tokens(model="fake", messages=ASK, thinking={"type": "adaptive"}).input_tokens
    assert counted == reply.usage.input_tokens + reply.usage.cache_read_input_tokens  # the same prompt
    assert counted != claude.messages.count_tokens(model="fake", messages=ASK).input_tokens  # thinking off


def test_streamed_thinking_in_the_documented_order(claude):
    fields = dict(thinking={"type": "adaptive"}, model="fake", max_tokens=300, messages=ASK)
    with claude.messages.stream(**fields) as s:
        events = [e for e in s if e.type not in ("text", "thinking", "signature", "input_json")]
        final = s.get_final_message()
    kinds = [(e.type, _kind(e)) for e in events]
    deltas = [k for k in kinds if k == ("content_block_delta", "thinking_delta")]
    assert kinds[:2] == [("message_start", None), ("content_block_start", "thinking")]
    assert kinds[2:2 + len(deltas)] == deltas and deltas
    rest = kinds[2 + len(deltas):]
    assert rest[:3] == [("content_block_delta", "signature_delta"), ("content_block_stop", None),
                        ("content_block_start", "text")]
    assert rest[-3:] == [("content_block_stop", None), ("message_delta", None), ("message_stop", None)]
    assert [e.index for e in events if e.type == "content_block_start"] == [0, 1]
    whole = _create(claude, thinking={"type": "adaptive"})
    assert final.model_dump()["content"] == whole.model_dump()["content"]
    assert final.content[0].signature == SIGNATURE


def _kind(event) -> str | None:
    if event.type == "content_block_start":
        return event.content_block.type
    return event.delta.type if event.type == "content_block_delta" else None


def test_omitted_display_and_disabled_thinking(claude, server):
    omitted = _create(claude, thinking={"type": "enabled", "budget_tokens": 100, "display": "omitted"})
    assert [(b.type, getattr(b, "thinking", None)) for b in omitted.content] == [("thinking", ""), ("text", None)]
    assert omitted.content[0].signature == SIGNATURE
    with claude.messages.stream(model="fake", max_tokens=300, messages=ASK,
                                thinking={"type": "adaptive", "display": "omitted"}) as s:
        assert not [e for e in s if e.type == "content_block_delta" and e.delta.type == "thinking_delta"]
    for thinking in ({"type": "disabled"}, None):  # off: the template closes the reasoning itself
        reply = _create(claude, **({"thinking": thinking} if thinking else {}))
        assert [(b.type, b.text) for b in reply.content] == [("text", "user:plan</think>answer|<think></think>")]


def test_thinking_blocks_sent_back_are_the_turns_reasoning(claude):
    turn = {"role": "assistant", "content": [
        {"type": "thinking", "thinking": "hmm", "signature": SIGNATURE},
        {"type": "redacted_thinking", "data": "opaque"}, {"type": "text", "text": "hi"}]}
    reply = _create(claude, messages=[{"role": "user", "content": "a"}, turn, {"role": "user", "content": "b"}],
                    thinking={"type": "disabled"})
    assert reply.content[0].text == "user:a|assistant:[r:hmm]hi|user:b|<think></think>"


def test_strict_tools_are_held_by_a_grammar_forced_or_not(claude, server):
    strict = {**WEATHER, "strict": True}
    _create(claude, tools=[strict], tool_choice={"type": "auto"})
    lazy = _last_grammar(server)
    assert "call_head[lazy]" in lazy and '"get_weather"' in lazy and "think" in lazy  # a call in reasoning is free
    _create(claude, tools=[strict], tool_choice={"type": "tool", "name": "get_weather"})
    assert _last_grammar(server).startswith('start: "<tool_call>\\n" %json')
    _create(claude, tools=[WEATHER])
    assert _last_grammar(server) is None
    function = {"name": "get_weather", "parameters": WEATHER["input_schema"], "strict": True}
    for path, body in (("/v1/chat/completions", {"messages": ASK, "tools": [{"type": "function", "function": function}]}),
                       ("/v1/responses", {"input": "hi", "tools": [{"type": "function", **function}]})):
        assert httpx.post(server[0] + path, json={"model": "fake", **body}, timeout=WAIT_S).status_code == 200
        assert "call_head[lazy]" in _last_grammar(server), path  # the same grammar in Chat and Responses


REFUSALS = [
    ({"thinking": {"type": "between_tools"}}, "thinking 'between_tools' is not supported"),
    ({"thinking": {"type": "enabled"}}, "budget_tokens goes with 'enabled'"),
    ({"thinking": {"type": "adaptive", "budget_tokens": 10}}, "budget_tokens goes with 'enabled'"),
    ({"thinking": {"type": "enabled", "budget_tokens": 0}}, "at least 1"),
    ({"thinking": {"type": "enabled", "budget_tokens": 9, "display": "full"}}, "display"),
    ({"thinking": {"type": "adaptive"}, "tools": [WEATHER], "tool_choice": {"type": "any"}},
     "cannot be used with thinking"),
]


@pytest.mark.parametrize("fields, match", REFUSALS)
def test_thinking_refusals_name_the_field(server, fields, match):
    body = {"model": "fake", "max_tokens": 50, "messages": ASK, **fields}
    reply = httpx.post(server[0] + "/v1/messages", json=body, timeout=WAIT_S)
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["type"] == "invalid_request_error" and match in reply.json()["error"]["message"]
