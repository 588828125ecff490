"""Constrained decoding end to end on the default model (SmolLM2 upcycled, CPU) with the official
clients: json_schema replies sampled at temperature 1 that all parse and validate, forced tool
calls in Chat, Responses and Anthropic Messages (streamed: the input_json_delta parts join into
input that validates, then a tool_result turn), and an openai-agents SDK agent with an output type
and a function tool. The scheduler runs with --check-pages: a leaked page fails the module."""
from __future__ import annotations

import json
import os
from concurrent.futures import ThreadPoolExecutor

import anthropic
import openai
import pytest

jsonschema = pytest.importorskip("jsonschema")  # a dev dependency; the GPU machines may lack it
pytest.importorskip("llguidance")  # constrained decoding's library; the GPU machines may lack it

from tests.test_serving import WAIT_S, assert_pages_settled, start, stop  # noqa: E402
from frontend.client import Client  # noqa: E402

pytestmark = pytest.mark.slow
NAME = "smol"
FORECAST = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 24},
    "temperature_c": {"type": "integer", "minimum": -50, "maximum": 60},
    "sunny": {"type": "boolean"}},
    "required": ["city", "temperature_c", "sunny"], "additionalProperties": False}
WEATHER_ARGS = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24},
                                                 "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                "required": ["city", "unit"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "the weather in a city",
                                            "parameters": WEATHER_ARGS}}
TIME = {"type": "function", "function": {"name": "get_time", "description": "the time in a city",
                                         "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}
ASK = [{"role": "user", "content": "What is the weather like in Paris today?"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from worker.default_model import default_model_dir

    model = default_model_dir()
    threads = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = "1"  # shared CPU runners: one thread is faster than two spinning
    try:
        s = start(tmp_path_factory.mktemp("constrained"), model, "--served-model-name", NAME)
    finally:
        os.environ.pop("OMP_NUM_THREADS") if threads is None else os.environ.update(OMP_NUM_THREADS=threads)
    url = s.proc.stdout.readline().split()[-1]
    yield s, url
    with Client(s.endpoint, timeout=WAIT_S) as client:
        assert_pages_settled(client)
    assert stop(s) == 0, s.log.read_text()[-3000:]


@pytest.fixture
def oai(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server[1] + "/v1", api_key="none", max_retries=0, timeout=4 * WAIT_S)


def test_twenty_sampled_json_schema_replies_all_parse_and_validate(oai):
    fmt = {"type": "json_schema", "json_schema": {"name": "forecast", "schema": FORECAST, "strict": True}}

    def one(seed: int):
        return oai.chat.completions.create(model=NAME, messages=ASK, response_format=fmt, temperature=1.0,
                                           seed=seed, max_tokens=96)

    with ThreadPoolExecutor(20) as pool:
        replies = list(pool.map(one, range(20)))
    for r in replies:
        assert r.choices[0].finish_reason == "stop", r.choices[0].message.content
        jsonschema.validate(json.loads(r.choices[0].message.content), FORECAST)
    assert len({r.choices[0].message.content for r in replies}) > 1


def test_json_object_gives_an_object(oai):
    reply = oai.chat.completions.create(model=NAME, messages=ASK, response_format={"type": "json_object"},
                                        temperature=0, max_tokens=200)
    assert isinstance(json.loads(reply.choices[0].message.content), dict)


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_forced_chat_tool_calls_are_valid(oai, choice):
    reply = oai.chat.completions.create(model=NAME, messages=ASK, tools=[TIME, WEATHER], tool_choice=choice,
                                        temperature=0.7, seed=3, max_tokens=96)
    [call] = reply.choices[0].message.tool_calls
    assert reply.choices[0].finish_reason == "tool_calls"
    schemas = {"get_weather": WEATHER_ARGS, "get_time": TIME["function"]["parameters"]}
    assert isinstance(choice, str) or call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])


def test_responses_text_format_and_a_forced_call(oai):
    reply = oai.responses.create(model=NAME, input="Give me a forecast for Lima.", temperature=0,
                                 max_output_tokens=96, text={"format": {"type": "json_schema", "name": "forecast",
                                                                        "schema": FORECAST, "strict": True}})
    jsonschema.validate(json.loads(reply.output_text), FORECAST)
    tool = {"type": "function", **WEATHER["function"]}
    called = oai.responses.create(model=NAME, input="Weather in Oslo?", tools=[tool], tool_choice="required",
                                  temperature=0, max_output_tokens=96)
    [call] = [item for item in called.output if item.type == "function_call"]
    assert call.name == "get_weather"
    jsonschema.validate(json.loads(call.arguments), WEATHER_ARGS)


def test_anthropic_streamed_forced_tool_use_then_a_tool_result_turn(server):
    claude = anthropic.Anthropic(base_url=server[1], api_key="none", max_retries=0, timeout=4 * WAIT_S)
    tool = {"name": "get_weather", "description": "the weather in a city", "input_schema": WEATHER_ARGS}
    fields = dict(model=NAME, max_tokens=96, tools=[tool])  # the model's default sampling
    with claude.messages.stream(messages=ASK, tool_choice={"type": "tool", "name": "get_weather"}, **fields) as s:
        events = list(s)
        final = s.get_final_message()
    parts = [e.delta.partial_json for e in events
             if e.type == "content_block_delta" and e.delta.type == "input_json_delta"]
    jsonschema.validate(json.loads("".join(parts)), WEATHER_ARGS)
    [use] = [b for b in final.content if b.type == "tool_use"]
    assert final.stop_reason == "tool_use" and use.name == "get_weather" and use.input == json.loads("".join(parts))
    turn = ASK + [{"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in final.content]},
                  {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "sunny, 21 C"}]}]
    after = claude.messages.create(messages=turn, tool_choice={"type": "any"}, **fields)
    [again] = [b for b in after.content if b.type == "tool_use"]
    jsonschema.validate(again.input, WEATHER_ARGS)


def test_an_agents_sdk_agent_with_an_output_type_and_a_function_tool(server):
    """The SDK's requests (Responses, strict function tools, text.format from the output type) round
    trip: forced, the tool runs with arguments that fit its signature; free of tools, the final
    output parses as the output type. (Left to choose, a 135M model calls the tool every turn.)"""
    agents = pytest.importorskip("agents")
    from pydantic import BaseModel

    class Forecast(BaseModel):
        city: str
        sunny: bool

    calls = []

    @agents.function_tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        calls.append(city)
        return "sunny"

    agents.set_tracing_disabled(True)
    client = openai.AsyncOpenAI(base_url=server[1] + "/v1", api_key="none", max_retries=0, timeout=4 * WAIT_S)
    model = agents.OpenAIResponsesModel(model=NAME, openai_client=client)

    def agent(tool_choice: str, **kw):
        settings = agents.ModelSettings(temperature=0, max_tokens=96, tool_choice=tool_choice)
        return agents.Agent(name="forecaster", instructions="Answer with a forecast.", tools=[get_weather],
                            output_type=Forecast, model=model, model_settings=settings, **kw)

    forced = agents.Runner.run_sync(agent("get_weather", tool_use_behavior="stop_on_first_tool"),
                                    "Will it be sunny in Paris?", max_turns=2)
    assert forced.final_output == "sunny" and len(calls) == 1 and isinstance(calls[0], str)
    answered = agents.Runner.run_sync(agent("none"), "Will it be sunny in Paris?", max_turns=2)
    assert isinstance(answered.final_output, Forecast) and len(calls) == 1


def test_bad_grammars_from_a_zmq_client_are_errors_and_serving_goes_on(server, oai):
    from frontend.client import ServerError
    from scheduler.messages.to_scheduler import Grammar

    with Client(server[0].endpoint, timeout=WAIT_S) as client:
        with pytest.raises(ServerError, match="Invalid type: strin"):  # the scheduler's compile refuses it
            client.generate(prompt="hi", max_tokens=8, grammar=Grammar(lark='start: %json {"type": "strin"}'))
        with pytest.raises(ServerError, match="at most"):  # the frontend's size cap, before it is queued
            client.generate(prompt="hi", max_tokens=8, grammar=Grammar(lark="start: " + '"a" ' * 100_000))
        done = client.generate(prompt="hi", max_tokens=8, grammar=Grammar(lark='start: "yes" | "no"'))
        assert done.text in ("yes", "no") and done.finish_reason == "stop"
        with client.stream(prompt="hi", max_tokens=200, grammar=Grammar(lark="start: /[a-z ]{150}/")) as s:
            next(s)  # left after its first chunk: the request is aborted (the module's end checks the pages)
    reply = oai.chat.completions.create(model=NAME, messages=ASK, max_tokens=4)
    assert reply.choices[0].finish_reason in ("stop", "length")


def test_a_strict_tool_left_to_choose_runs_under_its_lazy_grammar(oai, server):
    """tool_choice auto with a strict tool: the lazy grammar (free text until the model opens a
    call, then the call by its schema) compiles against the real tokenizer and serves; the model
    rarely calls unforced, so what it accepts is tests/test_constrain.py's. Thinking on a model that
    does not reason is refused."""
    strict = {"type": "function", "function": {**WEATHER["function"], "strict": True}}
    reply = oai.chat.completions.create(model=NAME, messages=ASK, tools=[strict], temperature=0, max_tokens=8)
    assert reply.choices[0].finish_reason in ("stop", "length", "tool_calls")
    for call in reply.choices[0].message.tool_calls or []:
        jsonschema.validate(json.loads(call.function.arguments), WEATHER_ARGS)
    claude = anthropic.Anthropic(base_url=server[1], api_key="none", max_retries=0, timeout=WAIT_S)
    with pytest.raises(anthropic.BadRequestError, match="has no reasoning"):
        claude.messages.create(model=NAME, max_tokens=64, messages=ASK, thinking={"type": "adaptive"})
