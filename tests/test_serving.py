"""The whole serving path on CPU: frontend process, real scheduler process, real sockets, a tiny
model with a byte-level tokenizer. The scheduler runs with --check-pages, so any KV page leak or
double ownership crashes it and fails every later test."""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import NamedTuple

import msgspec
import pytest
import zmq

from frontend.api import replies
from frontend.client import Client, ServerError
from tests.fake_scheduler import EOS_ID, SPECIALS, write_byte_tokenizer
from tests.tiny_models import write_tiny

REPO = Path(__file__).resolve().parents[1]
WAIT_S = 120.0  # an upper bound on waits, never a measured duration
PAGE = 4
PROMPTS = [f"request {i}: " + "abcdefghij"[: i % 10] * (1 + i % 4) for i in range(16)]


class Server(NamedTuple):
    proc: subprocess.Popen
    endpoint: str
    scheduler_pid: int
    log: Path


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("tiny-served")
    write_tiny(path, "mixtral", seed=11, layers=2, vocab=256 + len(SPECIALS), hidden=64, experts=8, top_k=2)
    write_byte_tokenizer(path)
    import json
    cfg = json.loads((path / "config.json").read_text())
    cfg["eos_token_id"] = EOS_ID
    (path / "config.json").write_text(json.dumps(cfg))
    return path


def start(tmp: Path, model_dir: Path, *extra: str) -> Server:
    log = tmp / "server.log"
    proc = subprocess.Popen([sys.executable, "-m", "frontend", "--endpoint", "tcp://127.0.0.1:*", "--http-port", "0",
                             "--pid-file", str(tmp / "pid"), "--ready-timeout", str(WAIT_S),
                             "--model", str(model_dir), "--device", "cpu", "--page-size", str(PAGE),
                             "--kv-tokens", "4096", "--check-pages", *extra],
                            cwd=REPO, stdout=subprocess.PIPE, stderr=log.open("w"), text=True)
    first, second = proc.stdout.readline(), proc.stdout.readline()
    assert first.startswith("frontend endpoint "), log.read_text()
    return Server(proc, first.split()[-1], int(second.split()[-1]), log)


def stop(server: Server) -> int:
    if server.proc.poll() is None:
        server.proc.send_signal(signal.SIGTERM)
    return server.proc.wait(timeout=WAIT_S)


@pytest.fixture(scope="module")
def server(tmp_path_factory, model_dir):
    s = start(tmp_path_factory.mktemp("srv"), model_dir)
    yield s
    assert stop(s) == 0, s.log.read_text()[-3000:]


def greedy(client: Client, prompt: str, **kw):
    return client.generate(prompt=prompt, max_tokens=kw.pop("max_tokens", 12), temperature=0, **kw)


def assert_pages_settled(client: Client):
    """Nothing running: every page is free or in the prefix cache."""
    deadline = time.monotonic() + WAIT_S
    while True:
        s = client.stats()
        if s["requests_running"] == 0 and s["requests_waiting"] == 0:
            break
        assert time.monotonic() < deadline, s
        time.sleep(0.05)
    assert s["kv_pages_free"] + s["kv_pages_cached"] == s["kv_pages_total"], s


def test_concurrent_clients_get_the_sequential_completions(server):
    with Client(server.endpoint, timeout=WAIT_S) as c:
        alone = [greedy(c, p) for p in PROMPTS]
    together: list = [None] * len(PROMPTS)

    def ask(i):
        with Client(server.endpoint, timeout=WAIT_S) as c:
            together[i] = greedy(c, PROMPTS[i])

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(PROMPTS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(WAIT_S)
    assert [r.token_ids for r in together] == [r.token_ids for r in alone]
    assert [r.text for r in together] == [r.text for r in alone]
    with Client(server.endpoint, timeout=WAIT_S) as c:
        assert_pages_settled(c)


def test_second_turn_reuses_the_first(server, model_dir, tmp_path):
    turn1 = [{"role": "user", "content": "tell me about sluices and locks on rivers"}]
    with Client(server.endpoint, timeout=WAIT_S) as c:
        first = c.generate(messages=turn1, max_tokens=10, temperature=0)
        turn2 = turn1 + [{"role": "assistant", "content": first.text}, {"role": "user", "content": "and canals?"}]
        second = c.generate(messages=turn2, max_tokens=10, temperature=0)
    assert second.usage.cached_prompt_tokens >= first.usage.prompt_tokens - PAGE
    fresh_server = start(tmp_path, model_dir, "--no-prefix-cache")
    try:
        with Client(fresh_server.endpoint, timeout=WAIT_S) as c:
            fresh = c.generate(messages=turn2, max_tokens=10, temperature=0)
    finally:
        assert stop(fresh_server) == 0
    assert fresh.usage.cached_prompt_tokens == 0
    assert fresh.token_ids == second.token_ids


def test_finish_reasons_and_usage(server):
    with Client(server.endpoint, timeout=WAIT_S) as c:
        done = greedy(c, "count: 1 2 3", max_tokens=7, ignore_eos=True)
        assert done.finish_reason == "length" and len(done.token_ids) == 7
        assert done.usage.completion_tokens == 7 and done.usage.prompt_tokens == len("count: 1 2 3")
        stop_at = done.text[3:5]  # a stop string the model will produce
        stopped = greedy(c, "count: 1 2 3", max_tokens=7, ignore_eos=True, stop=[stop_at])
        assert stopped.finish_reason == "stop" and stopped.text == done.text[:done.text.index(stop_at)]
        assert_pages_settled(c)


def test_abort_and_disconnect_free_every_page(server):
    with Client(server.endpoint, timeout=WAIT_S) as c:
        before = c.stats()
        stream = c.stream(prompt="a long story " * 5, max_tokens=400, temperature=0, ignore_eos=True)
        chunks = [next(iter(stream)) for _ in range(2)]
        assert all(ch.finish_reason is None for ch in chunks)
        stream.close()  # abort
        gone = Client(server.endpoint, timeout=WAIT_S)
        vanishing = gone.stream(prompt="another long story " * 5, max_tokens=400, temperature=0, ignore_eos=True)
        # Its first chunk: the request runs in the scheduler with nearly all its tokens to come. (Leaving
        # after a fixed sleep instead left it most of the way done, a run of 400 tokens taking 0.7 s
        # here: any delay of a few tenths of a second under load let it finish first.)
        assert next(vanishing).finish_reason is None
        gone.close()  # disconnect without a word: noticed when the frontend next sends to it
        assert_pages_settled(c)
        after = c.stats()
        assert after["requests_aborted"] - before["requests_aborted"] == 2  # both, in the scheduler
        assert after["generated_tokens"] - before["generated_tokens"] < 400


def _gen(**fields) -> bytes:
    return msgspec.msgpack.encode({"type": "generate", "v": 1, "rid": "bad", **fields})


@pytest.mark.parametrize("frame, match", [
    (b"\x93\x01\xff\x00garbage", "client->frontend"),
    (_gen(prompt="x", temperature="hot"), "temperature"),
    (msgspec.msgpack.encode({"type": "teleport", "v": 1, "rid": "bad"}), "unknown"),
    (_gen(prompt=""), "prompt is empty"),
    (_gen(prompt="x" * 600), "512 tokens"),
    (_gen(prompt="x", temperature=-1.0), "temperature"),
    (_gen(prompt="x", max_tokens=0), "max_tokens"),
    (_gen(input_ids=[10 ** 6]), "vocabulary"),
    (_gen(prompt="x", max_tokens=2**63 - 1), "context of 512 tokens"),  # stress.py's no reply: ran the whole context
])
def test_bad_input_gets_an_error_and_serving_goes_on(server, frame, match):
    with zmq.Context() as ctx, ctx.socket(zmq.DEALER) as sock:
        sock.connect(server.endpoint)
        sock.send(frame)
        assert sock.poll(int(WAIT_S * 1000)), "no reply"
        reply = replies.decode(sock.recv())
        assert isinstance(reply, replies.Error) and match in reply.message, reply
        sock.close(linger=0)
    with Client(server.endpoint, timeout=WAIT_S) as c:
        assert greedy(c, "still here?").finish_reason in ("length", "stop")


@pytest.mark.skipif(shutil.which("py-spy") is None, reason="py-spy not installed")
def test_py_spy_sees_the_scheduler_loop(server):
    out = subprocess.run(["py-spy", "dump", "--pid", str(server.scheduler_pid)], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    assert "serve_forever" in out.stdout


def test_the_scheduler_threads_wait_passively(server):
    """torch's CPU threads in the served scheduler sleep while they wait for work (OMP_WAIT_POLICY,
    read by OpenMP when torch loads), so they do not spin against other processes on the cores."""
    environ = Path(f"/proc/{server.scheduler_pid}/environ").read_bytes().split(b"\0")
    assert (f"OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY', 'PASSIVE')}").encode() in environ


def test_killed_scheduler_fails_waiting_clients_and_frontend_exits_nonzero(model_dir, tmp_path):
    s = start(tmp_path, model_dir)
    with Client(s.endpoint, timeout=WAIT_S) as c:
        stream = c.stream(prompt="wait for me " * 4, max_tokens=400, temperature=0, ignore_eos=True)
        next(iter(stream))
        os.kill(s.scheduler_pid, signal.SIGKILL)
        with pytest.raises(ServerError, match="scheduler"):
            for _ in stream:
                pass
    assert s.proc.wait(timeout=WAIT_S) != 0


def test_agent_sessions_serve_each_turns_history_from_the_cache(server, monkeypatch, capsys, tmp_path):
    """scripts/agent_sessions.py, small: concurrent multi-turn sessions; every later turn finds all
    earlier turns' tokens cached but for the page-rounded tail."""
    import asyncio

    from scripts.agent_sessions import Workload, main, run_sessions, summarise

    workload = Workload(sessions=3, turns=3, context=41, tool_tokens=9, max_tokens=6, id_range=200)
    rows = asyncio.run(run_sessions(server.endpoint, workload, WAIT_S))
    assert len(rows) == 9 and all(r["new_tokens"] == 6 for r in rows)
    for r in rows:
        if r["turn"]:
            assert r["ideal_cached"] - 2 * PAGE < r["cached_tokens"] <= r["ideal_cached"], r
    assert summarise(rows)["cached_ratio"] > 0.8
    monkeypatch.setattr("sys.argv", ["agent_sessions.py", "--endpoint", server.endpoint, "--sessions", "2", "--turns",
                                     "2", "--context", "20", "--tool-tokens", "4", "--max-tokens", "3", "--id-range",
                                     "200", "--json", str(tmp_path / "agents.json")])
    main()
    assert "cached / ideal" in capsys.readouterr().out and (tmp_path / "agents.json").exists()


def test_text_agent_sessions_render_and_tokenize_on_the_server(server):
    """agent_sessions --text: chat messages of source text; the server renders and tokenizes each
    turn's whole history, finds the earlier turns in its prefix cache, and takes their pieces from
    the frontend's kept ones (frontend/prompt_pieces.py)."""
    import asyncio

    from scripts.agent_sessions import Workload, run_sessions, server_stats

    before = asyncio.run(server_stats(server.endpoint, WAIT_S))["frontend_prompt_tokens_reused"]
    workload = Workload(sessions=2, turns=3, context=80, tool_tokens=10, max_tokens=4, text=True)  # 512-token context
    rows = asyncio.run(run_sessions(server.endpoint, workload, WAIT_S))
    assert len(rows) == 6 and all(r["new_tokens"] == 4 for r in rows)
    for r in rows:
        if r["turn"]:
            # the task's 280 characters (byte tokens) and more are cached; at most the ideal
            assert 280 - PAGE < r["cached_tokens"] <= r["ideal_cached"] < r["prompt_tokens"], r
    reused = asyncio.run(server_stats(server.endpoint, WAIT_S))["frontend_prompt_tokens_reused"] - before
    assert reused >= 2 * 2 * 280  # each session's task, in each of its two later turns
