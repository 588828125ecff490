"""gpt-oss's reasoning through Responses and Messages (frontend/http/harmony): Responses'
``reasoning.effort`` as harmony's effort, Anthropic ``thinking`` as the analysis channel (whole and
streamed; off: low effort, hidden; a budget caps max_tokens), and thinking blocks sent back rendered
as analysis where harmony keeps them. Served on tests/tiny_harmony.py's chained gpt-oss (one that
reasons, one that calls), with the official ``openai`` and ``anthropic`` clients."""
from __future__ import annotations

import datetime
import hashlib

import anthropic
import msgspec
import openai
import pytest

from frontend.http import messages_api, responses_api
from frontend.http.errors import ApiError
from frontend.http.harmony import encoding as harmony_encoding
from frontend.http.harmony import render

pytestmark = pytest.mark.skipif(not harmony_encoding.available(), reason="no o200k_base.tiktoken: run "
                                "python scripts/fetch_o200k.py (scripts/setup_env.sh does)")

TODAY = datetime.date(2026, 12, 2)
PARAMETERS = {"type": "object", "properties": {"city": {"type": "string"}}}
WEATHER = {"name": "get_weather", "input_schema": PARAMETERS}
ARGS = '{"city": "Paris"}'
THOUGHT = "The user wants the weather."
# what each served model writes after "<|start|>assistant" (a chain's tokens are distinct: one message)
REASONS = f"<|channel|>analysis<|message|>{THOUGHT}<|return|>"
CALLS = f"<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{ARGS}<|call|>"
ASK = [{"role": "user", "content": "Weather in Paris?"}]
SIGNATURE = hashlib.sha256(THOUGHT.encode()).hexdigest()


def ids_of(text: str) -> list[int]:
    return harmony_encoding.encoding().encode(text, allowed_special="all")


def rendered(chat) -> str:
    tools = [msgspec.to_builtins(t) for t in chat.tools] if chat.tools else None
    return harmony_encoding.encoding().decode(render.prompt_ids(chat, tools, TODAY))


def messages_body(**fields) -> messages_api.MessagesRequest:
    return msgspec.convert({"model": "m", "max_tokens": 100, "messages": ASK, **fields}, messages_api.MessagesRequest)


# ==== the adapters ====

@pytest.mark.parametrize("effort", ["low", "medium", "high"])
def test_responses_reasoning_effort_is_harmonys(effort):
    body = msgspec.convert({"model": "m", "input": "hi", "reasoning": {"effort": effort, "summary": "auto"}},
                           responses_api.ResponsesRequest)
    chat = responses_api.to_chat(body, harmony=True)
    assert chat.reasoning_effort == effort and f"Reasoning: {effort}" in rendered(chat)


@pytest.mark.parametrize("effort", ["minimal", "none", "xhigh"])
def test_efforts_harmony_cannot_express_are_refused_in_one_line(effort):
    body = msgspec.convert({"model": "m", "input": "hi", "reasoning": {"effort": effort}},
                           responses_api.ResponsesRequest)
    with pytest.raises(ApiError) as err:
        responses_api.to_chat(body, harmony=True)
    assert (err.value.status, err.value.param) == (400, "reasoning.effort") and "\n" not in str(err.value)
    assert "harmony" in str(err.value)


def test_responses_reasoning_items_sent_back_are_analysis_before_a_tool_result():
    reasoning = {"type": "reasoning", "id": "rs_1", "summary": [], "status": "completed",
                 "content": [{"type": "reasoning_text", "text": THOUGHT}]}
    call = {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": ARGS}
    result = {"type": "function_call_output", "call_id": "c1", "output": "20"}
    tool = {"type": "function", "name": "get_weather", "parameters": PARAMETERS}

    def text_of(items: list[dict], harmony: bool = True) -> str:
        body = msgspec.convert({"model": "m", "input": items, "tools": [tool]}, responses_api.ResponsesRequest)
        return rendered(responses_api.to_chat(body, harmony))

    assert f"<|channel|>analysis<|message|>{THOUGHT}<|end|><|start|>assistant to=functions" in text_of(
        [ASK[0], reasoning, call, result])
    answer = {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "20 C."}]}
    closed = [ASK[0], reasoning, call, result, reasoning, answer, {"role": "user", "content": "ok"}]
    assert THOUGHT not in text_of(closed)  # a final answer closed the turn: its analysis is dropped
    encrypted = {"type": "reasoning", "id": "rs_2", "summary": [], "encrypted_content": "opaque"}
    assert text_of([ASK[0], encrypted, call, result]) == text_of([ASK[0], call, result])  # nothing to read
    body = msgspec.convert({"model": "m", "input": [ASK[0], reasoning, call, result]}, responses_api.ResponsesRequest)
    assert responses_api.to_chat(body).messages[1].reasoning_content is None  # other models: dropped, as before


def test_messages_thinking_sets_the_effort_and_a_budget_caps_max_tokens():
    on = messages_api.to_chat(messages_body(thinking={"type": "enabled", "budget_tokens": 30}), None, harmony=True)
    assert (on.reasoning_effort, on.max_tokens, on.thinking_token_budget) == ("medium", 30, None)
    wide = messages_api.to_chat(messages_body(thinking={"type": "enabled", "budget_tokens": 500}), None, True)
    assert wide.max_tokens == 100  # max_tokens is the tighter cap
    adaptive = messages_api.to_chat(messages_body(thinking={"type": "adaptive"}), None, harmony=True)
    assert (adaptive.reasoning_effort, adaptive.max_tokens) == ("medium", 100)
    for fields in ({"thinking": {"type": "disabled"}}, {}):
        off = messages_api.to_chat(messages_body(**fields), None, harmony=True)
        assert off.reasoning_effort == "low" and "Reasoning: low" in rendered(off)


def _tool_loop(thinking: dict | None) -> list[dict]:
    use = {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}
    return [*ASK, {"role": "assistant", "content": [thinking, use] if thinking else [use]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "20"}]}]


def test_thinking_sent_back_is_analysis_before_a_tool_result_and_dropped_after_an_answer():
    block = {"type": "thinking", "thinking": THOUGHT, "signature": SIGNATURE}
    loop = messages_body(messages=_tool_loop(block), tools=[WEATHER], thinking={"type": "adaptive"})
    text = rendered(messages_api.to_chat(loop, None, harmony=True))
    assert (f"<|start|>assistant<|channel|>analysis<|message|>{THOUGHT}<|end|>"
            "<|start|>assistant to=functions.get_weather<|channel|>commentary") in text
    answered = [*_tool_loop(block), {"role": "assistant", "content": [block, {"type": "text", "text": "20 C."}]},
                {"role": "user", "content": "Thanks"}]
    text = rendered(messages_api.to_chat(messages_body(messages=answered, tools=[WEATHER]), None, harmony=True))
    assert THOUGHT not in text and "<|channel|>final<|message|>20 C.<|end|>" in text


# ==== served: the tiny chained gpt-oss models ====

def _serve(tmp_path_factory, reply: str):
    from tests.test_serving import start
    from tests.tiny_harmony import write_chained_gpt_oss

    model = tmp_path_factory.mktemp("gpt-oss-harmony")
    write_chained_gpt_oss(model, [ids_of("assistant")[0], *ids_of(reply)])  # after "<|start|>assistant": reply
    server = start(tmp_path_factory.mktemp("srv"), model, "--served-model-name", "tiny")
    return server, server.proc.stdout.readline().split()[-1]


@pytest.fixture(scope="module")
def reasons(tmp_path_factory):
    from tests.test_serving import stop

    server, url = _serve(tmp_path_factory, REASONS)
    yield url
    assert stop(server) == 0, server.log.read_text()[-3000:]


@pytest.fixture(scope="module")
def calls(tmp_path_factory):
    from tests.test_serving import stop

    server, url = _serve(tmp_path_factory, CALLS)
    yield url
    assert stop(server) == 0, server.log.read_text()[-3000:]


def _claude(url: str) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=url, api_key="none", max_retries=0, timeout=120)


def test_responses_with_reasoning_effort_returns_the_analysis_as_a_reasoning_item(reasons):
    client = openai.OpenAI(base_url=reasons + "/v1", api_key="none", max_retries=0, timeout=120)
    reply = client.responses.create(model="tiny", input="Weather in Paris?", reasoning={"effort": "high"})
    (item,) = reply.output
    assert (item.type, [c.text for c in item.content], reply.status) == ("reasoning", [THOUGHT], "completed")
    assert reply.usage.output_tokens_details.reasoning_tokens == len(ids_of(THOUGHT))
    streamed = list(client.responses.create(model="tiny", input="Weather in Paris?", reasoning={"effort": "low"},
                                            stream=True))
    assert "".join(e.delta for e in streamed if e.type == "response.reasoning_text.delta") == THOUGHT
    with pytest.raises(openai.BadRequestError) as err:
        client.responses.create(model="tiny", input="hi", reasoning={"effort": "minimal"})
    assert err.value.status_code == 400 and err.value.body["param"] == "reasoning.effort"


def test_messages_thinking_is_the_analysis_channel_whole_and_streamed(reasons):
    claude = _claude(reasons)
    fields = dict(model="tiny", max_tokens=40, messages=ASK, thinking={"type": "enabled", "budget_tokens": 1024})
    whole = claude.messages.create(**fields)
    (thought,) = whole.content
    assert (thought.type, thought.thinking, thought.signature, whole.stop_reason) == (
        "thinking", THOUGHT, SIGNATURE, "end_turn")
    with claude.messages.stream(**fields) as s:
        events = [e for e in s if e.type not in ("text", "thinking", "signature", "input_json")]
        final = s.get_final_message()
    kinds = [(e.type, _kind(e)) for e in events]
    deltas = [k for k in kinds if k == ("content_block_delta", "thinking_delta")]
    assert kinds[:2] == [("message_start", None), ("content_block_start", "thinking")] and len(deltas) > 1
    assert kinds[2 + len(deltas):] == [("content_block_delta", "signature_delta"), ("content_block_stop", None),
                                       ("message_delta", None), ("message_stop", None)]
    assert final.model_dump()["content"] == whole.model_dump()["content"]


def _kind(event) -> str | None:
    if event.type == "content_block_start":
        return event.content_block.type
    return event.delta.type if event.type == "content_block_delta" else None


def test_messages_thinking_off_hides_the_analysis_and_a_budget_caps_the_reply(reasons):
    claude = _claude(reasons)
    for thinking in ({"type": "disabled"}, None):
        reply = claude.messages.create(model="tiny", max_tokens=40, messages=ASK,
                                       **({"thinking": thinking} if thinking else {}))
        assert (reply.content, reply.stop_reason) == ([], "end_turn")
        assert reply.usage.output_tokens == len(ids_of(REASONS))  # generated, not shown
    cut = claude.messages.create(model="tiny", max_tokens=40, messages=ASK,
                                 thinking={"type": "enabled", "budget_tokens": 5})
    assert (cut.stop_reason, cut.usage.output_tokens) == ("max_tokens", 5)
    assert [(b.type, b.thinking) for b in cut.content] == [("thinking", "The user")]


def test_a_tool_round_trip_with_thinking_blocks_sent_back(reasons, calls):
    thought = _claude(reasons).messages.create(model="tiny", max_tokens=40, messages=ASK,
                                               thinking={"type": "adaptive"}).content[0]
    claude = _claude(calls)
    first = claude.messages.create(model="tiny", max_tokens=40, messages=ASK, tools=[WEATHER],
                                   thinking={"type": "enabled", "budget_tokens": 1024})
    (use,) = first.content
    assert (use.type, use.input, first.stop_reason) == ("tool_use", {"city": "Paris"}, "tool_use")
    block = {"type": "thinking", "thinking": thought.thinking, "signature": thought.signature}
    turn = _tool_loop(block)
    turn[1]["content"][1]["id"] = turn[2]["content"][0]["tool_use_id"] = use.id
    again = claude.messages.create(model="tiny", max_tokens=40, messages=turn, tools=[WEATHER],
                                   thinking={"type": "enabled", "budget_tokens": 1024})
    assert again.stop_reason == "tool_use" and [b.type for b in again.content] == ["tool_use"]

    def counted(messages: list[dict]) -> int:
        return claude.messages.count_tokens(model="tiny", messages=messages, tools=[WEATHER],
                                            thinking={"type": "adaptive"}).input_tokens

    kept = len(ids_of(f"<|start|>assistant<|channel|>analysis<|message|>{THOUGHT}<|end|>"))
    assert counted(turn) == counted(_tool_loop(None)) + kept  # before a tool result: analysis
    assert again.usage.input_tokens + (again.usage.cache_read_input_tokens or 0) == counted(turn)
    text, thanks = {"type": "text", "text": "20 C."}, {"role": "user", "content": "Thanks"}
    closed = [*_tool_loop(block), {"role": "assistant", "content": [block, text]}, thanks]
    bare = [*_tool_loop(None), {"role": "assistant", "content": [text]}, thanks]
    assert counted(closed) == counted(bare)  # a final answer closed the turn: its analysis is dropped


def test_a_responses_tool_round_trip_with_the_reasoning_item_sent_back(reasons, calls):
    thinker = openai.OpenAI(base_url=reasons + "/v1", api_key="none", max_retries=0, timeout=120)
    (reasoning,) = thinker.responses.create(model="tiny", input="Weather in Paris?").output
    client = openai.OpenAI(base_url=calls + "/v1", api_key="none", max_retries=0, timeout=120)
    tool = {"type": "function", "name": "get_weather", "parameters": PARAMETERS, "strict": False}
    first = client.responses.create(model="tiny", input="Weather in Paris?", tools=[tool], reasoning={"effort": "low"})
    (call,) = first.output
    result = {"type": "function_call_output", "call_id": call.call_id, "output": "20"}
    sent, bare = ([ASK[0], *items, call, result] for items in ([reasoning], []))
    again = [client.responses.create(model="tiny", input=items, tools=[tool], max_output_tokens=2)
             for items in (sent, bare)]
    kept = len(ids_of(f"<|start|>assistant<|channel|>analysis<|message|>{THOUGHT}<|end|>"))
    assert again[0].usage.input_tokens == again[1].usage.input_tokens + kept  # before a tool result: analysis
