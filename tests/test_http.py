"""The HTTP API end to end with the official ``openai`` client, the frontend process and
tests/fake_scheduler.py (which echoes its prompt ids, then EOS): the output is scripted by the
prompt, so tool calls, keys and loading can be checked exactly. The real scheduler behind the
same API is in test_http_serving.py."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest

sys.path.insert(0, str(Path(__file__).parent))
from fake_scheduler import write_byte_tokenizer  # noqa: E402

from frontend.client import Client, ServerError  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
FAKE = f"{sys.executable} {REPO / 'tests' / 'fake_scheduler.py'}"
WAIT_S = 30.0  # an upper bound on waits, never a measured duration
KEY = "sesame"
# Tool names first, then every message as "role(name):content|", tool calls as <call NAME ARGS>: the
# fake echoes this text, so a reply shows exactly what the template was given.
TEMPLATE = (
    "{% if tools %}{% for t in tools %}[{{ t.function.name }}]{% endfor %}{% endif %}"
    "{% for m in messages %}{{ m.role }}{% if m.name %}({{ m.name }}){% endif %}:{{ m.content }}"
    "{% for c in m.tool_calls or [] %}<call {{ c.function.name }} {{ c.function.arguments | tojson }}>"
    "{% endfor %}|{% endfor %}"
)
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}
CALL = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'


def start(tmp: Path, *args: str, template: str = TEMPLATE) -> tuple[subprocess.Popen, str, str]:
    """The frontend with the fake scheduler; returns (process, ZMQ endpoint, HTTP url)."""
    tok = write_byte_tokenizer(tmp / "tok", template)
    proc = subprocess.Popen(
        [sys.executable, "-m", "frontend", "--endpoint", "tcp://127.0.0.1:*",
         "--scheduler-cmd", FAKE, "--tokenizer-path", str(tok), "--max-context", "1024",
         "--ready-timeout", str(WAIT_S), "--served-model-name", "fake", *args],
        cwd=REPO, stdout=subprocess.PIPE, stderr=(tmp / "stderr").open("w"), text=True)
    lines = [proc.stdout.readline() for _ in range(3)]
    assert lines[2].startswith("http endpoint "), (tmp / "stderr").read_text()
    return proc, lines[0].split()[-1], lines[2].split()[-1]


def stop(proc: subprocess.Popen) -> int:
    proc.terminate()
    return proc.wait(timeout=WAIT_S)


def assert_one_abort(endpoint: str) -> None:
    """Waits up to ``WAIT_S`` for the scheduler behind ``endpoint`` to count an abort; asserts it counted one."""
    with Client(endpoint, timeout=WAIT_S) as c:
        deadline = time.monotonic() + WAIT_S
        while c.stats()["aborts_total"] < 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert c.stats()["aborts_total"] == 1


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    proc, endpoint, url = start(tmp_path_factory.mktemp("http"), "--http-port", "0",
                                "--api-key", KEY)
    yield endpoint, url
    assert stop(proc) == 0


@pytest.fixture
def oai(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server[1] + "/v1", api_key=KEY, max_retries=0, timeout=WAIT_S)


def test_tool_call_is_parsed_from_the_reply(oai):
    reply = oai.chat.completions.create(
        model="fake", messages=[{"role": "user", "content": "let me check " + CALL}],
        tools=[WEATHER], max_tokens=200)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "[get_weather]user:let me check |"  # the template saw the tool
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}
    assert call.id and call.type == "function"


def test_tool_call_is_parsed_from_the_stream(oai):
    stream = oai.chat.completions.create(
        model="fake", messages=[{"role": "user", "content": "let me check " + CALL}],
        tools=[WEATHER], max_tokens=200, stream=True)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    content = "".join(c.choices[0].delta.content or "" for c in chunks)
    deltas = [t for c in chunks for t in c.choices[0].delta.tool_calls or []]
    assert content == "[get_weather]user:let me check |"
    assert (deltas[0].index, deltas[0].function.name, deltas[0].id is not None) == (0, "get_weather", True)
    arguments = "".join(t.function.arguments for t in deltas)  # the first delta's are ""
    assert {t.index for t in deltas} == {0} and json.loads(arguments) == {"city": "Paris"}
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_tool_choice_none_hides_the_tools_and_parses_nothing(oai):
    reply = oai.chat.completions.create(
        model="fake", messages=[{"role": "user", "content": CALL}], tools=[WEATHER],
        tool_choice="none", max_tokens=200)
    assert reply.choices[0].message.content == "user:" + CALL + "|"
    assert not reply.choices[0].message.tool_calls and reply.choices[0].finish_reason == "stop"


def test_tool_results_render_through_the_template(oai):
    messages = [
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
    ]
    reply = oai.chat.completions.create(model="fake", messages=messages, max_tokens=200)
    assert reply.choices[0].message.content == (
        'user:weather?|assistant:<call get_weather {"city": "Paris"}>|tool(get_weather):sunny|')


def test_forcing_a_tool_call_the_request_cannot_make_is_refused(oai):
    with pytest.raises(openai.BadRequestError, match="no tool named 'get_time'"):
        oai.chat.completions.create(model="fake", messages=[{"role": "user", "content": "x"}],
                                    tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "get_time"}})
    with pytest.raises(openai.BadRequestError, match="needs tools"):
        oai.chat.completions.create(model="fake", messages=[{"role": "user", "content": "x"}], tool_choice="required")


def test_http_needs_the_key(server):
    bad = openai.OpenAI(base_url=server[1] + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as err:
        bad.models.list()
    assert err.value.status_code == 401 and err.value.body["code"] == "invalid_api_key"
    assert httpx.post(server[1] + "/v1/completions", json={"model": "fake", "prompt": "x"}).status_code == 401
    assert httpx.get(server[1] + "/health").status_code == 200  # probes need no key
    good = openai.OpenAI(base_url=server[1] + "/v1", api_key=KEY, max_retries=0)
    assert [m.id for m in good.models.list()] == ["fake"]


def test_zmq_needs_the_key(server, monkeypatch):
    monkeypatch.delenv("SLUICE_API_KEY", raising=False)
    with Client(server[0], timeout=WAIT_S) as c:
        with pytest.raises(ServerError, match="api_key") as err:
            c.generate(prompt="hi", max_tokens=5)
        assert err.value.code == "unauthorized"
    with Client(server[0], timeout=WAIT_S, api_key=KEY) as c:
        assert c.generate(prompt="hi", max_tokens=5).text == "hi"
    monkeypatch.setenv("SLUICE_API_KEY", KEY)
    with Client(server[0], timeout=WAIT_S) as c:
        assert c.stats()["requests_total"] >= 1


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_health_is_503_while_loading_then_200(tmp_path):
    port = _free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "frontend", "--endpoint", "tcp://127.0.0.1:*", "--http-port",
         str(port), "--scheduler-cmd", FAKE, "--tokenizer-path",
         str(write_byte_tokenizer(tmp_path / "tok")), "--ready-delay", "3"],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        deadline, status = time.monotonic() + WAIT_S, None
        while status is None and time.monotonic() < deadline:
            try:
                status = httpx.get(f"http://127.0.0.1:{port}/health").status_code
            except httpx.TransportError:  # not listening yet
                time.sleep(0.05)
        assert status == 503
        loading = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json={"model": "x", "prompt": "x"})
        assert loading.status_code == 503 and "loading" in loading.json()["error"]["message"]
        assert proc.stdout.readline().startswith("frontend endpoint")  # ready now
        assert httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200
    finally:
        assert stop(proc) == 0
