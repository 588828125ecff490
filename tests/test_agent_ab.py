"""scripts/agent_ab.py: the A/B of two server builds on the growing agent session. End to end on
CPU with the default model (two real servers one after the other), and its report on made-up runs."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from scripts import ab_report

REPO = Path(__file__).resolve().parents[1]
SESSIONS, TURNS, CONTEXT, TOOL, ANSWER = 2, 4, 48, 16, 4


@pytest.mark.slow
def test_agent_ab_end_to_end_on_cpu(tmp_path):
    out_json, out_png = tmp_path / "ab.json", tmp_path / "ab.png"
    cmd = [sys.executable, "scripts/agent_ab.py", "--serve", "--device cpu", "--sessions", str(SESSIONS),
           "--turns", str(TURNS), "--context", str(CONTEXT), "--tool-tokens", str(TOOL), "--max-tokens", str(ANSWER),
           "--warmup-turns", "1", "--json", str(out_json), "--png", str(out_png), "--log-dir", str(tmp_path / "logs")]
    # SLUICE_PY: serve.sh runs this interpreter as it is instead of setting up the checkout's .venv
    env = {**os.environ, "SLUICE_PY": sys.executable, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]

    result = json.loads(out_json.read_text())
    assert [(r["build"], r["round"]) for r in result["runs"]] == [("A", 0), ("B", 0)]
    assert result["builds"][0]["options"] == [] and result["builds"][1]["options"] == ["--prefill-invalidate", "eager"]
    for run in result["runs"]:
        own = ["--prefill-invalidate", "eager"] if run["build"] == "B" else ["--device", "cpu"]
        assert run["command"][0].endswith("scripts/serve.sh") and run["command"][-2:] == own
        assert sorted((t["session"], t["turn"]) for t in run["turns"]) == [(s, t) for s in range(SESSIONS)
                                                                           for t in range(TURNS)]
        for t in run["turns"]:
            # each turn's prompt is the whole history: first prompt, then per turn a tool result and an answer
            assert t["prompt_tokens"] == CONTEXT + t["turn"] * (TOOL + ANSWER)
            assert t["new_tokens"] == ANSWER and 0 < t["ttft_s"] <= t["seconds"]
            assert t["ideal_cached"] == (t["prompt_tokens"] - TOOL if t["turn"] else 0)
            assert t["cached_tokens"] <= t["prompt_tokens"]
        assert [t["session"] for t in run["warmup"]] == [-1]
        served = run["stats_after"]["requests_finished"] - run["stats_before"]["requests_finished"]
        assert served == SESSIONS * TURNS
    summary = result["summary"]
    for label in "AB":
        turns = [t for r in result["runs"] if r["build"] == label for t in r["turns"]]
        assert summary[label]["turns"] == SESSIONS * TURNS
        assert summary[label]["worst_turn_s"] == max(t["seconds"] for t in turns)
        assert summary[label]["cached_tokens"] > 0  # the prefix cache served the history

    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    import matplotlib.image

    assert matplotlib.image.imread(out_png).shape[:2][0] > 100

    lines = proc.stdout.splitlines()
    assert lines[0].split() == ["A", "B"]
    row = {line[:24].strip(): line[24:].split() for line in lines[1:] if line[:24].strip()}
    assert row["turns > 10 s"] == [str(summary["A"]["turns_over_slow"]), str(summary["B"]["turns_over_slow"])]
    assert row["worst turn, s"] == [f"{summary[x]['worst_turn_s']:.3f}" for x in "AB"]
    assert row["expert-cache hit rate"] == ["-", "-"]  # the default model runs fully resident here

    # the same report from one build per file (as two commands would write them)
    for label in "AB":
        part = {**result, "builds": [b for b in result["builds"] if b["label"] == label],
                "runs": [r for r in result["runs"] if r["build"] == label]}
        (tmp_path / f"{label}.json").write_text(json.dumps(part))
    merged = tmp_path / "merged.json"
    from scripts import agent_ab

    agent_ab.main(["--merge", str(tmp_path / "B.json"), str(tmp_path / "A.json"), "--json", str(merged), "--no-plot"])
    assert json.loads(merged.read_text())["summary"] == summary


def _run(build: str, seconds: list[float], stats_before: dict, stats_after: dict) -> dict:
    turns = [dict(session=0, turn=i, seconds=s, ttft_s=s / 2, prompt_tokens=100 + 10 * i, cached_tokens=90 * (i > 0),
                  ideal_cached=95 * (i > 0)) for i, s in enumerate(seconds)]
    return dict(build=build, turns=turns, stats_before=stats_before, stats_after=stats_after)


def test_summary_counts_slow_turns_and_reads_counter_deltas():
    before = dict(moe_hits=100, moe_lookups=200, kv_host_pages_restored=5, compiles_after_warmup=2)
    runs = [_run("A", [1.0, 12.0, 3.0], before, dict(moe_hits=190, moe_lookups=300, kv_host_pages_restored=9,
                                                     compiles_after_warmup=5)),
            _run("A", [11.0, 2.0], {}, dict(moe_hits=30, moe_lookups=100, kv_host_pages_restored=1,
                                            compiles_after_warmup=0))]
    s = ab_report.summarise_build(runs, slow_s=10.0)
    assert (s["runs"], s["turns"], s["turns_over_slow"], s["worst_turn_s"]) == (2, 5, 2, 12.0)
    assert s["expert_hit_rate"] == pytest.approx((90 + 30) / (100 + 100))
    assert s["kv_host_pages_restored"] == 4 + 1
    assert s["compiles_after_warmup"] == 3 and s["plans_after_warmup"] is None  # compiled during the measured turns
    assert (s["cached_tokens"], s["ideal_cached_tokens"]) == (270, 285)
    assert s["turn_p50_s"] == 3.0 and s["max_context_tokens"] == 120


def test_decode_time_per_token_at_the_shortest_and_longest_contexts():
    """Turn minus TTFT over the tokens after the first, the median of each end's tenth of the turns
    (by prompt length, whatever their order); turns without a TTFT or a second token do not count."""
    turns = [dict(prompt_tokens=1000 * (40 - i), seconds=0.1 + 0.001 * (40 - i) * 9, ttft_s=0.1, new_tokens=10)
             for i in range(40)]  # 1 ms a token per 1k tokens of context, listed longest first
    turns += [dict(prompt_tokens=1, seconds=5.0, ttft_s=None, new_tokens=10),
              dict(prompt_tokens=2, seconds=5.0, ttft_s=0.1, new_tokens=1)]
    short, long = ab_report.decode_ms(turns)
    assert short == pytest.approx(2.5) and long == pytest.approx(38.5)  # (1..4k) and (37..40k)
    assert all(math.isnan(x) for x in ab_report.decode_ms(turns[40:]))
    for i, t in enumerate(turns):
        t.update(session=0, turn=i, cached_tokens=0, ideal_cached=0)
    s = ab_report.summarise_build([dict(build="A", turns=turns, stats_before={}, stats_after={})], slow_s=10.0)
    text = ab_report.table([dict(label="A", options=[])], {"A": s}, 10.0)
    assert "decode ms/token, short / long ctx" in text and "2.5 / 38.5" in text


def test_summary_reads_the_engines_host_and_gpu_wait_seconds():
    """Over the measured turns: the engine's host work and its waits for the GPU (deltas of the
    server's counters), one row of the table; and of the host work, enqueueing prefill chunks."""
    before = dict(engine_host_s=10.0, engine_gpu_wait_s=4.0, engine_prefill_launch_s=1.0)
    runs = [_run("A", [1.0], before, dict(engine_host_s=13.5, engine_gpu_wait_s=24.0, engine_prefill_launch_s=1.75))]
    s = ab_report.summarise_build(runs, slow_s=10.0)
    assert s["engine_host_s"] == pytest.approx(3.5) and s["engine_gpu_wait_s"] == pytest.approx(20.0)
    assert s["engine_prefill_launch_s"] == pytest.approx(0.75)
    text = ab_report.table([dict(label="A", options=[])], {"A": s}, 10.0)
    assert "engine s: host / waiting for the GPU" in text and "3.5 / 20.0" in text
    assert "engine s enqueueing prefill chunks" in text and "0.75" in text


def test_summary_without_offload_or_host_tier_says_so():
    s = ab_report.summarise_build([_run("B", [0.5], {}, {})], slow_s=10.0)
    assert s["expert_hit_rate"] is None and s["kv_host_pages_restored"] is None
    assert math.isnan(s["cached_ratio"])  # one turn: nothing to have cached
    text = ab_report.table([dict(label="B", options=[])], {"B": s}, 10.0)
    assert "(defaults)" in text and text.splitlines()[-1].split()[-1] == "-"


def test_with_http_a_build_serves_the_openai_api_on_a_free_port_and_waits_for_it(tmp_path):
    """--http: the server takes --http-port 0 (not --no-http), and the run waits for its http endpoint
    line, after the frontend's; a server that prints both (a stand-in here) gives both."""
    from scripts.agent_ab import Build, start_server, stop_server

    build = Build("A", Path("/checkout"), ("--device", "cpu"))
    assert "--no-http" in build.command((), tmp_path / "pid") and "--http-port" not in build.command((), tmp_path / "p")
    assert build.command((), tmp_path / "pid", http=True)[5:7] == ["--http-port", "0"]
    lines = "frontend endpoint tcp://127.0.0.1:5999", "scheduler pid 1", "http endpoint http://127.0.0.1:8999"
    script = "".join(f"print({line!r}, flush=True)\n" for line in lines) + "import time\ntime.sleep(60)\n"
    for http, want in ((False, None), (True, "http://127.0.0.1:8999")):
        server = start_server([sys.executable, "-c", script], tmp_path / "log", 60, http=http)
        assert (server.endpoint, server.http) == ("tcp://127.0.0.1:5999", want)
        stop_server(server)


def test_an_http_turn_is_timed_to_its_first_reasoning_or_text():
    """agent_sessions' HTTP turn: the opening role chunk starts no clock, a reasoning chunk (gpt-oss
    reasons first) does; the reply is the content; the counts are the usage's."""
    import asyncio
    import time

    from openai.types.chat import ChatCompletionChunk

    from scripts.agent_sessions import HttpTurns

    def chunk(delta=None, usage=None):
        choices = [] if delta is None else [{"index": 0, "delta": delta}]
        return ChatCompletionChunk.model_validate({"id": "c", "object": "chat.completion.chunk", "created": 0,
                                                   "model": "m", "choices": choices, "usage": usage})

    usage = {"prompt_tokens": 30, "completion_tokens": 3, "total_tokens": 33,
             "prompt_tokens_details": {"cached_tokens": 16}}
    script = [(0.0, chunk({"role": "assistant", "content": ""})), (0.2, chunk({"reasoning_content": "hm"})),
              (0.2, chunk({"content": "Hi"})), (0.0, chunk(usage=usage))]

    class Completions:
        async def create(self, **kw):
            assert kw["stream"] and kw["extra_body"] == {"ignore_eos": True} and kw["messages"] == ["m"]

            async def chunks():
                for pause, c in script:
                    await asyncio.sleep(pause)
                    yield c
            return chunks()

    client = type("Client", (), {"chat": type("Chat", (), {"completions": Completions()})()})()
    started = time.perf_counter()
    row, ids, text = asyncio.run(HttpTurns(client, "m").turn({"messages": ["m"]}, 3))
    assert 0.15 < row["ttft_s"] < 0.35 < row["seconds"] <= time.perf_counter() - started
    assert (row["prompt_tokens"], row["cached_tokens"], row["new_tokens"], ids, text) == (30, 16, 3, [], "Hi")
