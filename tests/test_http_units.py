"""Parts of the HTTP API without processes: the tool-call parser, the body conversion, the
metrics collector."""

from __future__ import annotations

import json
import random

import msgspec
import pytest
from prometheus_client.parser import text_string_to_metric_families

from frontend.http import convert
from frontend.http.errors import ApiError
from frontend.http.metrics import Metrics
from frontend.http.schemas import ChatRequest, CompletionRequest
from frontend.http.tool_calls import ParsedCall, ToolCallStream, parse_tool_calls

CALL = '<tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call>'


def test_whole_text_calls_and_content():
    content, calls = parse_tool_calls("thinking...\n" + CALL + "\n" + CALL.replace('"f"', '"g"'))
    assert content == "thinking..."
    assert calls == [ParsedCall("f", '{"x": 1}'), ParsedCall("g", '{"x": 1}')]
    assert parse_tool_calls("no calls here") == ("no calls here", [])
    assert parse_tool_calls(CALL) == (None, [ParsedCall("f", '{"x": 1}')])


@pytest.mark.parametrize("body", ["not json", '["a list"]', '{"arguments": {}}'])
def test_a_block_that_is_not_a_call_stays_content(body):
    text = f"a <tool_call>{body}</tool_call> b"
    assert parse_tool_calls(text) == (text, [])


def test_unclosed_block_is_a_call_when_its_body_parses():
    assert parse_tool_calls('<tool_call>{"name": "f", "arguments": "{}"}') == (None, [ParsedCall("f", "{}")])
    assert parse_tool_calls("<tool_call>{broken") == ("<tool_call>{broken", [])


def test_streamed_in_random_pieces_gives_the_same_events():
    text = "I will call <tool_c" + "x " + CALL + " <tool_call>oops</tool_call> done" + CALL
    rng = random.Random(0)
    for _ in range(50):
        parser, events, i = ToolCallStream(), [], 0
        while i < len(text):
            n = rng.randint(1, 7)
            events += parser.feed(text[i:i + n])
            i += n
        events += parser.flush()
        content = "".join(e for e in events if isinstance(e, str))
        assert content == "I will call <tool_cx  <tool_call>oops</tool_call> done"
        assert [e for e in events if isinstance(e, ParsedCall)] == [ParsedCall("f", '{"x": 1}')] * 2
        assert all(not isinstance(e, str) or "<tool_call>{" not in e for e in events)


def _chat(**fields) -> ChatRequest:
    return msgspec.convert({"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields},
                           ChatRequest)


def test_conversion_applies_the_internal_ranges():
    body = _chat(temperature=0.5, top_k=3, stop="x", seed=7, max_completion_tokens=9)
    g = convert.to_generate(body, {"input_ids": [1, 2]}, convert.chat_max_tokens(body), 100)
    assert (g.temperature, g.top_k, g.stop, g.seed, g.max_tokens) == (0.5, 3, ["x"], 7, 9)
    for bad in ({"temperature": -1.0}, {"top_p": 0.0}, {"max_tokens": 0}, {"top_k": -2},
                {"stop": [""]}):
        body = _chat(**bad)
        with pytest.raises(ApiError) as err:
            convert.to_generate(body, {"input_ids": [1]}, convert.chat_max_tokens(body), 100)
        assert err.value.status == 400


@pytest.mark.parametrize("fields, status", [
    ({"model": "other"}, 404), ({"n": 2}, 400), ({"logprobs": True}, 400),
    ({"presence_penalty": 0.5}, 400), ({"logit_bias": {"1": 2.0}}, 400)])
def test_unsupported_options_are_refused(fields, status):
    with pytest.raises(ApiError) as err:
        convert.check_request(_chat(**fields), "m")
    assert err.value.status == status


def test_completion_prompts():
    def prompt(p):
        return convert.completion_prompt(msgspec.convert({"model": "m", "prompt": p}, CompletionRequest))
    assert prompt("a") == {"prompt": "a"} and prompt(["a"]) == {"prompt": "a"}
    assert prompt([1, 2]) == {"input_ids": [1, 2]}
    with pytest.raises(ApiError):
        prompt(["a", "b"])


def _samples(text: str) -> dict[tuple[str, tuple], float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for f in text_string_to_metric_families(text) for s in f.samples}


def test_metrics_expose_the_scheduler_stats_and_latencies():
    m = Metrics()
    m.on_tokens(0.0, None, 0.5, 1)  # first token after 0.5 s
    m.on_tokens(0.0, 0.5, 0.7, 2)  # two more 0.1 s apart
    stats = {"generated_tokens": 3, "prompt_tokens": 10, "kv_usage": 0.25, "kv_host_usage": 0.5,
             "moe_hit_rate": 0.9, "prefill_chunks_kernel": 2, "requests_running": 1}
    body, content_type = m.render(stats)
    got = _samples(body.decode())
    assert content_type.startswith("text/plain")
    assert got[("sluice_generated_tokens_total", ())] == 3
    assert got[("sluice_kv_usage_ratio", (("tier", "host"),))] == 0.5
    assert got[("sluice_prefill_pipeline_chunks_total", (("stage", "kernel"),))] == 2
    assert got[("sluice_time_to_first_token_seconds_sum", ())] == pytest.approx(0.5)
    assert got[("sluice_inter_token_latency_seconds_count", ())] == 2
    assert got[("sluice_inter_token_latency_seconds_sum", ())] == pytest.approx(0.2)
    assert ("sluice_expert_cache_hit_rate", ()) in got
    assert not any(name.startswith("sluice_pcie") for name, _ in got)  # not reported: left out
    assert json.dumps(stats)  # the snapshot stays plain data
    assert not any(name.startswith("sluice_rank_") for name, _ in got)  # one GPU: no rank series


def test_metrics_split_the_engines_step_time_into_host_work_and_waiting_for_the_gpu():
    stats = {"engine_step_s": 2.0, "engine_host_s": 1.5, "engine_gpu_wait_s": 0.5, "engine_prefill_launch_s": 0.25}
    got = _samples(Metrics().render(stats)[0].decode())
    assert got[("sluice_engine_seconds_total", (("kind", "host"),))] == 1.5
    assert got[("sluice_engine_seconds_total", (("kind", "gpu_wait"),))] == 0.5
    assert got[("sluice_engine_prefill_launch_seconds_total", ())] == 0.25


def test_metrics_show_a_hybrid_models_state_snapshots():
    stats = {"state_prefix_tokens": 96, "state_recomputed_tokens": 4, "state_snapshots_gpu": 3,
             "state_snapshots_host": 1, "state_snapshot_bytes_gpu": 3 << 20, "state_snapshot_bytes_host": 1 << 20}
    got = _samples(Metrics().render(stats)[0].decode())
    assert got[("sluice_state_prompt_tokens_total", (("kind", "resumed"),))] == 96
    assert got[("sluice_state_prompt_tokens_total", (("kind", "recomputed"),))] == 4
    assert got[("sluice_state_snapshots", (("tier", "host"),))] == 1
    assert got[("sluice_state_snapshot_bytes", (("tier", "gpu"),))] == 3 << 20
    assert not any(name.startswith("sluice_state") for name, _ in _samples(Metrics().render({})[0].decode()))


def test_metrics_show_each_rank_of_an_expert_parallel_run():
    stats = {"ranks": 2, "moe_hit_rate": 0.5, "moe_bytes_h2d": 10, "rank0.moe_hit_rate": 0.5,
             "rank0.moe_bytes_h2d": 10, "rank1.moe_hit_rate": 0.75, "rank1.moe_bytes_h2d": 30,
             "rank1.all_reduce_s": 0.25}
    got = _samples(Metrics().render(stats)[0].decode())
    assert got[("sluice_expert_cache_hit_rate", ())] == 0.5  # the total as with one GPU
    assert got[("sluice_rank_expert_cache_hit_rate", (("rank", "1"),))] == 0.75
    assert got[("sluice_rank_pcie_bytes_total", (("kind", "expert_miss_h2d"), ("rank", "0")))] == 10
    assert got[("sluice_rank_pcie_bytes_total", (("kind", "expert_miss_h2d"), ("rank", "1")))] == 30
    assert got[("sluice_rank_all_reduce_seconds_total", (("rank", "1"),))] == 0.25
    assert ("sluice_rank_all_reduce_seconds_total", (("rank", "0"),)) not in got  # not reported: left out


@pytest.mark.parametrize("endpoint, http_host, api_key, warnings", [
    ("tcp://127.0.0.1:5557", "127.0.0.1", None, 0),
    ("ipc:///tmp/sluice.sock", "localhost", None, 0),
    ("tcp://*:5557", "127.0.0.1", None, 1),
    ("tcp://127.0.0.1:5557", "0.0.0.0", None, 1),
    ("tcp://[::]:5557", "::", None, 2),
    ("tcp://0.0.0.0:5557", "0.0.0.0", "key", 0),
])
def test_open_sockets_without_a_key_are_warned_about(caplog, endpoint, http_host, api_key, warnings):
    from frontend.app import FrontendConfig, _warn_open_sockets

    _warn_open_sockets(FrontendConfig(endpoint=endpoint, http_host=http_host, api_key=api_key))
    assert len([r for r in caplog.records if "no --api-key" in r.message]) == warnings


def test_the_key_comes_from_the_environment_and_http_can_be_off(monkeypatch):
    from frontend.app import parse_args

    monkeypatch.setenv("SLUICE_API_KEY", "k")
    config = parse_args(["--no-http", "--model", "m"])
    assert (config.api_key, config.http_port, config.engine_args) == ("k", None, ("--model", "m"))
    assert parse_args(["--api-key", "x"]).api_key == "x"


@pytest.mark.parametrize("part", [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AA=="}},
                                  {"type": "input_audio", "input_audio": {"data": "AA==", "format": "wav"}},
                                  {"type": "video_url", "video_url": {"url": "https://example.com/v.mp4"}}])
def test_non_text_content_is_refused_in_one_line(part):
    body = msgspec.convert({"model": "m", "messages": [{"role": "user", "content": [
        {"type": "text", "text": "what is this?"}, part]}]}, ChatRequest)
    with pytest.raises(ApiError) as err:
        convert.chat_prompt_ids(body, None, None)
    assert err.value.status == 400 and part["type"] in str(err.value) and "\n" not in str(err.value)


def test_chat_prompts_are_tokenized_off_the_event_loop(monkeypatch):
    """Rendering the template over a /v1/messages body of tens of MB and tokenizing it ran on the
    event loop, and stress.py's 5 s liveness probe went unanswered meanwhile. Here the tokenization
    waits for the loop itself to release it: run on the loop, it never would be."""
    import asyncio
    import threading

    from frontend.http import routes

    released = threading.Event()

    def tokenize(ctx, body):
        assert released.wait(5), "the event loop was blocked while tokenizing"
        return "generate", False

    monkeypatch.setattr(routes, "chat_generate", tokenize)

    async def main():
        task = asyncio.create_task(routes.chat_generate_off_loop(None, None))
        await asyncio.sleep(0.05)
        released.set()  # runs only while the loop is free
        return await task

    assert asyncio.run(main()) == ("generate", False)
