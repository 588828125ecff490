"""gpt-oss's harmony format (frontend/http/harmony): prompts rendered as openai-harmony renders
the same conversation; replies of known harmony tokens read into reasoning, content and calls by
Chat, Responses and Messages (whole and streamed, in chunks of any size); and a tool round trip
through each API served by the real scheduler, on a tiny gpt-oss of o200k_harmony's vocabulary
whose greedy reply is a call (tests/tiny_harmony.py)."""
from __future__ import annotations

import asyncio
import datetime
import json
import urllib.request

import anthropic
import msgspec
import openai
import pytest

from frontend.api.replies import Chunk, Usage
from frontend.http import chat, messages_reply, responses_api, responses_reply
from frontend.http import responses as r
from frontend.http.errors import ApiError
from frontend.http.harmony import encoding as harmony_encoding
from frontend.http.harmony import render
from frontend.http.harmony.reply import HarmonyFormat
from frontend.http.parsers import CallArguments, CallStart, ParsedCall, Reasoning
from frontend.http.schemas import ChatRequest

pytestmark = pytest.mark.skipif(not harmony_encoding.available(), reason="no o200k_base.tiktoken: run "
                                "python scripts/fetch_o200k.py (scripts/setup_env.sh does)")

TODAY = datetime.date(2026, 12, 2)
PARAMETERS = {"type": "object", "properties": {"city": {"type": "string"}}}
TOOLS = HarmonyFormat({"get_weather": PARAMETERS})  # the reply to a request with this tool
TOOL = {"type": "function", "function": {"name": "get_weather", "description": "the weather in a city",
                                         "parameters": PARAMETERS}}
ARGS = '{"city": "Paris"}'
CALL = f"<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{ARGS}<|call|>"
# what gpt-oss writes after "<|start|>assistant": reasoning, a preamble to the user, a call
REPLY = ("<|channel|>analysis<|message|>The user wants the weather.<|end|>"
         "<|start|>assistant<|channel|>commentary<|message|>Checking.<|end|><|start|>assistant" + CALL)


def harmony():
    return harmony_encoding.encoding()


def ids_of(text: str) -> list[int]:
    return harmony().encode(text, allowed_special="all")


def chat_body(**fields) -> ChatRequest:
    return msgspec.convert({"model": "m", **fields}, ChatRequest)


# ==== rendering ====

def test_rendering_is_the_librarys_own_rendering_of_the_conversation():
    from openai_harmony import (Author, Conversation, DeveloperContent, Message, ReasoningEffort, Role,
                                SystemContent, ToolDescription)

    body = chat_body(reasoning_effort="high", tools=[TOOL], messages=[
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "reasoning_content": "Need the weather.", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": ARGS}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 20}'}])
    system = SystemContent.new().with_reasoning_effort(ReasoningEffort.HIGH).with_conversation_start_date("2026-12-02")
    developer = DeveloperContent.new().with_instructions("Be brief.").with_function_tools(
        [ToolDescription.new("get_weather", "the weather in a city", parameters=PARAMETERS)])
    expected = Conversation.from_messages([
        Message.from_role_and_content(Role.SYSTEM, system), Message.from_role_and_content(Role.DEVELOPER, developer),
        Message.from_role_and_content(Role.USER, "Weather in Paris?"),
        Message.from_role_and_content(Role.ASSISTANT, "Need the weather.").with_channel("analysis"),
        Message.from_role_and_content(Role.ASSISTANT, ARGS).with_channel("commentary")
        .with_recipient("functions.get_weather").with_content_type("<|constrain|>json"),
        Message.from_author_and_content(Author.new(Role.TOOL, "functions.get_weather"), '{"temp": 20}')
        .with_channel("commentary").with_recipient("assistant")])
    ids = render.prompt_ids(body, [TOOL], TODAY)
    assert ids == harmony().render_conversation_for_completion(expected, Role.ASSISTANT)
    text = harmony().decode(ids)
    assert "Reasoning: high" in text and "type get_weather = (_: {\ncity?: string,\n}) => any;" in text
    assert text.endswith('<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>'
                         '{"temp": 20}<|end|><|start|>assistant')


def test_a_past_answer_is_final_and_its_reasoning_is_dropped():
    body = chat_body(messages=[{"role": "user", "content": "Hi"},
                               {"role": "assistant", "content": "Hello!", "reasoning_content": "Greet back."},
                               {"role": "user", "content": [{"type": "text", "text": "Bye"}]}])
    text = harmony().decode(render.prompt_ids(body, None, TODAY))
    assert "Reasoning: medium" in text and "<|start|>developer" not in text and "Greet back." not in text
    assert text.endswith("<|start|>assistant<|channel|>final<|message|>Hello!<|end|>"
                         "<|start|>user<|message|>Bye<|end|><|start|>assistant")


@pytest.mark.parametrize("fields, param", [
    ({"reasoning_effort": "none"}, "reasoning_effort"),
    ({"tool_choice": "required", "tools": [TOOL]}, "tool_choice"),
    ({"response_format": {"type": "json_object"}}, "response_format"),
    ({"chat_template_kwargs": {"enable_thinking": False}}, "chat_template_kwargs"),
    ({"tools": [{**TOOL, "function": {**TOOL["function"], "strict": True}}]}, "tools['get_weather'].strict"),
])
def test_what_harmony_cannot_honour_is_refused_by_name(fields, param):
    body = chat_body(messages=[{"role": "user", "content": "x"}], **fields)
    with pytest.raises(ApiError) as err:
        render.prompt_ids(body, body.tools and [msgspec.to_builtins(t) for t in body.tools], TODAY)
    assert err.value.status == 400 and err.value.param == param and "\n" not in str(err.value)


def test_without_the_vocabulary_file_a_request_is_refused_in_one_line(monkeypatch, tmp_path):
    monkeypatch.setenv(harmony_encoding.VARIABLE, str(tmp_path))
    with pytest.raises(ApiError) as err:
        harmony_encoding.encoding.__wrapped__()  # the loader itself, past the cache of the loaded encoding
    assert err.value.status == 503 and "scripts/fetch_o200k.py" in str(err.value) and "\n" not in str(err.value)


# ==== rendering message by message, ids kept ====

def _harmony_messages():
    """A strategy for conversations of every kind of message Sluice renders, with texts that look
    like harmony's own tokens and texts that do not."""
    from hypothesis import strategies as st
    from openai_harmony import (Author, DeveloperContent, Message, ReasoningEffort, Role, SystemContent,
                                ToolDescription)

    text = st.lists(st.sampled_from(["a", " ", "\n", "é", "<|end|>", "<|start|>", "{", "0"]), max_size=12).map("".join)
    said = lambda channel: text.map(lambda t: Message.from_role_and_content(Role.ASSISTANT, t).with_channel(channel))
    tools = st.lists(st.sampled_from(["f", "g"]), max_size=2).map(
        lambda names: [ToolDescription.new(n, "does " + n, parameters=PARAMETERS) for n in names])
    developer = st.tuples(text, tools).map(lambda it: Message.from_role_and_content(
        Role.DEVELOPER, DeveloperContent.new().with_instructions(it[0]).with_function_tools(it[1])))
    system = st.sampled_from(["Low", "High"]).map(lambda e: Message.from_role_and_content(
        Role.SYSTEM, SystemContent.new().with_reasoning_effort(ReasoningEffort(e))))
    kinds = st.one_of(
        text.map(lambda t: Message.from_role_and_content(Role.USER, t)), said("analysis"), said("final"),
        said("commentary"), said("commentary").map(lambda m: m.with_recipient("functions.f")
                                                    .with_content_type("<|constrain|>json")),
        text.map(lambda t: Message.from_author_and_content(Author.new(Role.TOOL, "functions.f"), t)
                 .with_channel("commentary").with_recipient("assistant")), developer)
    return st.tuples(st.lists(system, max_size=1), st.lists(developer, max_size=1), st.lists(kinds, max_size=9))


def test_message_by_message_is_the_librarys_rendering():
    """Any conversation (tools or none, analysis before or after final answers, ending anywhere),
    rendered with ids kept, again from the kept ids, and grown by more messages, equals the
    library's rendering of the whole."""
    from hypothesis import given, settings
    from openai_harmony import Conversation, Role

    from frontend.kept_ids import KeptIds

    def whole(messages):
        return harmony().render_conversation_for_completion(Conversation.from_messages(messages), Role.ASSISTANT)

    @settings(max_examples=300, deadline=None)
    @given(_harmony_messages(), _harmony_messages())
    def check(first, more):
        messages, kept = [*first[0], *first[1], *first[2]], KeptIds()
        assert render.render_for_completion(messages, kept) == whole(messages)
        assert render.render_for_completion(messages, kept) == whole(messages)  # all kept now
        grown = messages + more[2]
        assert render.render_for_completion(grown, kept) == whole(grown)

    check()


def test_a_session_renders_only_its_new_messages():
    """A growing agent session through ``prompt_ids``: each turn finds every earlier message kept
    and equals the library's rendering; a full cache still renders right."""
    from frontend.kept_ids import KeptIds

    messages, kept, small = [{"role": "system", "content": "Be brief."}], KeptIds(), KeptIds(max_bytes=300)
    for turn in range(6):
        args = '{"city": "C%d"}' % turn
        call = {"id": f"c{turn}", "type": "function", "function": {"name": "get_weather", "arguments": args}}
        messages += [{"role": "user", "content": f"City {turn}?"},
                     {"role": "assistant", "reasoning_content": f"Look up {turn}.", "tool_calls": [call]},
                     {"role": "tool", "tool_call_id": f"c{turn}", "content": '{"temp": %d}' % turn}]
        body = chat_body(messages=messages)
        hits = kept.hits
        ids = render.prompt_ids(body, [TOOL], TODAY, kept=kept)
        assert ids == render.prompt_ids(body, [TOOL], TODAY) == render.prompt_ids(body, [TOOL], TODAY, kept=small)
        assert kept.hits - hits == (2 + 4 * turn if turn else 0)  # system, developer, each earlier turn's 4
    assert kept.reused_tokens > 0 and 0 < small.bytes <= 300


def test_the_benchmark_runs_a_harmony_session(monkeypatch, capsys):
    """scripts/bench_prompt_tokenize.py --harmony, 4 turns: a row a turn beside its bound, the
    context growing by about a tool result a turn."""
    from scripts import bench_prompt_tokenize

    monkeypatch.setattr("sys.argv", ["bench_prompt_tokenize.py", "--harmony", "--turns", "4", "--turn-tokens", "300"])
    bench_prompt_tokenize.main()
    out = capsys.readouterr().out
    rows = [line.split() for line in out.splitlines() if line.split()[0][0].isdigit()]
    assert len(rows) == 4 and "last turn" in out
    assert all(300 < int(b[1]) - int(a[1]) < 450 for a, b in zip(rows, rows[1:]))


# ==== reading replies ====

@pytest.mark.parametrize("size", [1, 3, 50])
def test_a_reply_streamed_in_pieces_of_any_size_gives_the_same_events(size):
    ids = ids_of(REPLY)
    parser = TOOLS.parser(reasoning=True, stream_arguments=True)
    events = [e for i in range(0, len(ids), size) for e in parser.feed("", ids[i:i + size])] + parser.flush()
    assert "".join(e.text for e in events if isinstance(e, Reasoning)) == "The user wants the weather."
    assert "".join(e for e in events if isinstance(e, str)) == "Checking."
    assert [e for e in events if isinstance(e, CallStart)] == [CallStart(0, "get_weather")]
    assert "".join(e.text for e in events if isinstance(e, CallArguments)) == ARGS
    assert events[-1] == ParsedCall("get_weather", ARGS) and parser.calls == 1


def test_a_final_answer_and_a_reply_off_the_format():
    reply = HarmonyFormat(None).whole("", ids_of("<|channel|>analysis<|message|>Easy.<|end|><|start|>assistant"
                                                 "<|channel|>final<|message|>It is 20 degrees.<|return|>"))
    assert (reply.content, reply.calls, reply.reasoning) == ("It is 20 degrees.", [], "Easy.")
    assert HarmonyFormat(None).whole("", ids_of("just words")).content == "just words"  # no header: content
    assert HarmonyFormat(None).whole("", ids_of(CALL)) == (ARGS, [], None)  # no tools given: no calls read
    assert HarmonyFormat(None).stop_token_ids == (200002, 200012)  # <|return|>, <|call|>


class Replayed:
    """A Session that replays a reply's tokens in chunks of ``size`` (the default: one chunk, as a
    request that does not stream gets)."""

    def __init__(self, text: str, size: int = 1 << 20, reason: str = "stop") -> None:
        ids = ids_of(text)
        pieces = [ids[i:i + size] for i in range(0, len(ids), size)]
        usage = Usage(prompt_tokens=10, completion_tokens=len(ids), cached_prompt_tokens=0)
        self._chunks = [Chunk(rid="x", text=harmony().decode(p), token_ids=p) for p in pieces[:-1]]
        self._chunks.append(Chunk(rid="x", text=harmony().decode(pieces[-1]), token_ids=pieces[-1],
                                  finish_reason=reason, usage=usage))

    async def chunks(self):
        for chunk in self._chunks:
            yield chunk


async def collect(events) -> list[dict]:
    """An SSE stream's JSON payloads."""
    out = []
    async for event in events:
        out += [json.loads(line[6:]) for line in event.decode().splitlines() if line.startswith("data: {")]
    return out


def test_chat_reads_reasoning_a_preamble_and_a_call_whole_and_streamed():
    ids = r.ResponseIds.new("chatcmpl", "m")
    whole = asyncio.run(chat.whole(Replayed(REPLY), ids, TOOLS))
    message = whole.choices[0].message
    assert (message.reasoning_content, message.content) == ("The user wants the weather.", "Checking.")
    assert [(c.function.name, c.function.arguments) for c in message.tool_calls] == [("get_weather", ARGS)]
    assert whole.choices[0].finish_reason == "tool_calls"
    chunks = asyncio.run(collect(chat.stream(Replayed(REPLY, 3), ids, TOOLS, False)))
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == message.reasoning_content
    assert "".join(d.get("content", "") for d in deltas) == "Checking."
    calls = [call for d in deltas for call in d.get("tool_calls", [])]
    assert calls[0]["function"]["name"] == "get_weather" and calls[0]["id"].startswith("call_")
    assert "".join(c["function"]["arguments"] for c in calls) == ARGS
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"


def test_responses_and_messages_read_the_same_reply():
    body = msgspec.convert({"model": "m", "input": "Weather in Paris?"}, responses_api.ResponsesRequest)
    response = asyncio.run(responses_reply.whole(Replayed(REPLY), responses_api.frame(body), TOOLS,
                                                 _tokenizer()))
    output = msgspec.to_builtins(response)["output"]
    assert [item["type"] for item in output] == ["reasoning", "message", "function_call"]
    assert (output[2]["name"], output[2]["arguments"]) == ("get_weather", ARGS)
    streamed = asyncio.run(collect(responses_reply.stream(Replayed(REPLY, 1), responses_api.frame(body),
                                                          TOOLS, _tokenizer())))
    assert streamed[-1]["type"] == "response.completed"
    assert [i["type"] for i in streamed[-1]["response"]["output"]] == ["reasoning", "message", "function_call"]
    message = asyncio.run(messages_reply.whole(Replayed(REPLY), messages_reply.new_message("m", 10),
                                               TOOLS))
    blocks = msgspec.to_builtins(message)["content"]
    assert [(b["type"], b.get("text") or b.get("input")) for b in blocks] == [
        ("text", "Checking."), ("tool_use", {"city": "Paris"})]
    assert message.stop_reason == "tool_use"


def _tokenizer():
    """Responses counts reasoning tokens with the model's tokenizer: o200k_harmony's."""
    from tokenizers import Tokenizer

    from frontend.tokenizer import ChatTokenizer
    from tests.tiny_harmony import harmony_tokenizer_json

    return ChatTokenizer(Tokenizer.from_str(harmony_tokenizer_json()))


# ==== served: the tiny chained gpt-oss ====

@pytest.fixture(scope="module")
def served(tmp_path_factory):
    from tests.test_serving import start, stop
    from tests.tiny_harmony import write_chained_gpt_oss

    model = tmp_path_factory.mktemp("gpt-oss-harmony")
    write_chained_gpt_oss(model, [ids_of("assistant")[0], *ids_of(CALL)])  # after "<|start|>assistant": the call
    server = start(tmp_path_factory.mktemp("srv"), model, "--served-model-name", "tiny")
    url = server.proc.stdout.readline().split()[-1]
    yield url
    assert stop(server) == 0, server.log.read_text()[-3000:]


def test_a_tool_round_trip_through_chat_completions(served):
    client = openai.OpenAI(base_url=served + "/v1", api_key="none", max_retries=0, timeout=120)
    ask = [{"role": "user", "content": "Weather in Paris?"}]
    first = client.chat.completions.create(model="tiny", messages=ask, tools=[TOOL], temperature=0, max_tokens=40)
    (call,) = first.choices[0].message.tool_calls
    assert (call.function.name, call.function.arguments, first.choices[0].finish_reason) == (
        "get_weather", ARGS, "tool_calls")
    assert first.usage.completion_tokens == len(ids_of(CALL))  # <|call|>, the request's stop id, ended it
    result = {"role": "tool", "tool_call_id": call.id, "content": '{"temp": 20}'}
    streamed = list(client.chat.completions.create(model="tiny", messages=[*ask, first.choices[0].message, result],
                                                   tools=[TOOL], temperature=0, max_tokens=40, stream=True))
    calls = [c for chunk in streamed for c in chunk.choices[0].delta.tool_calls or []]
    assert calls[0].function.name == "get_weather" and "".join(c.function.arguments for c in calls) == ARGS
    # the second request's system, developer and user messages came from the kept renderings
    metrics = urllib.request.urlopen(served + "/metrics", timeout=30).read().decode()
    reused = [line for line in metrics.splitlines() if line.startswith("sluice_prompt_tokens_reused_total ")]
    assert reused and float(reused[0].split()[1]) > 0, reused


def test_a_tool_round_trip_through_responses_and_messages(served):
    """The call, then the conversation with its result, rendered and served (a few tokens: the
    chat test above reads a whole second reply)."""
    client = openai.OpenAI(base_url=served + "/v1", api_key="none", max_retries=0, timeout=120)
    tool = {"type": "function", "name": "get_weather", "parameters": PARAMETERS, "strict": False}
    first = client.responses.create(model="tiny", input="Weather in Paris?", tools=[tool], temperature=0)
    (call,) = [i for i in first.output if i.type == "function_call"]
    assert (call.name, call.arguments) == ("get_weather", ARGS)
    items = [{"role": "user", "content": "Weather in Paris?"}, call,
             {"type": "function_call_output", "call_id": call.call_id, "output": "20"}]
    second = client.responses.create(model="tiny", input=items, tools=[tool], max_output_tokens=2)
    assert second.status == "incomplete" and second.usage.input_tokens > first.usage.input_tokens
    claude = anthropic.Anthropic(base_url=served, api_key="none", max_retries=0, timeout=120)
    weather = {"name": "get_weather", "input_schema": PARAMETERS}
    ask = [{"role": "user", "content": "Weather in Paris?"}]
    reply = claude.messages.create(model="tiny", max_tokens=40, messages=ask, tools=[weather])
    (use,) = reply.content
    assert (use.type, use.name, use.input, reply.stop_reason) == ("tool_use", "get_weather", {"city": "Paris"},
                                                                  "tool_use")
    turn = [*ask, {"role": "assistant", "content": [{"type": "tool_use", "id": use.id, "name": use.name,
                                                     "input": use.input}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "20"}]}]
    again = claude.messages.create(model="tiny", max_tokens=2, messages=turn, tools=[weather])
    counted = claude.messages.count_tokens(model="tiny", messages=turn, tools=[weather])
    read = again.usage.cache_read_input_tokens or 0  # Anthropic's input_tokens leave cache reads out
    assert again.stop_reason == "max_tokens" and again.usage.input_tokens + read == counted.input_tokens
    assert counted.input_tokens > reply.usage.input_tokens
