"""``POST /v1/responses`` end to end with the official ``openai`` client (and the ``openai-agents``
SDK where installed), the frontend process and tests/fake_scheduler.py, which echoes the rendered
prompt then EOS: with test_http.py's template every reply shows exactly what the model was given."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

import httpx
import openai
import pytest

sys.path.insert(0, str(Path(__file__).parent))
from test_http import CALL, KEY, WAIT_S, assert_one_abort, start, stop  # noqa: E402

from frontend.http import sse  # noqa: E402

WEATHER = {"type": "function", "name": "get_weather", "description": "the weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}, "strict": False}
HOSTED = [{"type": "web_search"}, {"type": "file_search", "vector_store_ids": ["vs_1"]},
          {"type": "code_interpreter", "container": {"type": "auto"}}, {"type": "image_generation"},
          {"type": "mcp", "server_label": "x", "server_url": "https://example.com/mcp"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("responses")
    proc, _, url = start(tmp, "--http-port", "0", "--api-key", KEY)
    yield url, tmp / "stderr"
    assert stop(proc) == 0


@pytest.fixture
def oai(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server[0] + "/v1", api_key=KEY, max_retries=0, timeout=WAIT_S)


def _events(stream) -> list:
    events = list(stream)
    assert [e.sequence_number for e in events] == list(range(len(events)))
    return events


def test_text_input_with_usage_and_cached_tokens(oai):
    reply = oai.responses.create(model="fake", input="hello")
    prompt = "user:hello|"
    assert reply.id.startswith("resp_") and reply.object == "response" and reply.status == "completed"
    assert reply.output_text == prompt and reply.incomplete_details is None
    (message,) = reply.output
    assert (message.type, message.role, message.status) == ("message", "assistant", "completed")
    assert message.content[0].type == "output_text" and message.content[0].annotations == []
    u = reply.usage  # byte tokens: one per character, plus the EOS that ended the echo
    assert (u.input_tokens, u.output_tokens, u.total_tokens) == (len(prompt), len(prompt) + 1, 2 * len(prompt) + 1)
    assert u.input_tokens_details.cached_tokens == 2 and u.output_tokens_details.reasoning_tokens == 0
    assert (reply.tool_choice, reply.tools, reply.parallel_tool_calls) == ("auto", [], True)


def test_instructions_and_message_items(oai):
    reply = oai.responses.create(model="fake", instructions="be kind", input=[
        {"role": "user", "content": "hi"},
        {"type": "message", "id": "msg_1", "role": "assistant", "status": "completed",
         "content": [{"type": "output_text", "text": "yo", "annotations": []}]},
        {"type": "reasoning", "id": "rs_1", "summary": [], "encrypted_content": "opaque"},  # dropped
        {"role": "developer", "content": [{"type": "input_text", "text": "be brief"}]},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "again"}]}])
    assert reply.output_text == "system:be kind|user:hi|assistant:yo|system:be brief|user:again|"
    assert reply.instructions == "be kind"


def test_function_call_and_its_output_render_through_the_template(oai):
    reply = oai.responses.create(model="fake", tools=[WEATHER], input=[
        {"role": "user", "content": "weather?"},
        {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
        {"type": "function_call", "call_id": "c2", "name": "get_weather", "arguments": '{"city": "Rome"}'},
        {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
        {"type": "function_call_output", "call_id": "c2", "output": [{"type": "input_text", "text": "rain"}]}])
    assert reply.output_text == (
        '[get_weather]user:weather?|assistant:<call get_weather {"city": "Paris"}>'
        '<call get_weather {"city": "Rome"}>|tool(get_weather):sunny|tool(get_weather):rain|')
    assert [t.name for t in reply.tools] == ["get_weather"] and reply.tools[0].type == "function"


def _call_reply_shape(output) -> list:
    return [(i.type, i.content[0].text if i.type == "message" else (i.name, json.loads(i.arguments)))
            for i in output]


EXPECTED_CALL_OUTPUT = [("message", "[get_weather]user:let me check"),
                        ("function_call", ("get_weather", {"city": "Paris"})), ("message", "|")]


def test_a_tool_call_in_the_reply_is_a_function_call_item(oai):
    reply = oai.responses.create(model="fake", input="let me check " + CALL, tools=[WEATHER])
    assert _call_reply_shape(reply.output) == EXPECTED_CALL_OUTPUT
    call = reply.output[1]
    assert call.id.startswith("fc_") and call.call_id.startswith("call_") and call.status == "completed"


def test_tool_choice_none_hides_the_tools_and_parses_nothing(oai):
    reply = oai.responses.create(model="fake", input=CALL, tools=[WEATHER], tool_choice="none")
    assert reply.output_text == "user:" + CALL + "|" and [i.type for i in reply.output] == ["message"]
    assert reply.tool_choice == "none" and [t.name for t in reply.tools] == ["get_weather"]


def test_a_call_of_a_namespace_function_names_its_namespace(oai):
    crm = {"type": "namespace", "name": "crm", "description": "customers", "tools": [WEATHER]}
    reply = oai.responses.create(model="fake", input="let me check " + CALL, tools=[crm])
    assert reply.output_text.startswith("[get_weather]user:")  # the model sees the function itself
    (call,) = [i for i in reply.output if i.type == "function_call"]
    assert (call.name, call.namespace) == ("get_weather", "crm")
    plain = oai.responses.create(model="fake", input="let me check " + CALL, tools=[WEATHER])
    assert [i.namespace for i in plain.output if i.type == "function_call"] == [None]


def test_a_tool_call_streams_as_typed_events(oai):
    events = _events(oai.responses.create(model="fake", input="let me check " + CALL,
                                          tools=[WEATHER], stream=True))
    kinds = [e.type for e in events]
    message = ["response.output_item.added", "response.content_part.added", "response.output_text.delta"]
    closed = ["response.output_text.done", "response.content_part.done", "response.output_item.done"]
    call = ["response.output_item.added", "response.function_call_arguments.delta",
            "response.function_call_arguments.done", "response.output_item.done"]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    assert [k for i, k in enumerate(kinds) if k != "response.output_text.delta" or kinds[i - 1] != k] == (
        ["response.created", "response.in_progress"] + message + closed + call + message + closed
        + ["response.completed"])
    final = events[-1].response
    assert final.status == "completed" and _call_reply_shape(final.output) == EXPECTED_CALL_OUTPUT
    deltas = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    (done,) = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert deltas == done.arguments == final.output[1].arguments and done.item_id == final.output[1].id
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta" and e.output_index == 0)
    assert text == final.output[0].content[0].text
    assert final.usage.input_tokens_details.cached_tokens == 2


def test_the_stream_helper_accumulates_the_same_response(oai):
    with oai.responses.stream(model="fake", input="hello") as stream:
        final = stream.get_final_response()
    assert final.output_text == "user:hello|" and final.status == "completed"


def test_max_output_tokens_gives_an_incomplete_response(oai):
    reply = oai.responses.create(model="fake", input="hello", max_output_tokens=4)
    assert reply.status == "incomplete" and reply.incomplete_details.reason == "max_output_tokens"
    assert reply.output_text == "user" and reply.output[0].status == "incomplete"
    assert reply.usage.output_tokens == 4 and reply.max_output_tokens == 4
    events = _events(oai.responses.create(model="fake", input="hello", max_output_tokens=4, stream=True))
    assert events[-1].type == "response.incomplete"
    assert events[-1].response.incomplete_details.reason == "max_output_tokens"


def test_hosted_tools_are_dropped_with_one_log_line(oai, server):
    reply = oai.responses.create(model="fake", input="hi", tools=[*HOSTED, WEATHER])
    assert reply.output_text == "[get_weather]user:hi|" and [t.name for t in reply.tools] == ["get_weather"]
    logged = [line for line in server[1].read_text().splitlines() if "dropped hosted tools" in line]
    assert len(logged) == 1 and all(t["type"] in logged[0] for t in HOSTED)


ITEM_INPUT = [{"role": "user", "content": "hi"}]
REFUSED = [
    ({"store": True}, "store", "stateless: store is not supported"),
    ({"previous_response_id": "resp_1"}, "previous_response_id", "stateless"),
    ({"conversation": "conv_1"}, "conversation", "stateless"),
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "array", "uniqueItems": True}}}},
     "response_format", 'Unimplemented keys: ["uniqueItems"]'),
    ({"text": {"format": {"type": "grammar"}}}, "response_format", "'grammar' is not supported"),
    ({"reasoning": {"effort": "high"}}, "reasoning.effort", "'high'"),
    ({"reasoning": {"effort": "none"}}, "reasoning_effort", "enable_thinking"),  # the template has none
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "name": "get_time"}}, "tool_choice",
     "no tool named 'get_time'"),
    ({"tools": [WEATHER], "tool_choice": {"type": "allowed_tools", "tools": []}}, "tool_choice", "'allowed_tools'"),
    ({"tools": [{"type": "custom", "name": "apply_patch"}]}, "tools[0]", "'custom'"),
    ({"tools": [{"type": "namespace", "name": "n", "description": "", "tools": [{"type": "custom", "name": "x"}]}]},
     "tools[0].tools[0]", "'custom'"),
    ({"tools": [WEATHER, {"type": "namespace", "name": "n", "description": "", "tools": [WEATHER]}]},
     "tools", "one name"),
    ({"top_logprobs": 2}, "top_logprobs", "logprobs"),
    ({"include": ["message.output_text.logprobs"]}, "include", "logprobs"),
    ({"truncation": "auto"}, "truncation", "never cut"),
    ({"background": True}, "background", "background"),
    ({"max_tool_calls": 1}, "max_tool_calls", "max_tool_calls"),
    ({"frobnicate": 1}, None, "frobnicate"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "data:image/png;base64,AA=="}]}]},
     "input[0]", "'input_image'"),
    ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "file_1"}]}]},
     "input[0]", "'input_file'"),
    ({"input": [*ITEM_INPUT, {"type": "function_call_output", "call_id": "c9", "output": "x"}]},
     "input[1]", "'c9'"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0]", "stateless"),
    ({"input": [{"type": "computer_call_output", "call_id": "c1", "output": {}}]}, "input[0]",
     "'computer_call_output'"),
    ({"input": []}, "input", "no message"),
    ({"model": "other"}, "model", "not served"),
]


@pytest.mark.parametrize("fields, param, words", REFUSED, ids=[r[2] + "-" + str(r[1]) for r in REFUSED])
def test_refusals_are_openai_errors_in_one_line(oai, fields, param, words):
    body = {"model": "fake", "input": "hi", **fields}
    with pytest.raises((openai.BadRequestError, openai.NotFoundError)) as err:
        oai.responses.create(**{k: v for k, v in body.items() if k != "frobnicate"},
                             extra_body={"frobnicate": 1} if "frobnicate" in body else None)
    error = err.value.body
    assert words in error["message"] and "\n" not in error["message"]
    assert error["param"] == param and error["type"] in ("invalid_request_error", "not_found_error")


def test_accepted_fields_that_do_not_change_the_output(oai):
    reply = oai.responses.create(
        model="fake", input="hi", store=False, metadata={"k": "v"}, user="u", parallel_tool_calls=False,
        include=["reasoning.encrypted_content"], prompt_cache_key="p", safety_identifier="s",
        reasoning={"effort": "medium", "summary": "auto"}, text={"format": {"type": "text"}},
        truncation="disabled", temperature=0.5, top_p=0.9, service_tier="auto")
    assert reply.output_text == "user:hi|" and reply.metadata == {"k": "v"}
    assert (reply.parallel_tool_calls, reply.temperature, reply.top_p) == (False, 0.5, 0.9)


def test_a_request_shaped_as_codex_cli_sends_it(oai):
    """Codex CLI 0.169's first request, trimmed: developer messages, a namespace of functions,
    web_search, client_metadata; it was also run as is against this fake server."""
    shell = {**WEATHER, "name": "exec_command"}
    agents_ns = {"type": "namespace", "name": "multi_agent_v1", "description": "sub-agents", "tools": [WEATHER]}
    events = _events(oai.responses.create(
        model="fake", stream=True, tool_choice="auto", parallel_tool_calls=True, store=False,
        reasoning={"summary": "auto"}, include=["reasoning.encrypted_content"], prompt_cache_key="t1",
        tools=[shell, agents_ns, {"type": "web_search", "external_web_access": False}],
        input=[{"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "rules"}]},
               {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "say hi"}]}],
        extra_body={"client_metadata": {"thread_id": "t1", "turn_id": "u1"}}))
    assert events[-1].type == "response.completed"
    assert events[-1].response.output_text == "[exec_command][get_weather]system:rules|user:say hi|"


def test_an_error_after_the_stream_started_is_response_failed():
    from frontend.http.errors import ApiError
    from frontend.http.responses_api import ResponsesRequest, frame
    from frontend.http.responses_reply import ResponseBuilder

    builder = ResponseBuilder(frame(ResponsesRequest(model="m", input="x")), streaming=True,
                              count_tokens=len)
    (event,) = builder.fail(ApiError(503, "the scheduler stopped", "scheduler_died"))
    name, data = event.decode().split("\n")[:2]
    body = json.loads(data.removeprefix("data: "))
    assert name == "event: response.failed" and body["response"]["status"] == "failed"
    assert body["response"]["error"] == {"code": "scheduler_died", "message": "the scheduler stopped"}


def test_a_stalled_stream_is_kept_alive_and_leaving_aborts_it(tmp_path):
    """A prompt that hangs after one token: a comment comes while nothing else does; closing the
    connection aborts the request in the scheduler."""
    proc, endpoint, url = start(tmp_path, "--http-port", "0", "--hang-id", str(ord("u")))
    try:
        body = {"model": "fake", "input": "hi", "stream": True}
        with httpx.stream("POST", url + "/v1/responses", json=body, timeout=WAIT_S) as response:
            lines = []
            for line in response.iter_lines():
                lines.append(line)
                if line.startswith(":"):
                    break
        names = [line.removeprefix("event: ") for line in lines if line.startswith("event: ")]
        assert names == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added", "response.output_text.delta"]
        assert_one_abort(endpoint)
    finally:
        assert stop(proc) == 0


def test_keepalive_ticks_while_waiting_and_closes_the_inner_stream():
    closed = []

    async def slow():
        try:
            await asyncio.sleep(0.25)
            yield b"first"
            await asyncio.sleep(1.0)
            yield b"never read"
        finally:
            closed.append(True)

    async def read() -> list[bytes]:
        got = []
        stream = sse.keepalive(slow(), every_s=0.1)
        async for e in stream:
            got.append(e)
            if e == b"first":
                break
        await stream.aclose()
        return got

    got = asyncio.run(read())
    assert got[-1] == b"first" and set(got[:-1]) == {sse.COMMENT} and len(got) >= 3
    assert closed == [True]


def test_stream_has_no_done_marker_and_names_every_event(server):
    with httpx.stream("POST", server[0] + "/v1/responses", headers={"Authorization": f"Bearer {KEY}"},
                      json={"model": "fake", "input": "hi", "stream": True}, timeout=WAIT_S) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        blocks = [b for b in r.read().decode().split("\n\n") if b and not b.startswith(":")]
    assert "[DONE]" not in "".join(blocks)
    for block in blocks:
        name, data = block.split("\n")
        assert name.removeprefix("event: ") == json.loads(data.removeprefix("data: "))["type"]


try:
    import agents
except ImportError:
    agents = None
needs_agents = pytest.mark.skipif(agents is None, reason="openai-agents is not installed")


@needs_agents
@pytest.mark.parametrize("streamed", [False, True])
def test_an_agent_calls_a_function_tool_through_the_responses_model(server, streamed):
    """The echo makes the first reply a call of get_weather; the agent stops on that tool's result."""
    agents.set_tracing_disabled(True)
    seen = []

    @agents.function_tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        seen.append(city)
        return f"sunny in {city}"

    client = openai.AsyncOpenAI(base_url=server[0] + "/v1", api_key=KEY, max_retries=0, timeout=WAIT_S)
    model = agents.OpenAIResponsesModel(model="fake", openai_client=client)
    agent = agents.Agent(name="w", instructions="be brief", model=model, tools=[get_weather],
                         tool_use_behavior="stop_on_first_tool")

    async def run():
        if not streamed:
            return await agents.Runner.run(agent, "let me check " + CALL)
        result = agents.Runner.run_streamed(agent, "let me check " + CALL)
        async for _ in result.stream_events():
            pass
        return result

    result = asyncio.run(run())
    assert seen == ["Paris"] and result.final_output == "sunny in Paris"


@needs_agents
def test_an_agent_sends_its_history_back_as_items(server):
    """Each turn the echo calls the tool again: a second call proves the SDK's second request,
    with the first reply's items and the tool's output in its input, was accepted."""
    agents.set_tracing_disabled(True)
    seen = []

    @agents.function_tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        seen.append(city)
        return "sunny"

    client = openai.AsyncOpenAI(base_url=server[0] + "/v1", api_key=KEY, max_retries=0, timeout=WAIT_S)
    agent = agents.Agent(name="w", model=agents.OpenAIResponsesModel(model="fake", openai_client=client),
                         tools=[get_weather])
    with pytest.raises(agents.MaxTurnsExceeded):
        asyncio.run(agents.Runner.run(agent, "let me check " + CALL, max_turns=2))
    assert seen == ["Paris", "Paris"]


# ==== a reasoning model's template: <think> opened by the generation prompt, XML calls ====

# Tool names, then the messages' text, then "<think>\n": echoed, a reply starts inside reasoning.
THINKING = ("{# calls as <function=NAME><parameter=ARG>VALUE</parameter></function> #}"
            "{% for t in tools or [] %}[{{ t.function.name }}]{% endfor %}"
            "{% for m in messages %}{{ m.content }}{% endfor %}<think>\n")
XML_CALL = "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call>"
THOUGHT_INPUT = "plan</think>\n\nChecking." + XML_CALL


@pytest.fixture(scope="module")
def thinking(tmp_path_factory) -> openai.OpenAI:
    proc, _, url = start(tmp_path_factory.mktemp("thinking"), "--http-port", "0", template=THINKING)
    yield openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=WAIT_S)
    assert stop(proc) == 0


def _shape(output) -> list:
    def what(i):
        if i.type == "function_call":
            return i.name, json.loads(i.arguments)
        return i.content[0].text
    return [(i.type, what(i)) for i in output]


# The echo ends with the generation prompt's "<think>": content, since reasoning opens a reply only.
EXPECTED_THOUGHT = [("reasoning", "[get_weather]plan"), ("message", "Checking."),
                    ("function_call", ("get_weather", {"city": "Paris"})), ("message", "<think>")]


def test_reasoning_is_a_reasoning_item_and_xml_calls_are_function_calls(thinking):
    reply = thinking.responses.create(model="fake", input=THOUGHT_INPUT, tools=[WEATHER])
    assert _shape(reply.output) == EXPECTED_THOUGHT and reply.output[0].summary == []
    assert reply.usage.output_tokens_details.reasoning_tokens == len("[get_weather]plan")  # byte tokens


def test_reasoning_and_call_arguments_stream_in_pieces(thinking):
    events = _events(thinking.responses.create(model="fake", input=THOUGHT_INPUT, tools=[WEATHER],
                                               stream=True))
    final = events[-1].response
    assert events[-1].type == "response.completed" and _shape(final.output) == EXPECTED_THOUGHT
    reasoning = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    (done,) = [e for e in events if e.type == "response.reasoning_text.done"]
    assert reasoning == done.text == "[get_weather]plan"
    arguments = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    assert json.loads("".join(arguments)) == {"city": "Paris"}
    added = [e.item.type for e in events if e.type == "response.output_item.added"]
    assert added == ["reasoning", "message", "function_call", "message"]


def test_the_stream_helper_reads_reasoning_items(thinking):
    with thinking.responses.stream(model="fake", input=THOUGHT_INPUT, tools=[WEATHER]) as stream:
        final = stream.get_final_response()
    assert _shape(final.output) == EXPECTED_THOUGHT
