"""``POST /v1/messages`` and ``/v1/messages/count_tokens`` (Anthropic's Messages API) end to end with
the official ``anthropic`` client, the frontend process and tests/fake_scheduler.py, which echoes the
rendered prompt then EOS: with test_http.py's template every reply shows exactly what the model was
given. The last test runs the real scheduler on test_http_serving.py's tiny model."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import anthropic
import httpx
import pytest

sys.path.insert(0, str(Path(__file__).parent))
from test_http import CALL, KEY, WAIT_S, assert_one_abort, start, stop  # noqa: E402
from test_http_serving import model_dir  # noqa: E402,F401  (a fixture)

from frontend.client import Client  # noqa: E402
from frontend.http import messages_objects  # noqa: E402
from frontend.http.errors import ApiError  # noqa: E402
from tests import test_serving  # noqa: E402

ALIAS = "claude-sonnet-4-5"
WEATHER = {"name": "get_weather", "description": "the weather in a city", "cache_control": {"type": "ephemeral"},
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}
USER = [{"role": "user", "content": "hello"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    proc, endpoint, url = start(tmp_path_factory.mktemp("messages"), "--http-port", "0", "--api-key", KEY,
                                "--served-model-name", "fake", ALIAS)
    yield url, endpoint
    assert stop(proc) == 0


@pytest.fixture
def claude(server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server[0], api_key=KEY, max_retries=0, timeout=WAIT_S)


def _create(claude: anthropic.Anthropic, **fields) -> anthropic.types.Message:
    return claude.messages.create(**{"model": "fake", "max_tokens": 300, "messages": USER, **fields})


def _streamed(claude: anthropic.Anthropic, **fields) -> tuple[list, anthropic.types.Message]:
    """The raw events (pings skipped by the client) and the message the client assembles."""
    with claude.messages.stream(**{"model": "fake", "max_tokens": 300, "messages": USER, **fields}) as s:
        events = [e for e in s if e.type not in ("text", "input_json")]  # the helper's own events
        return events, s.get_final_message()


def test_text_reply_with_usage_and_cache_reads(claude):
    reply = _create(claude)
    prompt = "user:hello|"
    assert reply.id.startswith("msg_") and (reply.type, reply.role, reply.model) == ("message", "assistant", "fake")
    assert [(b.type, b.text) for b in reply.content] == [("text", prompt)]
    assert (reply.stop_reason, reply.stop_sequence) == ("end_turn", None)
    u = reply.usage  # byte tokens; the fake's cache holds 2; the EOS that ended the echo counts
    assert (u.input_tokens, u.cache_read_input_tokens, u.cache_creation_input_tokens) == (len(prompt) - 2, 2, 0)
    assert u.output_tokens == len(prompt) + 1


def test_system_and_text_blocks_reach_the_template(claude):
    system = [{"type": "text", "text": "be brief", "cache_control": {"type": "ephemeral"}}]
    content = [{"type": "text", "text": "hi "}, {"type": "text", "text": "there", "cache_control": {"type": "ephemeral"}}]
    reply = _create(claude, system=system, messages=[{"role": "user", "content": content}],
                    metadata={"user_id": "u1"}, thinking={"type": "disabled"})
    assert reply.content[0].text == "system:be brief|user:hi there|"
    assert _create(claude, system="terse").content[0].text == "system:terse|user:hello|"


def test_streamed_text_in_order_equals_the_whole_reply(claude):
    events, final = _streamed(claude)
    kinds = [e.type for e in events]
    assert kinds[:2] == ["message_start", "content_block_start"] and kinds[-3:] == [
        "content_block_stop", "message_delta", "message_stop"]
    assert set(kinds[2:-3]) == {"content_block_delta"}
    start_usage = events[0].message.usage
    assert (start_usage.input_tokens, start_usage.output_tokens) == (len("user:hello|"), 0)
    assert "".join(e.delta.text for e in events if e.type == "content_block_delta") == "user:hello|"
    whole = _create(claude)
    assert final.content[0].text == whole.content[0].text and final.stop_reason == "end_turn"
    assert final.usage.model_dump() == whole.usage.model_dump()


def test_tool_use_is_parsed_from_the_reply(claude):
    reply = _create(claude, tools=[WEATHER], messages=[{"role": "user", "content": "let me check " + CALL}])
    text, call, tail = reply.content
    assert text.text == "[get_weather]user:let me check" and tail.text == "|"  # the template saw the tool
    assert call.type == "tool_use" and call.id.startswith("toolu_")
    assert (call.name, call.input) == ("get_weather", {"city": "Paris"})
    assert reply.stop_reason == "tool_use"


def test_streamed_tool_use_input_joins_into_the_input(claude):
    events, final = _streamed(claude, tools=[WEATHER], tool_choice={"type": "auto"},
                              messages=[{"role": "user", "content": CALL}])
    starts = [e for e in events if e.type == "content_block_start"]
    assert [s.content_block.type for s in starts] == ["text", "tool_use", "text"]
    tool = starts[1]
    assert tool.content_block.input == {} and tool.content_block.name == "get_weather"
    parts = [e.delta.partial_json for e in events if e.type == "content_block_delta" and e.index == tool.index]
    assert json.loads("".join(parts)) == {"city": "Paris"} == final.content[1].input
    assert final.stop_reason == "tool_use" and final.content[1].id == tool.content_block.id


def test_a_call_whose_arguments_are_not_an_object_stays_text(claude):
    call = '<tool_call>{"name": "get_weather", "arguments": [1, 2]}</tool_call>'
    reply = _create(claude, tools=[WEATHER], messages=[{"role": "user", "content": call}])
    assert [b.type for b in reply.content] == ["text"] and reply.stop_reason == "end_turn"
    assert reply.content[0].text == "[get_weather]user:" + call + "|"


def test_tool_choice_none_hides_the_tools_and_parses_nothing(claude):
    reply = _create(claude, tools=[WEATHER], tool_choice={"type": "none"},
                    messages=[{"role": "user", "content": CALL}])
    assert [b.text for b in reply.content] == ["user:" + CALL + "|"] and reply.stop_reason == "end_turn"


def test_tool_result_turn_renders_through_the_template(claude):
    messages = [
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": [{"type": "text", "text": "checking"}, {
            "type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny"},
            {"type": "tool_result", "tool_use_id": "toolu_1", "is_error": True,
             "content": [{"type": "text", "text": "rate "}, {"type": "text", "text": "limited"}]},
            {"type": "text", "text": "thanks"}]},
    ]
    reply = _create(claude, messages=messages)
    assert reply.content[0].text == ('user:weather?|assistant:checking<call get_weather {"city": "Paris"}>|'
                                     'tool(get_weather):sunny|tool(get_weather):rate limited|user:thanks|')


def test_stop_sequences_whole_and_streamed(claude):
    fields = dict(messages=[{"role": "user", "content": "hello world"}], stop_sequences=["zzz", "wor"])
    reply = _create(claude, **fields)
    assert [b.text for b in reply.content] == ["user:hello "]
    assert (reply.stop_reason, reply.stop_sequence) == ("stop_sequence", "wor")
    events, final = _streamed(claude, **fields)
    assert (final.stop_reason, final.stop_sequence, final.content[0].text) == ("stop_sequence", "wor", "user:hello ")
    capped = _create(claude, max_tokens=5)
    assert (capped.stop_reason, capped.content[0].text, capped.usage.output_tokens) == ("max_tokens", "user:", 5)


def test_sampling_fields_reach_the_scheduler(claude, server):
    # Sent as extra_body: the newest anthropic client no longer types them; older clients send them.
    _create(claude, extra_body={"temperature": 0.25, "top_p": 0.5, "top_k": 3})
    with Client(server[1], timeout=WAIT_S, api_key=KEY) as c:
        assert c.stats()["last_temperature"] == 0.25


def test_count_tokens_equals_the_usage_of_the_same_request(claude):
    request = dict(system="be brief", tools=[WEATHER], messages=[{"role": "user", "content": "count me"}])
    counted = claude.messages.count_tokens(model="fake", **request).input_tokens
    reply = _create(claude, **request)
    # Anthropic's split: input_tokens are the prompt tokens the cache did not hold.
    assert counted == reply.usage.input_tokens + reply.usage.cache_read_input_tokens
    assert counted == len(reply.content[0].text)  # the echo is the prompt, one byte a token
    events, _ = _streamed(claude, **request)
    assert events[0].message.usage.input_tokens == counted


def test_keys_by_header_and_bearer_and_a_wrong_key(server):
    assert _create(anthropic.Anthropic(base_url=server[0], api_key=KEY, max_retries=0)).content
    assert _create(anthropic.Anthropic(base_url=server[0], auth_token=KEY, max_retries=0)).content
    with pytest.raises(anthropic.AuthenticationError) as err:
        _create(anthropic.Anthropic(base_url=server[0], api_key="wrong", max_retries=0))
    assert err.value.status_code == 401 and err.value.body["type"] == "error"
    assert err.value.body["error"]["type"] == "authentication_error" and "x-api-key" in err.value.body["error"]["message"]
    openai_shape = httpx.post(server[0] + "/v1/chat/completions", json={}).json()  # OpenAI's path, its shape
    assert openai_shape["error"]["code"] == "invalid_api_key"


def test_model_alias_is_served_and_unknown_models_are_not(claude, server):
    reply = _create(claude, model=ALIAS)
    assert reply.model == ALIAS and reply.content[0].text == "user:hello|"
    chat = httpx.post(server[0] + "/v1/chat/completions", headers={"Authorization": f"Bearer {KEY}"},
                      json={"model": ALIAS, "messages": USER, "max_tokens": 50}, timeout=WAIT_S)
    assert chat.status_code == 200 and chat.json()["model"] == ALIAS
    models = httpx.get(server[0] + "/v1/models", headers={"x-api-key": KEY}).json()
    assert [m["id"] for m in models["data"]] == ["fake"]  # the primary name only
    with pytest.raises(anthropic.NotFoundError) as err:
        _create(claude, model="claude-opus-9")
    assert err.value.body["error"]["type"] == "not_found_error" and "claude-opus-9" in str(err.value)


REFUSALS = [
    ({"tool_choice": {"type": "tool"}, "tools": [WEATHER]}, "tool_choice 'tool' needs the tool's name"),
    ({"tool_choice": {"type": "tool", "name": "get_time"}, "tools": [WEATHER]}, "no tool named 'get_time'"),
    ({"tool_choice": {"type": "any"}, "tools": [{**WEATHER, "input_schema": {"type": "object", "properties": {
        "city": {"type": "string"}}, "not": {"required": ["x"]}}}]}, 'Unimplemented keys: ["not"]'),
    ({"tool_choice": {"type": "auto", "disable_parallel_tool_use": True}, "tools": [WEATHER]}, "disable_parallel"),
    ({"thinking": {"type": "enabled", "budget_tokens": 2048}}, "its chat template has no reasoning"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {
        "type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}]}]}, "of type 'image' is not supported"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": [
        {"type": "document", "source": {}}]}]}]}, "of type 'document' is not supported"),
    ({"top_a": 0.5}, "unknown field `top_a`"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "x", "weight": 2}]}]}, "unknown field `weight`"),
    ({"tools": [{"type": "web_search_20250305", "name": "web_search", "max_uses": 5}]}, "runs no server tools"),
    ({"output_config": {"effort": "low"}}, "output_config is not supported"),
    ({"messages": USER + [{"role": "assistant", "content": "The answer is"}]}, "prefill"),
    ({"max_tokens": None}, "max_tokens"),
    ({"stop_sequences": [""]}, "stop"),
]


@pytest.mark.parametrize("fields, match", REFUSALS)
def test_refusals_name_the_field_in_anthropics_error_shape(server, fields, match):
    body = {"model": "fake", "max_tokens": 50, "messages": USER, **fields}
    body = {k: v for k, v in body.items() if v is not None}
    reply = httpx.post(server[0] + "/v1/messages", headers={"x-api-key": KEY}, json=body, timeout=WAIT_S)
    assert reply.status_code == 400, reply.text
    assert reply.json()["type"] == "error" and reply.json()["error"]["type"] == "invalid_request_error"
    message = reply.json()["error"]["message"]
    assert match in message and "\n" not in message


def test_malformed_json_and_a_refusal_through_the_client(server, claude):
    reply = httpx.post(server[0] + "/v1/messages/count_tokens", headers={"x-api-key": KEY},
                       content=b'{"model": "fake", "messages": [', timeout=WAIT_S)
    assert reply.status_code == 400 and reply.json()["error"]["message"].startswith("malformed JSON")
    with pytest.raises(anthropic.BadRequestError, match="thinking"):
        _create(claude, thinking={"type": "enabled", "budget_tokens": 1024})


@pytest.mark.parametrize("path", ["/v1/messages", "/v1/messages/count_tokens"])
def test_text_past_the_prompt_limit_is_refused_before_tokenizing(server, path):
    """A body under the byte limit whose text is past --max-prompt-chars (1M by default): rendering
    and tokenizing 20 MB takes a 2-core machine tens of seconds, past a client's patience; now one line, at once."""
    body = {"model": "fake", "max_tokens": 8, "messages": [{"role": "user", "content": "x " * 600_000}]}
    if path.endswith("count_tokens"):
        del body["max_tokens"]
    reply = httpx.post(server[0] + path, headers={"x-api-key": KEY}, json=body, timeout=WAIT_S)
    assert reply.status_code == 400 and reply.json()["error"]["type"] == "invalid_request_error"
    assert reply.json()["error"]["message"] == ("the messages hold 1200000 characters of text; this server takes "
                                               "at most 1000000 (--max-prompt-chars)")


@pytest.mark.parametrize("status, kind", [(400, "invalid_request_error"), (401, "authentication_error"),
                                          (404, "not_found_error"), (413, "request_too_large"),
                                          (405, "invalid_request_error"), (500, "api_error"),
                                          (503, "overloaded_error")])
def test_error_types_follow_the_status(status, kind):
    response = messages_objects.error_response(ApiError(status, "why"))
    assert response.status_code == status
    assert json.loads(response.body) == {"type": "error", "error": {"type": kind, "message": "why"}}


def test_a_stream_pings_early_and_while_nothing_comes(tmp_path):
    """A prompt that hangs after one token: pings keep the stream open; leaving aborts it."""
    proc, endpoint, url = start(tmp_path, "--http-port", "0", "--hang-id", str(ord("u")))
    try:
        body = {"model": "fake", "max_tokens": 50, "messages": USER, "stream": True}
        with httpx.stream("POST", url + "/v1/messages", json=body, timeout=WAIT_S) as response:
            names = []
            for line in response.iter_lines():
                if line.startswith("event: "):
                    names.append(line[len("event: "):])
                if names.count("ping") == 2:
                    break
        assert names[:2] == ["message_start", "ping"]
        assert names[2:] == ["content_block_start", "content_block_delta", "ping"]
        assert_one_abort(endpoint)
    finally:
        assert stop(proc) == 0


def test_real_scheduler_streamed_and_whole_agree(tmp_path, model_dir):  # noqa: F811
    s = test_serving.start(tmp_path, model_dir, "--served-model-name", "tiny", ALIAS)
    try:
        url = s.proc.stdout.readline().split()[-1]
        claude = anthropic.Anthropic(base_url=url, api_key="none", max_retries=0, timeout=test_serving.WAIT_S)
        request = dict(model=ALIAS, max_tokens=12, system="you are terse", extra_body={"temperature": 0},
                       messages=[{"role": "user", "content": "tell me about sluices"}])
        whole = claude.messages.create(**request)
        with claude.messages.stream(**request) as stream:
            text = "".join(stream.text_stream)
            streamed = stream.get_final_message()
        assert text == whole.content[0].text == streamed.content[0].text
        assert whole.stop_reason in ("end_turn", "max_tokens") and streamed.stop_reason == whole.stop_reason
        counted = claude.messages.count_tokens(model=ALIAS, system=request["system"],
                                               messages=request["messages"]).input_tokens
        u = streamed.usage  # the second time, the prompt is in the prefix cache
        assert counted == whole.usage.input_tokens + whole.usage.cache_read_input_tokens
        assert counted == u.input_tokens + u.cache_read_input_tokens and u.cache_read_input_tokens > 0
        assert u.output_tokens == whole.usage.output_tokens
        with Client(s.endpoint, timeout=test_serving.WAIT_S) as c:
            test_serving.assert_pages_settled(c)
    finally:
        assert test_serving.stop(s) == 0, s.log.read_text()[-3000:]
