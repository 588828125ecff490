"""Reply parsers (frontend/http/parsers), chat_template_kwargs and the refusal of fields Sluice does
not implement: units on CPU, then end to end with the official ``openai`` client against the
frontend and tests/fake_scheduler.py, which echoes the rendered prompt, so a prompt holding the
XML markup comes back as a reply holding it."""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

import httpx
import msgspec
import openai
import pytest

sys.path.insert(0, str(Path(__file__).parent))
from fake_scheduler import CHATML, write_byte_tokenizer  # noqa: E402
from test_http import WAIT_S, start, stop  # noqa: E402

from frontend.http import convert  # noqa: E402
from frontend.http.errors import ApiError  # noqa: E402
from frontend.http.parsers import (CallArguments, CallStart, ParsedCall, Reasoning,  # noqa: E402
                                   ReplyFormat, ReplyParser, TemplateMarkup, template_markup)
from frontend.http.parsers.reasoning import opens_reasoning  # noqa: E402
from frontend.http.parsers.xml_calls import typed_value  # noqa: E402
from frontend.http.schemas import ChatRequest, CompletionRequest  # noqa: E402
from frontend.http.tool_calls import parse_tool_calls  # noqa: E402
from frontend.tokenizer import ChatTokenizer  # noqa: E402

XML, JSON = TemplateMarkup("xml", True), TemplateMarkup("json", True)
SCHEMAS = {"get_weather": {"type": "object", "properties": {
    "city": {"type": "string"}, "days": {"type": "integer"}, "metric": {"type": "boolean"},
    "ratio": {"type": "number"}, "where": {"type": "object"}, "hours": {"type": "array"},
    "note": {"type": ["integer", "null"]}, "zip": {"type": "string"}, "unit": {"anyOf": [
        {"type": "integer"}, {"type": "string"}]}}}}
# A Qwen3.5-like template: the XML call format in the tools section and in the history, thinking
# opened by the generation prompt unless enable_thinking is false. The tools come last, so that a
# reply echoing the prompt starts with the messages.
QWEN35 = (
    "{% for m in messages %}{{ m.content }}"
    "{% for c in m.tool_calls or [] %}<tool_call>\n<function={{ c.function.name }}>\n"
    "{% for k, v in c.function.arguments | items %}<parameter={{ k }}>\n"
    "{{ v if v is string else v | tojson }}\n</parameter>\n{% endfor %}</function>\n</tool_call>"
    "{% endfor %}{% endfor %}"
    "{% if tools %}<tools>{% for t in tools %}{{ t.function.name }} {% endfor %}</tools>"
    "<tool_call>\n<function=example>\n<parameter=x>\n1\n</parameter>\n</function>\n</tool_call>{% endif %}"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n"
    "{% else %}<think>\n{% endif %}"
)


def xml_call(name: str, **params: str) -> str:
    body = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in params.items())
    return f"<tool_call>\n<function={name}>\n{body}</function>\n</tool_call>"


def streamed(reply: ReplyFormat, text: str, rng: random.Random, parser: ReplyParser | None = None) -> list:
    """The events of ``text`` fed in random pieces (to a parser of every event unless given one)."""
    parser, events, i = parser or reply.parser(reasoning=True, stream_arguments=True), [], 0
    while i < len(text):
        n = rng.randint(1, 12)
        events += parser.feed(text[i:i + n])
        i += n
    return events + parser.flush()


def joined(events: list) -> tuple[str, str, list[ParsedCall]]:
    """Content, reasoning and calls of a stream; each call's pieces checked against it."""
    calls = [e for e in events if isinstance(e, ParsedCall)]
    for index, call in enumerate(calls):
        starts = [e for e in events if isinstance(e, CallStart) and e.index == index]
        pieces = [e.text for e in events if isinstance(e, CallArguments) and e.index == index]
        assert starts == [CallStart(index, call.name)] and "".join(pieces) == call.arguments
    content = "".join(e for e in events if isinstance(e, str))
    return content, "".join(e.text for e in events if isinstance(e, Reasoning)), calls


# ==== Qwen3-Coder XML calls ====

WEATHER_CALL = xml_call("get_weather", city="Paris", days="3", metric="True", ratio="0.5",
                        where='{"lat": 1}', hours="[1, 2]", note="null", zip="02134", unit="7")
WEATHER_ARGS = {"city": "Paris", "days": 3, "metric": True, "ratio": 0.5, "where": {"lat": 1},
                "hours": [1, 2], "note": None, "zip": "02134", "unit": 7}
XML_TEXT = "Checking." + WEATHER_CALL + "\n" + xml_call("get_time", zone="UTC", n="2") + "\nDone."


def test_xml_calls_typed_by_the_schema():
    reply = ReplyFormat(XML, False, SCHEMAS).whole(XML_TEXT)
    assert reply.content == "Checking.\nDone." and reply.reasoning is None
    assert reply.calls == [ParsedCall("get_weather", json.dumps(WEATHER_ARGS)),
                           ParsedCall("get_time", '{"zone": "UTC", "n": "2"}')]  # no schema: strings


@pytest.mark.parametrize("kind, text, value", [
    ("integer", "three", "three"), ("integer", "true", "true"), ("integer", "2.5", "2.5"),
    ("number", "NaN", "NaN"), ("number", " 1e3 ", 1000.0), ("boolean", "maybe", "maybe"),
    ("boolean", "false", False), ("object", "not json", "not json"), ("array", '{"a": 1}', '{"a": 1}'),
    ("string", "42", "42"), ("string", " spaced \n", " spaced \n"), ("null", "None", "None")])
def test_a_value_that_does_not_parse_as_its_type_stays_a_string(kind, text, value):
    assert typed_value(text, {"type": kind}) == value
    assert typed_value(text, None) == text and typed_value(text, {"enum": ["x"]}) == text


def test_a_multiline_value_keeps_its_lines():
    call = xml_call("write", path="a.py", text="def f():\n    return 1 < 2\n")
    (parsed,) = ReplyFormat(XML, False, {}).whole(call).calls
    assert json.loads(parsed.arguments) == {"path": "a.py", "text": "def f():\n    return 1 < 2\n"}


def test_xml_streamed_in_random_pieces_gives_the_same_reply():
    reply = ReplyFormat(XML, False, SCHEMAS)
    whole = reply.whole(XML_TEXT)
    for seed in range(300):
        content, reasoning, calls = joined(streamed(reply, XML_TEXT, random.Random(seed)))
        assert (content, reasoning, calls) == (whole.content, "", whole.calls)
        assert "<" not in content  # no piece of the markup leaked


def test_xml_arguments_come_out_as_each_parameter_closes():
    parser, seen = ReplyFormat(XML, False, SCHEMAS).parser(stream_arguments=True), []
    for i, ch in enumerate(WEATHER_CALL):
        seen += [(i, e) for e in parser.feed(ch) if isinstance(e, (CallStart, CallArguments))]
    assert seen[0] == (WEATHER_CALL.index(">\n<parameter") , CallStart(0, "get_weather"))
    first_close = WEATHER_CALL.index("</parameter>") + len("</parameter>") - 1
    assert seen[1] == (first_close, CallArguments(0, '{"city": "Paris"'))
    assert seen[2][1] == CallArguments(0, ', "days": 3')


@pytest.mark.parametrize("text", [
    "a <tool_call>oops</tool_call> b", "a <tool_call><function=bad name>\n</function></tool_call> b",
    "a <tool_call></tool_call> b", "a <tool_call>\n<func", "<tool_call>{broken",
    "x <tool_c", "a <function=f> outside a block"])
def test_a_malformed_block_stays_content(text):
    reply = ReplyFormat(XML, False, SCHEMAS)
    assert reply.whole(text) == (text, [], None)
    for seed in range(20):
        assert joined(streamed(reply, text, random.Random(seed)))[0::2] == (text, [])


@pytest.mark.parametrize("text, calls", [
    ('<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>', [("f", {"x": 1})]),
    ("<tool_call>\n<function=f>\nhmm\n<parameter=x>\n1\n</parameter>\n</function>\n</tool_call>",
     [("f", {"x": "1"})]),  # stray text inside a call is dropped
    ("<tool_call>\n<function=f>\n<parameter=x>\nabc", [("f", {"x": "abc"})]),  # cut off: closed
    ("<tool_call>\n<function=f>\n<parameter=a>\n1\n<parameter=b>\n2\n</function>\n</tool_call>",
     [("f", {"a": "1", "b": "2"})]),  # </parameter> forgotten
    ("<tool_call>\n<function=f>\n</function>\n<function=g>\n</function>\n</tool_call>",
     [("f", {}), ("g", {})]),  # two functions in one block
])
def test_xml_blocks_the_models_also_write(text, calls):
    reply = ReplyFormat(XML, False, {})
    assert [(c.name, json.loads(c.arguments)) for c in reply.whole(text).calls] == calls
    for seed in range(20):
        content, _, got = joined(streamed(reply, text, random.Random(seed)))
        assert not content.strip() and [(c.name, json.loads(c.arguments)) for c in got] == calls


def test_the_template_renders_a_call_that_the_parser_reads_back(tmp_path):
    tok = ChatTokenizer.from_dir(write_byte_tokenizer(tmp_path, QWEN35))
    rendered = tok.render_chat([{"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "get_weather", "arguments": WEATHER_ARGS}}]}])
    (call,) = ReplyFormat(template_markup(QWEN35), False, SCHEMAS).whole(rendered).calls
    assert json.loads(call.arguments) == WEATHER_ARGS


# ==== reasoning ====

THOUGHT = ('<think>\nI should call <tool_call>{"name": "f", "arguments": {}}</tool_call> maybe.\n'
           "</think>\n\n")


@pytest.mark.parametrize("reply, text, want", [
    (ReplyFormat(JSON, False, {}), THOUGHT + "Answer.", ("Answer.", [], THOUGHT[8:-11])),
    (ReplyFormat(JSON, True, {}), "plan\n</think>\n\nAnswer.", ("Answer.", [], "plan")),
    (ReplyFormat(JSON, True, None), "cut off <think> mid-thought", (None, [], "cut off <think> mid-thought")),
    (ReplyFormat(JSON, False, {}), "Answer <think>x</think>", ("Answer <think>x</think>", [], None)),
    (ReplyFormat(TemplateMarkup("json", False), False, None), THOUGHT, (THOUGHT, [], None)),
    (ReplyFormat(XML, True, SCHEMAS), "plan</think>" + XML_TEXT,
     ("Checking.\nDone.", ReplyFormat(XML, False, SCHEMAS).whole(XML_TEXT).calls, "plan")),
])
def test_reasoning_is_split_whole_and_streamed(reply, text, want):
    assert reply.whole(text) == want  # a call inside reasoning is not a call
    for seed in range(100):
        content, reasoning, calls = joined(streamed(reply, text, random.Random(seed)))
        assert (content or None, calls, reasoning or None) == want


@pytest.mark.parametrize("tail, opened", [
    ("<|im_start|>assistant\n<think>\n", True), ("<|im_start|>assistant\n<think>\n\n</think>\n\n", False),
    ("<|im_start|>assistant\n", False)])
def test_the_prompt_tail_tells_whether_the_template_opened_reasoning(tail, opened):
    assert opens_reasoning(tail) == opened
    assert ReplyFormat.of(QWEN35, tail, None).in_reasoning == opened
    assert not ReplyFormat.of(CHATML, tail, None).in_reasoning  # a template without <think>


# ==== the JSON format and the choice of parser ====

def test_the_template_chooses_the_markup():
    hermes = '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
    assert template_markup(QWEN35) == TemplateMarkup("xml", True)
    thinking = hermes + "{% if enable_thinking %}<think>{% endif %}"
    assert template_markup(thinking) == TemplateMarkup("json", True)
    assert template_markup(CHATML) == template_markup(None) == TemplateMarkup("json", False)


@pytest.mark.parametrize("text", [
    "thinking...\n" + '<tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call>',
    'a <tool_call>not json</tool_call> b', '<tool_call>{"name": "f", "arguments": "{}"}', "no calls"])
def test_the_json_format_reads_as_before(text):
    content, calls = parse_tool_calls(text)
    reply = ReplyFormat(TemplateMarkup("json", False), False, {})
    assert reply.whole(text) == (content, calls, None)
    for seed in range(20):
        got = joined(streamed(reply, text, random.Random(seed)))
        assert (got[0].strip() or None, got[2]) == (content, calls)


def test_the_default_stream_parser_speaks_like_tool_call_stream():
    """What code written for ToolCallStream handles: content and whole calls, reasoning left out."""
    reply = ReplyFormat(XML, True, SCHEMAS)
    for seed in range(20):
        events = streamed(reply, "plan</think>" + XML_TEXT, random.Random(seed), reply.parser())
        assert {type(e) for e in events} == {str, ParsedCall}
        assert "".join(e for e in events if isinstance(e, str)) == "Checking.\nDone."


# ==== chat_template_kwargs, reasoning_effort ====

def _chat(**fields) -> ChatRequest:
    return msgspec.convert({"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields},
                           ChatRequest)


def test_chat_template_kwargs_reach_the_template(tmp_path):
    tok = ChatTokenizer.from_dir(write_byte_tokenizer(tmp_path, QWEN35))
    for fields, tail in [({}, "hi<think>\n"), ({"chat_template_kwargs": {"enable_thinking": False}},
                                               "hi<think>\n\n</think>\n\n"),
                         ({"reasoning_effort": "none"}, "hi<think>\n\n</think>\n\n")]:
        body = _chat(**fields)
        ids = convert.chat_prompt_ids(body, None, tok)
        assert tok.decode(ids) == tail
        assert convert.reply_format(body, ids, tok).in_reasoning == tail.endswith("<think>\n")


@pytest.mark.parametrize("fields, param", [
    ({"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs"),
    ({"chat_template_kwargs": {"add_generation_prompt": False}}, "chat_template_kwargs"),
    ({"reasoning_effort": "high"}, "reasoning_effort")])
def test_template_kwargs_that_cannot_be_honoured_are_refused(fields, param):
    with pytest.raises(ApiError) as err:
        convert.template_kwargs(_chat(**fields), QWEN35)
    assert err.value.status == 400 and err.value.param == param
    with pytest.raises(ApiError, match="reasoning_effort"):  # a template without the switch
        convert.template_kwargs(_chat(reasoning_effort="none"), CHATML)


# ==== refusals ====

REFUSED = [("min_p", 0.1), ("repetition_penalty", 1.1), ("presence_penalty", 0.5),
           ("frequency_penalty", -0.5), ("logit_bias", {"1": 2.0}), ("n", 2), ("logprobs", True),
           ("top_logprobs", 2),  # response_format is constrained: tests/test_constrain.py
           ("structured_outputs", {"json": {}}), ("guided_json", {}), ("guided_regex", "a+"),
           ("guided_choice", ["a"]), ("guided_grammar", "root ::= 'a'"),
           ("guided_decoding_backend", "xgrammar"), ("guided_whitespace_pattern", " "), ("store", True)]
NEUTRAL = {"min_p": 0.0, "repetition_penalty": 1.0, "presence_penalty": 0, "frequency_penalty": 0,
           "logit_bias": {}, "n": 1, "logprobs": False, "top_logprobs": 0,
           "response_format": {"type": "text"}, "store": False}
HARMLESS = {"user": "u", "safety_identifier": "s", "metadata": {"k": "v"}, "store": False,
            "prompt_cache_key": "p", "service_tier": "auto", "stream_options": {"include_usage": True}}
UNKNOWN = ["best_of", "functions", "skip_special_tokens", "web_search_options", "verbosity", "foo"]


@pytest.mark.parametrize("name, value", REFUSED)
@pytest.mark.parametrize("body_type", [ChatRequest, CompletionRequest])
def test_unimplemented_fields_are_refused_by_name(body_type, name, value):
    with pytest.raises(ApiError) as err:
        convert.check_request(_body(body_type, **{name: value}), "m")
    assert (err.value.status, err.value.param) == (400, name)
    assert name in str(err.value) and "\n" not in str(err.value)


def _body(body_type: type, **fields):
    base = {"messages": [{"role": "user", "content": "hi"}]} if body_type is ChatRequest else {"prompt": "x"}
    return msgspec.convert({"model": "m", **base, **fields}, body_type)


@pytest.mark.parametrize("body_type", [ChatRequest, CompletionRequest])
def test_neutral_values_and_harmless_fields_are_accepted(body_type):
    convert.check_request(_body(body_type, **{**NEUTRAL, **HARMLESS}), "m")
    convert.check_request(_body(ChatRequest, parallel_tool_calls=False), "m")


@pytest.mark.parametrize("name", UNKNOWN + ["chat_template_kwargs", "reasoning_effort"])
def test_unknown_fields_are_refused_by_name(name):
    bodies = [(ChatRequest, {"messages": []}), (CompletionRequest, {"prompt": "x"})]
    own = {"best_of": CompletionRequest, "chat_template_kwargs": ChatRequest, "reasoning_effort": ChatRequest}
    for body_type, base in [b for b in bodies if b[0] is not own.get(name)]:
        with pytest.raises(msgspec.ValidationError, match=f"unknown field `{name}`"):
            msgspec.json.decode(json.dumps({"model": "m", **base, name: 1}), type=body_type)
    with pytest.raises(msgspec.ValidationError, match=r"\$\.chat_template_kwargs"):
        msgspec.json.decode(b'{"model": "m", "messages": [], "chat_template_kwargs": "x"}', type=ChatRequest)


# ==== end to end: the openai client, the frontend and the echoing fake scheduler ====

@pytest.fixture(scope="module")
def oai(tmp_path_factory):
    proc, _, url = start(tmp_path_factory.mktemp("parsers"), "--http-port", "0", template=QWEN35)
    yield openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=WAIT_S)
    assert stop(proc) == 0


WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": SCHEMAS["get_weather"]}}
# Echoed, the prompt is a reply that reasons ("plan"), says "Checking." and calls get_weather; then
# the tools section (after the call: content) and the generation prompt's "<think>", where it stops.
ASK = {"model": "fake", "max_tokens": 900, "stop": ["<tools>", "<think>"], "tools": [WEATHER],
       "messages": [{"role": "user", "content": "plan</think>\n\nChecking." + WEATHER_CALL}]}


def test_xml_call_and_reasoning_in_a_whole_reply(oai):
    choice = oai.chat.completions.create(**ASK).choices[0]
    assert (choice.message.reasoning_content, choice.message.content) == ("plan", "Checking.")
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == WEATHER_ARGS
    assert choice.finish_reason == "tool_calls"


def test_xml_call_and_reasoning_in_a_stream(oai):
    chunks = list(oai.chat.completions.create(**ASK, stream=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == "plan"
    assert "".join(d.content or "" for d in deltas) == "Checking."
    calls = [t for d in deltas for t in d.tool_calls or []]
    assert (calls[0].index, calls[0].function.name, calls[0].id is not None) == (0, "get_weather", True)
    assert len(calls) == 2 + len(WEATHER_ARGS)  # the start, one piece per parameter, the close
    assert json.loads("".join(t.function.arguments for t in calls)) == WEATHER_ARGS
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_chat_template_kwargs_turn_thinking_off(oai):
    def ask(**extra):
        return oai.chat.completions.create(model="fake", max_tokens=50, stop=["<think>"],
                                           messages=[{"role": "user", "content": "hello"}], **extra)
    assert ask().choices[0].message.content is None  # the prompt opened <think>: all reasoning
    assert ask().choices[0].message.reasoning_content == "hello"
    message = ask(extra_body={"chat_template_kwargs": {"enable_thinking": False}}).choices[0].message
    assert (message.content, message.reasoning_content) == ("hello", None)


@pytest.mark.parametrize("name, value", REFUSED + [(n, 1) for n in UNKNOWN] + [
    ("chat_template_kwargs", "x"), ("chat_template_kwargs", {"tools": []}), ("reasoning_effort", "high")])
def test_every_refusal_through_the_client(oai, name, value):
    with pytest.raises(openai.BadRequestError) as err:
        oai.chat.completions.create(model="fake", messages=[{"role": "user", "content": "x"}],
                                    extra_body={name: value})
    assert name in err.value.body["message"] and "\n" not in err.value.body["message"]


def test_harmless_fields_and_completions_refusals_through_the_client(oai):
    reply = oai.chat.completions.create(model="fake", max_tokens=50, stop=["<think>"],
                                        messages=[{"role": "user", "content": "ok"}],
                                        parallel_tool_calls=False, **HARMLESS)
    assert reply.choices[0].message.reasoning_content == "ok"
    for name, value in [("min_p", 0.1), ("best_of", 2), ("echo", True), ("foo", 1)]:
        answer = httpx.post(str(oai.base_url) + "completions",
                            json={"model": "fake", "prompt": "x", name: value})
        assert answer.status_code == 400 and name in answer.json()["error"]["message"]


def test_messages_api_reads_xml_calls_and_thinking(oai):
    """Anthropic's Messages reads the same template's markup: with thinking on (the generation
    prompt opens ``<think>``), the reasoning is a thinking block, the content text, and the XML call
    a tool_use block with typed input."""
    import anthropic

    claude = anthropic.Anthropic(base_url=str(oai.base_url).removesuffix("/v1/"), api_key="unused", max_retries=0)
    tool = {"name": "get_weather", "input_schema": SCHEMAS["get_weather"]}
    ask = dict(model="fake", max_tokens=900, stop_sequences=["<tools>", "<think>"], tools=[tool],
               thinking={"type": "adaptive"}, messages=[{"role": "user", "content": ASK["messages"][0]["content"]}])
    reply = claude.messages.create(**ask)
    thinking, text, call = reply.content
    assert (thinking.type, thinking.thinking) == ("thinking", "plan")
    assert (text.type, text.text) == ("text", "Checking.")
    assert (call.type, call.name, call.input) == ("tool_use", "get_weather", WEATHER_ARGS)
    assert reply.stop_reason == "stop_sequence"  # the echo is cut by "<tools>"; a model's EOS gives tool_use
