"""The frontend process end to end on CPU over real ZMQ sockets, with tests/fake_scheduler.py as
the scheduler and its byte-level tokenizer (token id = byte value, EOS 256). Its parts are tested
in test_frontend_units.py; the real scheduler behind it in test_serving.py."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import NamedTuple

import msgspec
import pytest
import zmq

sys.path.insert(0, str(Path(__file__).parent))
from fake_scheduler import EOS_ID, write_byte_tokenizer  # noqa: E402

from frontend.api import replies, requests  # noqa: E402
from frontend.client import AsyncClient, Client, NoServer, ServerError  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
FAKE = f"{sys.executable} {REPO / 'tests' / 'fake_scheduler.py'}"
CONTEXT = 256
HANG, REJECT = 1, 2  # first prompt byte: the fake hangs after one token / rejects the request
WAIT_S = 30.0  # upper bound on any wait, never a measured duration


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory) -> Path:
    return write_byte_tokenizer(tmp_path_factory.mktemp("tok"))




# ==== the frontend process with the fake scheduler ====


class Server(NamedTuple):
    proc: subprocess.Popen
    endpoint: str
    scheduler_pid: int
    pid_file: Path
    stderr: Path


def frontend_command(*args: str) -> list[str]:
    """The command line of a frontend process on any free port, with the fake scheduler, and ``args``."""
    return [sys.executable, "-m", "frontend", "--endpoint", "tcp://127.0.0.1:*", "--http-port", "0",
            "--scheduler-cmd", FAKE, *args]


def start_server(tmp: Path, tok_dir: Path, *args: str) -> Server:
    pid_file, stderr = tmp / "scheduler.pid", tmp / "frontend.stderr"
    proc = subprocess.Popen(
        frontend_command("--pid-file", str(pid_file), "--ready-timeout", str(WAIT_S), "--tokenizer-path",
                         str(tok_dir), *args),
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=stderr.open("w"),
        text=True,
    )
    first, second = proc.stdout.readline(), proc.stdout.readline()  # bounded by --ready-timeout
    assert first.startswith("frontend endpoint "), stderr.read_text()
    return Server(proc, first.split()[-1], int(second.split()[-1]), pid_file, stderr)


def stop_server(server: Server) -> int:
    if server.proc.poll() is None:
        server.proc.send_signal(signal.SIGTERM)
    return server.proc.wait(timeout=WAIT_S)


@pytest.fixture(scope="module")
def server(tmp_path_factory, tok_dir):
    s = start_server(
        tmp_path_factory.mktemp("server"),
        tok_dir,
        "--max-context",
        str(CONTEXT),
        "--hang-id",
        str(HANG),
        "--reject-id",
        str(REJECT),
        "--model",
        "/no/such/model",
    )
    yield s
    assert stop_server(s) == 0


@pytest.fixture
def client(server):
    with Client(server.endpoint, timeout=WAIT_S) as c:
        yield c


def test_startup_prints_endpoint_and_writes_pid_file(server, client):
    assert int(server.pid_file.read_text()) == server.scheduler_pid
    stats = client.stats()
    assert stats["scheduler_pid"] == server.scheduler_pid
    assert stats["engine_args"] == "--model /no/such/model"  # unknown options reach the scheduler


def test_non_streaming(client):
    c = client.generate(prompt="héllo wörld", max_tokens=50)
    want = list("héllo wörld".encode())
    assert (c.text, c.token_ids, c.finish_reason) == ("héllo wörld", want + [EOS_ID], "stop")
    assert c.usage == replies.Usage(
        prompt_tokens=len(want), completion_tokens=len(want) + 1, cached_prompt_tokens=2
    )


def test_streaming_holds_back_split_characters(client):
    text = "a€b😀ö"
    chunks = list(client.stream(prompt=text, max_tokens=50))
    assert len(chunks) == len(text.encode()) + 1  # a chunk per scheduler update
    assert "".join(c.text for c in chunks) == text
    assert not any("\ufffd" in c.text for c in chunks)
    assert [c.token_ids for c in chunks[:3]] == [[0x61], [0xE2], [0x82]] and chunks[1].text == ""
    assert [c.finish_reason for c in chunks] == [None] * (len(chunks) - 1) + ["stop"]
    assert chunks[-1].usage.completion_tokens == len(chunks)


def test_length_and_clamping_to_the_context(client):
    c = client.generate(prompt="abcdef", max_tokens=3)
    assert (c.text, c.finish_reason, c.usage.completion_tokens) == ("abc", "length", 3)
    c = client.generate(prompt="x" * (CONTEXT - 4), max_tokens=100)  # 4 tokens of room
    assert (c.text, c.finish_reason) == ("xxxx", "length")
    assert client.stats()["last_max_tokens"] == 4
    c = client.generate(prompt="ab", max_tokens=5, ignore_eos=True)
    assert (c.text, c.token_ids, c.finish_reason) == ("ababa", [97, 98, 97, 98, 97], "length")


@pytest.mark.parametrize("stream", [False, True])
def test_stop_strings_truncate_and_free_the_request(client, stream):
    aborts = client.stats()["aborts_total"]
    params = dict(prompt="one STOP two", stop=["STOP", "zzz"], max_tokens=50)
    chunks = list(client.stream(**params)) if stream else None
    c = client.generate(**params) if not stream else None
    text = "".join(ch.text for ch in chunks) if stream else c.text
    reason = chunks[-1].finish_reason if stream else c.finish_reason
    assert (text, reason) == ("one ", "stop")
    stats = client.stats()
    assert stats["aborts_total"] == aborts + 1 and stats["running"] == 0
    assert client.generate(prompt="abcabd", stop=["abd"]).text == "abc"


def test_chat_and_input_ids(client):
    c = client.generate(messages=[{"role": "user", "content": "hi"}], max_tokens=60)
    assert c.text == "user\nhi\nassistant\n" and c.usage.prompt_tokens == 21
    assert client.generate(input_ids=[104, 105]).text == "hi"
    with pytest.raises(ServerError, match="unknown role robot") as info:
        client.generate(messages=[{"role": "robot", "content": "x"}])
    assert info.value.code == replies.BAD_REQUEST


def test_client_abort_ends_with_an_abort_chunk(client):
    aborts = client.stats()["aborts_total"]
    with client.stream(prompt="\x01 hangs", max_tokens=50) as stream:
        first = next(stream)
        client.abort(stream.rid)
        rest = list(stream)
    assert first.token_ids == [HANG] and [c.finish_reason for c in rest] == ["abort"]
    assert rest[-1].usage.completion_tokens == 1
    assert client.stats()["aborts_total"] == aborts + 1


def test_scheduler_request_error_reaches_the_client(client):
    with pytest.raises(ServerError, match="fake scheduler rejects") as info:
        client.generate(prompt="\x02")
    assert info.value.code == replies.SCHEDULER_ERROR


def _ask(sock: zmq.Socket, frame: bytes) -> replies.ServerReply:
    """The reply to ``frame``, skipping keep-alives (Pending) as every client does."""
    sock.send(frame)
    while True:
        assert sock.poll(int(WAIT_S * 1000)), "no reply"
        reply = replies.decode(sock.recv())
        if not isinstance(reply, replies.Pending):
            return reply


def _gen(**fields) -> bytes:
    return msgspec.msgpack.encode({"type": "generate", "v": 1, "rid": "bad", **fields})


@pytest.mark.parametrize(
    "frame,code,match",
    [
        (os.urandom(37), "bad_request", "client->frontend"),
        (b"\xc1\xc1", "bad_request", "malformed"),
        (_gen(prompt="x", temperature="hot"), "bad_request", "temperature"),
        (_gen(prompt=["x"]), "bad_request", "prompt"),
        (
            msgspec.msgpack.encode({"type": "teleport", "v": 1, "rid": "bad"}),
            "bad_request",
            "unknown",
        ),
        (_gen(prompt=""), "bad_request", "prompt is empty"),
        (_gen(prompt="x" * CONTEXT), "context_length", f"{CONTEXT} tokens"),
        (_gen(prompt="x", temperature=-1.0), "bad_request", "temperature"),
        (_gen(prompt="x", max_tokens=0), "bad_request", "max_tokens"),
        (_gen(prompt="x", top_p=0.0), "bad_request", "top_p"),
        (_gen(prompt="x", top_k=-3), "bad_request", "top_k"),
        (_gen(input_ids=[999]), "bad_request", "vocabulary"),
        (_gen(prompt="x", v=9), "bad_request", "version 9"),
        (b"\x91" * 200_000 + b"\x00", "bad_request", "client->frontend"),  # nested 200,000 deep
        (_gen(prompt="x", v="1"), "bad_request", "must be an integer"),
        (_gen(prompt="x", top_k=2**63), "bad_request", "top_k"),
        (_gen(prompt="x", max_tokens=2**64 - 1), "bad_request", "max_tokens"),
        (_gen(prompt="x", seed=2**63), "bad_request", "seed"),
        (_gen(prompt="x", temperature=float("inf")), "bad_request", "temperature"),
        (_gen(prompt="x", stop=["s"] * 100), "bad_request", "stop strings"),
    ],
)
def test_bad_input_gets_an_error_and_the_server_keeps_serving(server, frame, code, match):
    with zmq.Context() as ctx, ctx.socket(zmq.DEALER) as sock:
        sock.connect(server.endpoint)
        reply = _ask(sock, frame)
        assert isinstance(reply, replies.Error) and reply.code == code and match in reply.message
        ok = _ask(sock, requests.encode(requests.Generate(rid="ok", prompt="fine", max_tokens=10)))
        assert isinstance(ok, replies.Chunk) and (ok.text, ok.finish_reason) == ("fine", "stop")
        sock.close(linger=0)


def test_multi_frame_messages_are_refused_and_run_nothing(server, client):
    before = client.stats()["requests_total"]
    with zmq.Context() as ctx, ctx.socket(zmq.DEALER) as sock:
        sock.connect(server.endpoint)
        generate = requests.encode(requests.Generate(rid="two", prompt="x", max_tokens=5))
        for frames in ([b"lead", generate], [generate, generate]):
            sock.send_multipart(frames)
            assert sock.poll(int(WAIT_S * 1000)), "no reply"
            reply = sock.recv_multipart()
            assert len(reply) == 1  # nothing of the sender's frames echoed back
            error = replies.decode(reply[0])
            assert isinstance(error, replies.Error) and error.code == replies.BAD_REQUEST
            assert "one frame; got 2" in error.message
        sock.close(linger=0)
    assert client.stats()["requests_total"] == before


def test_an_abort_while_the_prompt_is_tokenized_ends_the_request_there(server, client):
    requests_before = client.stats()["requests_total"]
    with zmq.Context() as ctx, ctx.socket(zmq.DEALER) as sock:
        sock.connect(server.endpoint)
        sock.send(requests.encode(requests.Generate(rid="long", prompt="y" * 990_000)))  # ~0.3 s to tokenize
        reply = _ask(sock, requests.encode(requests.Abort(rid="long")))
        assert isinstance(reply, replies.Chunk) and reply.finish_reason == "abort", reply
        assert reply.usage.prompt_tokens == 0  # it never reached the scheduler
        assert not sock.poll(500)  # and nothing follows: no context_length error once tokenized
        sock.close(linger=0)
    stats = client.stats()
    assert stats["requests_total"] == requests_before and stats["frontend_tokenizing"] == 0


def test_a_frame_over_the_size_limit_drops_its_sender_only(tmp_path, tok_dir):
    server = start_server(tmp_path, tok_dir, "--max-message-mb", "1")
    try:
        with zmq.Context() as ctx, ctx.socket(zmq.DEALER) as sock:
            sock.connect(server.endpoint)
            sock.send(requests.encode(requests.Generate(rid="big", prompt="z" * 2_000_000)))
            assert not sock.poll(1000)  # ZMQ drops the connection; nothing is read or answered
            sock.close(linger=0)
        with Client(server.endpoint, timeout=WAIT_S) as c:
            assert c.generate(prompt="fine", max_tokens=10).text == "fine"
            assert c.stats()["frontend_requests_total"] == 1
    finally:
        assert stop_server(server) == 0


def test_a_second_server_on_a_busy_endpoint_says_so_in_one_line(server):
    proc = subprocess.run(
        [sys.executable, "-m", "frontend", "--endpoint", server.endpoint, "--scheduler-cmd", FAKE, "--no-http"],
        cwd=REPO, capture_output=True, text=True, timeout=WAIT_S,
    )
    errors = [line for line in proc.stderr.splitlines() if "error" in line.lower()]
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert errors == [f"error: cannot listen on {server.endpoint}: Address already in use (another server is "
                      "running there? pick another --endpoint)"], proc.stderr


def test_client_says_at_once_that_no_server_answers():
    started = time.monotonic()
    with Client("tcp://127.0.0.1:9", timeout=WAIT_S, first_contact=0.3) as c:
        with pytest.raises(NoServer, match="no Sluice server answers at tcp://127.0.0.1:9"):
            c.generate(prompt="x")
    assert time.monotonic() - started < WAIT_S / 2


def test_info_answers_with_the_model_and_its_defaults(client):
    info = client.info()
    assert (info.model, info.max_context_tokens, info.chat_template) == ("fake", CONTEXT, True)
    assert info.default_temperature == 0.0  # no generation_config.json: greedy, as transformers


def test_duplicate_request_id(server):
    with zmq.Context() as ctx, ctx.socket(zmq.DEALER) as sock:
        sock.connect(server.endpoint)
        hang = requests.encode(requests.Generate(rid="dup", prompt="\x01", stream=True))
        assert _ask(sock, hang).token_ids == [HANG]
        reply = _ask(sock, hang)
        assert isinstance(reply, replies.Error) and (reply.rid, reply.code) == (
            "dup",
            replies.DUPLICATE_RID,
        )
        assert _ask(sock, requests.encode(requests.Abort(rid="dup"))).finish_reason == "abort"
        sock.close(linger=0)


def test_vanished_client_gets_its_requests_aborted(server, client):
    before = client.stats()
    other = Client(server.endpoint, timeout=WAIT_S)
    # long enough (1 s of the fake's steps, within its 256-token context) that it still runs when a chunk
    # finds no peer on a loaded machine (60 tokens once finished first on a busy 2-core CI run)
    stream = other.stream(prompt="long " * 10, max_tokens=200, ignore_eos=True)
    next(stream)
    other.close()  # gone without an Abort: the next chunk's send finds no peer
    deadline = time.monotonic() + WAIT_S
    while (stats := client.stats())["frontend_client_disconnects_total"] == before[
        "frontend_client_disconnects_total"
    ]:
        assert time.monotonic() < deadline, stats
        time.sleep(0.05)
    assert (
        stats["aborts_total"] == before["aborts_total"] + 1
        and stats["frontend_active_requests"] == 0
    )


def test_vanished_client_of_a_non_streaming_request_is_noticed(tmp_path, tok_dir):
    """No chunk is due to a client waiting for a whole completion: the keep-alive finds it gone."""
    server = start_server(tmp_path, tok_dir, "--hang-id", str(HANG), "--client-keepalive", "0.2")
    try:
        with Client(server.endpoint, timeout=WAIT_S) as watcher:
            with zmq.Context() as ctx, ctx.socket(zmq.DEALER) as sock:
                sock.connect(server.endpoint)
                sock.send(requests.encode(requests.Generate(rid="gone", prompt="\x01", max_tokens=10)))
                assert sock.poll(2000)  # the keep-alive of the live request
                assert isinstance(replies.decode(sock.recv()), replies.Pending)
                sock.close(linger=0)  # gone without an Abort
            deadline = time.monotonic() + WAIT_S
            while (stats := watcher.stats())["aborts_total"] == 0:
                assert time.monotonic() < deadline, stats
                time.sleep(0.05)
            assert stats["frontend_client_disconnects_total"] == 1 and stats["frontend_active_requests"] == 0
            assert watcher.generate(prompt="still here", max_tokens=20).text == "still here"
    finally:
        assert stop_server(server) == 0


# A client that streams a request that hangs, says so, then reads nothing (its ZMQ I/O thread still
# answers pings) until the test ends it.
IDLE_CLIENT = """
import sys
from frontend.client import Client
stream = Client(sys.argv[1], timeout=30).stream(prompt="\\x01", max_tokens=10)
next(stream)
print("running", flush=True)
sys.stdin.read()
"""


def test_frozen_client_is_dropped_once_its_pings_go_unanswered(tmp_path, tok_dir):
    """A stopped client keeps its connection open and its kernel takes every keep-alive: only the
    ZMTP heartbeat finds it. A live client that reads nothing for longer is kept."""
    timeout_s = 1.5
    server = start_server(tmp_path, tok_dir, "--hang-id", str(HANG), "--client-keepalive", "0.1",
                          "--client-heartbeat-timeout", str(timeout_s))
    idle = subprocess.Popen([sys.executable, "-c", IDLE_CLIENT, server.endpoint], cwd=REPO,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert idle.stdout.readline() == "running\n"
        with Client(server.endpoint, timeout=WAIT_S) as watcher:
            time.sleep(2 * timeout_s)
            assert watcher.stats()["aborts_total"] == 0  # idle, not frozen
            os.kill(idle.pid, signal.SIGSTOP)
            deadline = time.monotonic() + WAIT_S
            while (stats := watcher.stats())["aborts_total"] == 0:
                assert time.monotonic() < deadline, stats
                time.sleep(0.05)
            assert stats["frontend_client_disconnects_total"] == 1 and stats["frontend_active_requests"] == 0
    finally:
        idle.kill()
        idle.wait()
        assert stop_server(server) == 0


def test_async_client_runs_requests_concurrently(server):
    async def main():
        async with AsyncClient(server.endpoint, timeout=WAIT_S) as c:
            prompts = [f"p{i} " * (i + 1) for i in range(6)]
            done = await asyncio.gather(*(c.generate(prompt=p, max_tokens=60) for p in prompts))
            streamed = [ch async for ch in c.stream(prompt="åß", max_tokens=9)]
            with pytest.raises(ServerError):
                await c.generate(prompt="\x02")
            return prompts, done, streamed, await c.stats()

    prompts, done, streamed, stats = asyncio.run(main())
    assert [c.text for c in done] == prompts
    assert "".join(c.text for c in streamed) == "åß" and streamed[-1].finish_reason == "stop"
    assert stats["frontend_active_requests"] == 0


def test_client_times_out_without_a_server():
    with Client("tcp://127.0.0.1:9", timeout=0.2) as c, pytest.raises(TimeoutError):
        c.generate(prompt="x")


def test_cli_prompt_and_chat_keep_history(server):
    run = lambda *a, **kw: subprocess.run(  # noqa: E731
        [
            sys.executable,
            "-m",
            "frontend.client",
            "--endpoint",
            server.endpoint,
            "--timeout",
            str(WAIT_S),
            *a,
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=WAIT_S * 2,
        **kw,
    )
    out = run("--prompt", "hi there", "--max-tokens", "20", "--raw")
    assert (out.returncode, out.stdout) == (0, "hi there\n")
    out = run("--prompt", "hi there", "--max-tokens", "60")  # the model has a chat template
    assert (out.returncode, out.stdout) == (0, "user\nhi there\nassistant\n\n")
    out = run("--chat", input="yo\nhey\n")
    assert out.returncode == 0, out.stderr
    # The fake echoes the rendered conversation, so the second reply contains the first turn.
    assert "user\nyo\nassistant\nuser\nyo\nassistant\n\nuser\nhey\nassistant\n" in out.stdout


# ==== failures of the scheduler, shutdown ====


def _hang_one(server: Server) -> tuple[Client, object]:
    client = Client(server.endpoint, timeout=WAIT_S)
    stream = client.stream(prompt="\x01", max_tokens=10)
    assert next(stream).token_ids == [HANG]
    return client, stream


def test_scheduler_killed_fails_waiting_clients_and_exits_nonzero(tmp_path, tok_dir):
    server = start_server(tmp_path, tok_dir, "--hang-id", str(HANG))
    client, stream = _hang_one(server)
    os.kill(server.scheduler_pid, signal.SIGKILL)
    with pytest.raises(ServerError, match="exited with code -9") as info:
        next(stream)
    assert info.value.code == replies.SCHEDULER_DIED
    client.close()
    assert server.proc.wait(timeout=WAIT_S) == 1


def test_silent_scheduler_is_killed_after_the_heartbeat_timeout(tmp_path, tok_dir):
    server = start_server(tmp_path, tok_dir, "--hang-id", str(HANG), "--heartbeat-timeout", "1")
    client, stream = _hang_one(server)
    os.kill(server.scheduler_pid, signal.SIGSTOP)
    try:
        with pytest.raises(ServerError, match="sent nothing"):
            next(stream)
        assert server.proc.wait(timeout=WAIT_S) == 1
    finally:
        client.close()
        if server.proc.poll() is None:
            os.kill(server.scheduler_pid, signal.SIGCONT)
            stop_server(server)


def test_sigterm_shuts_down_cleanly(tmp_path, tok_dir):
    server = start_server(tmp_path, tok_dir, "--hang-id", str(HANG))
    client, stream = _hang_one(server)
    server.proc.send_signal(signal.SIGTERM)
    with pytest.raises(ServerError) as info:
        next(stream)
    assert info.value.code == replies.SHUTTING_DOWN
    client.close()
    assert server.proc.wait(timeout=WAIT_S) == 0
    assert not server.pid_file.exists()
    with pytest.raises(ProcessLookupError):  # the frontend reaped its scheduler
        os.kill(server.scheduler_pid, 0)


def test_scheduler_failing_to_start_is_reported(tmp_path, tok_dir):
    proc = subprocess.run(
        frontend_command("--tokenizer-path", str(tok_dir), "--fail-start"),
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=WAIT_S * 2,
    )
    assert proc.returncode == 1
    assert (
        "exited with code 3 before it was ready" in proc.stderr
        and "failing on purpose" in proc.stderr
    )
