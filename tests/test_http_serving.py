"""The HTTP API over the whole serving path on CPU, with the official ``openai`` client: the
frontend process, the real scheduler (--check-pages: a page leak crashes it and fails every later
test) and the tiny byte-level model of test_serving.py. One server for the module."""

from __future__ import annotations

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from frontend.client import Client
from tests.test_serving import PAGE, WAIT_S, assert_pages_settled, model_dir, start, stop  # noqa: F401 (a fixture)

MAX_BODY = 64 << 10


@pytest.fixture(scope="module")
def server(tmp_path_factory, model_dir):  # noqa: F811
    s = start(tmp_path_factory.mktemp("srv"), model_dir, "--served-model-name", "tiny",
              "--http-max-body", str(MAX_BODY))
    url = s.proc.stdout.readline().split()[-1]
    yield s, url
    assert stop(s) == 0, s.log.read_text()[-3000:]


@pytest.fixture
def oai(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server[1] + "/v1", api_key="none", max_retries=0, timeout=WAIT_S)


@pytest.fixture
def zmq_client(server):
    with Client(server[0].endpoint, timeout=WAIT_S) as c:
        yield c


CHAT = [{"role": "user", "content": "tell me about sluices"}]
GREEDY = dict(model="tiny", temperature=0, max_tokens=12)


def test_chat_whole_and_streamed_agree(oai):
    whole = oai.chat.completions.create(messages=CHAT, **GREEDY)
    chunks = list(oai.chat.completions.create(messages=CHAT, stream=True,
                                              stream_options={"include_usage": True}, **GREEDY))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    reasons = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert reasons == [whole.choices[0].finish_reason] and reasons[0] in ("stop", "length")
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert whole.usage.total_tokens == whole.usage.prompt_tokens + whole.usage.completion_tokens


def test_completions_whole_streamed_and_token_ids(oai):
    whole = oai.completions.create(prompt="count: 1 2 3", extra_body={"ignore_eos": True}, **GREEDY)
    assert whole.choices[0].finish_reason == "length" and whole.usage.completion_tokens == 12
    streamed = list(oai.completions.create(prompt="count: 1 2 3", stream=True,
                                           extra_body={"ignore_eos": True}, **GREEDY))
    assert "".join(c.choices[0].text for c in streamed) == whole.choices[0].text
    by_ids = oai.completions.create(prompt=list(b"count: 1 2 3"), extra_body={"ignore_eos": True}, **GREEDY)
    assert by_ids.choices[0].text == whole.choices[0].text


def test_max_completion_tokens_and_stop_strings(oai):
    done = oai.completions.create(prompt="abc", extra_body={"ignore_eos": True}, **{**GREEDY, "max_tokens": 8})
    text = done.choices[0].text
    stop_at = text[3:5]
    stopped = oai.completions.create(prompt="abc", stop=[stop_at], extra_body={"ignore_eos": True},
                                     **{**GREEDY, "max_tokens": 8})
    assert stopped.choices[0].finish_reason == "stop" and stopped.choices[0].text == text[:text.index(stop_at)]
    capped = oai.chat.completions.create(messages=CHAT, max_completion_tokens=3, model="tiny", temperature=0,
                                         extra_body={"ignore_eos": True})
    assert capped.usage.completion_tokens == 3 and capped.choices[0].finish_reason == "length"


def test_second_turn_reports_cached_prompt_tokens(oai):
    turn1 = [{"role": "user", "content": "tell me about locks on rivers and canals"}]
    first = oai.chat.completions.create(messages=turn1, **GREEDY)
    turn2 = turn1 + [{"role": "assistant", "content": first.choices[0].message.content},
                     {"role": "user", "content": "and weirs?"}]
    second = oai.chat.completions.create(messages=turn2, **GREEDY)
    assert second.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens - PAGE


def test_disconnect_mid_stream_aborts_and_frees_every_page(server, zmq_client):
    aborted = zmq_client.stats()["requests_aborted"]
    body = {"model": "tiny", "prompt": "a long story " * 5, "max_tokens": 400, "temperature": 0,
            "ignore_eos": True, "stream": True}
    with httpx.stream("POST", server[1] + "/v1/completions", json=body, timeout=WAIT_S) as response:
        lines = response.iter_lines()
        assert all(next(lines) is not None for _ in range(4))  # some chunks came
    assert_pages_settled(zmq_client)
    assert zmq_client.stats()["requests_aborted"] == aborted + 1


@pytest.mark.parametrize("body, status, match", [
    (b'{"model": "tiny", "messages": [', 400, "malformed JSON"),
    (b'{"model": "tiny", "messages": "hi"}', 400, "messages"),
    (b'{"model": "tiny", "messages": [{"role": "user", "content": "x"}], "temperature": "hot"}', 400,
     "temperature"),
    (b'{"model": "tiny", "messages": [{"role": "user", "content": "x"}], "max_tokens": -1}', 400,
     "max_tokens"),
    (b'{"model": "gpt-9", "messages": [{"role": "user", "content": "x"}]}', 404, "not served"),
    (b'{"model": "tiny", "messages": [{"role": "user", "content": "x"}], "n": 3}', 400, "n must be 1"),
    (b'{"model": "tiny", "messages": [{"role": "user", "content": "x"}], "logprobs": true}', 400, "logprobs"),
    (b'{"model": "tiny", "messages": [{"role": "user", "content": "' + b"x" * MAX_BODY + b'"}]}', 413,
     "larger than"),
    (b'{"model": "tiny", "messages": [{"role": "user", "content": "' + b"x" * 600 + b'"}]}', 400, "context"),
])
def test_bad_request_gets_the_error_object_and_serving_goes_on(server, oai, body, status, match):
    reply = httpx.post(server[1] + "/v1/chat/completions", content=body, timeout=WAIT_S,
                       headers={"Content-Type": "application/json"})
    assert reply.status_code == status, reply.text
    error = reply.json()["error"]
    assert match in error["message"] and error["type"] in ("invalid_request_error", "not_found_error")
    assert oai.chat.completions.create(messages=CHAT, **GREEDY).choices[0].message.content is not None


def test_unknown_path_and_method_get_the_error_object(server):
    assert httpx.get(server[1] + "/v1/nothing").json()["error"]["message"]
    assert httpx.get(server[1] + "/v1/chat/completions").status_code == 405


def test_models_and_health(oai, server):
    assert [m.id for m in oai.models.list()] == ["tiny"]
    assert httpx.get(server[1] + "/health").status_code == 200


def _metrics(url: str) -> dict[tuple[str, tuple], float]:
    text = httpx.get(url + "/metrics").text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for f in text_string_to_metric_families(text) for s in f.samples}


def test_metrics_parse_and_move_with_the_zmq_stats(server, oai, zmq_client):
    before = _metrics(server[1])
    oai.completions.create(prompt="metrics please", extra_body={"ignore_eos": True}, **GREEDY)
    after = _metrics(server[1])
    stats = zmq_client.stats()
    for name in ("sluice_generated_tokens_total", "sluice_prompt_tokens_total"):
        assert after[(name, ())] > before[(name, ())]
    assert after[("sluice_generated_tokens_total", ())] == stats["generated_tokens"]
    assert after[("sluice_time_to_first_token_seconds_count", ())] > before[
        ("sluice_time_to_first_token_seconds_count", ())]
    assert after[("sluice_inter_token_latency_seconds_count", ())] >= before[
        ("sluice_inter_token_latency_seconds_count", ())] + 10
    assert after[("sluice_requests_running", ())] == 0
    assert after[("sluice_kv_usage_ratio", (("tier", "gpu"),))] == stats["kv_usage"]
    assert ("sluice_cached_prompt_tokens_total", ()) in after
    assert after[("sluice_frontend_requests_total", ())] == stats["frontend_requests_total"]
    # the engine's step time: all host work on the CPU (no event to wait on), and it grows with the steps
    assert stats["engine_step_s"] > 0 and stats["engine_gpu_wait_s"] == 0
    assert stats["engine_host_s"] == stats["engine_step_s"]
    assert after[("sluice_engine_seconds_total", (("kind", "host"),))] > before[
        ("sluice_engine_seconds_total", (("kind", "host"),))]
    # of it, enqueueing the steps with a prefill chunk (on the CPU the step computes as it enqueues)
    assert 0 < stats["engine_prefill_launch_s"] < stats["engine_host_s"]
    assert after[("sluice_engine_prefill_launch_seconds_total", ())] > before[
        ("sluice_engine_prefill_launch_seconds_total", ())]


def test_a_resent_history_is_not_tokenized_again(server, oai, zmq_client):
    """An agent's next turn resends its history: the frontend takes that message's tokens from its
    kept pieces (frontend/prompt_pieces.py) and counts them in /metrics."""
    history = [{"role": "user", "content": "a tool result of a few hundred characters. " * 8}]
    before = _metrics(server[1])[("sluice_prompt_tokens_reused_total", ())]
    first = oai.chat.completions.create(messages=history, **GREEDY)
    turn2 = [*history, {"role": "assistant", "content": first.choices[0].message.content},
             {"role": "user", "content": "and now?"}]
    oai.chat.completions.create(messages=turn2, **GREEDY)
    after = _metrics(server[1])
    reused = len(history[0]["content"]) + len("user\n")  # byte tokens: the message's piece after <|im_start|>
    assert after[("sluice_prompt_tokens_reused_total", ())] - before == reused
    assert after[("sluice_prompt_pieces_kept_tokens", ())] >= reused
    assert zmq_client.stats()["frontend_prompt_tokens_reused"] == after[("sluice_prompt_tokens_reused_total", ())]


def test_agent_sessions_over_http(server):
    """agent_sessions --text --http: each turn by the openai client through the OpenAI API, timed
    to its first text; later turns find the task (280 byte tokens) in the prefix cache, as over ZMQ."""
    import asyncio

    from scripts.agent_sessions import Workload, run_sessions

    workload = Workload(sessions=2, turns=3, context=80, tool_tokens=10, max_tokens=4, text=True)
    rows = asyncio.run(run_sessions(server[0].endpoint, workload, WAIT_S, http=server[1]))
    assert len(rows) == 6 and all(r["new_tokens"] == 4 and 0 < r["ttft_s"] <= r["seconds"] for r in rows)
    for r in rows:
        if r["turn"]:
            assert 280 - PAGE < r["cached_tokens"] <= r["ideal_cached"] < r["prompt_tokens"], r
    with pytest.raises(ValueError, match="--text"):
        asyncio.run(run_sessions(server[0].endpoint, Workload(turns=1), WAIT_S, http=server[1]))


def test_disconnect_before_a_whole_reply_aborts_and_frees_every_page(server, zmq_client):
    aborted = zmq_client.stats()["requests_aborted"]
    body = {"model": "tiny", "prompt": "a long wait " * 5, "max_tokens": 400, "temperature": 0,
            "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):  # the client gives up and closes the connection
        httpx.post(server[1] + "/v1/completions", json=body, timeout=httpx.Timeout(WAIT_S, read=0.05))  # well before 400 tokens
    assert_pages_settled(zmq_client)
    assert zmq_client.stats()["requests_aborted"] == aborted + 1
