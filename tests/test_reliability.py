"""One bad request never takes the server down, a busy scheduler is never killed, and a dead
frontend leaves nothing behind: the real scheduler process on a tiny model (as test_serving.py,
with --check-pages, so a leaked page crashes it), with test fault hooks ($SLUICE_FAULTS)."""
from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import msgspec
import pytest
import zmq

from frontend.api import replies
from frontend.client import Client, ServerError
from scheduler.faults import FAULTS_ENV
from tests.test_serving import WAIT_S, assert_pages_settled, model_dir, start, stop  # noqa: F401 (fixture)

RAISE, SLEEP, CUDA = 5, 6, 7  # first prompt bytes that make a step raise / run long / poison the device
SLEEP_S, HEARTBEAT_TIMEOUT_S = 5.0, 2.0


@pytest.fixture(scope="module")
def server(tmp_path_factory, model_dir):  # noqa: F811
    os.environ[FAULTS_ENV] = f"raise:{RAISE},sleep:{SLEEP}:{SLEEP_S},cuda:{CUDA}"
    try:
        s = start(tmp_path_factory.mktemp("srv"), model_dir, "--heartbeat-timeout", str(HEARTBEAT_TIMEOUT_S))
    finally:
        del os.environ[FAULTS_ENV]
    yield s
    assert stop(s) == 0, s.log.read_text()[-3000:]
    log = s.log.read_text()
    assert log.count("Traceback") == 1 and "exited with code" not in log, log[-3000:]  # the injected one only


class Background:
    """A long greedy streaming request on its own client, read to the end on a thread."""

    def __init__(self, endpoint: str, max_tokens: int = 24):
        self.result, self.error = None, None
        self.client = Client(endpoint, timeout=WAIT_S)
        self.stream = self.client.stream(prompt="a long story " * 3, max_tokens=max_tokens, temperature=0,
                                         ignore_eos=True)
        next(iter(self.stream))  # it runs
        self.thread = threading.Thread(target=self._read)
        self.thread.start()

    def _read(self) -> None:
        try:
            self.result = list(self.stream)
        except Exception as exc:  # noqa: BLE001 (reported by done())
            self.error = exc

    def done(self) -> list:
        self.thread.join(WAIT_S)
        self.client.close()
        assert self.error is None, self.error
        assert self.result and self.result[-1].finish_reason == "length"
        return self.result


def _raw_generate(endpoint: str, **fields) -> replies.ServerReply:
    with zmq.Context() as ctx, ctx.socket(zmq.DEALER) as sock:
        sock.connect(endpoint)
        sock.send(msgspec.msgpack.encode({"type": "generate", "v": 1, "rid": "raw", **fields}))
        while True:
            assert sock.poll(int(WAIT_S * 1000)), "no reply"
            reply = replies.decode(sock.recv())
            if not isinstance(reply, replies.Pending):
                sock.close(linger=0)
                return reply


def test_top_k_2_to_the_63_gets_an_error_while_a_concurrent_request_completes(server):
    other = Background(server.endpoint)
    reply = _raw_generate(server.endpoint, prompt="hi", top_k=2**63, max_tokens=4)
    assert isinstance(reply, replies.Error) and reply.code == replies.BAD_REQUEST and "top_k" in reply.message
    other.done()
    with Client(server.endpoint, timeout=WAIT_S) as c:
        assert_pages_settled(c)


def test_a_step_that_raises_fails_its_request_alone(server):
    other = Background(server.endpoint)
    with Client(server.endpoint, timeout=WAIT_S) as c:
        with pytest.raises(ServerError, match="request 'doomed' failed: internal error") as info:
            c.generate(rid="doomed", prompt=f"{chr(RAISE)} fails", max_tokens=4)
        assert (info.value.code, info.value.rid) == (replies.INTERNAL, "doomed")
        other.done()
        assert_pages_settled(c)
        stats = c.stats()
        assert stats["requests_failed"] == 1 and stats["scheduler_pid"] == server.scheduler_pid
    assert server.log.read_text().count("Traceback") == 1  # one traceback, in the scheduler's log


def test_a_step_longer_than_the_heartbeat_timeout_is_not_killed(server):
    with Client(server.endpoint, timeout=WAIT_S) as c:
        started = time.monotonic()
        done = c.generate(prompt=f"{chr(SLEEP)} slow", max_tokens=3, temperature=0, ignore_eos=True)
        assert time.monotonic() - started > SLEEP_S > HEARTBEAT_TIMEOUT_S
        assert done.finish_reason == "length" and c.stats()["scheduler_pid"] == server.scheduler_pid
    assert server.proc.poll() is None


@pytest.mark.parametrize("chars, code, match", [
    (50_000_000, replies.BAD_REQUEST, "50000000 characters"),  # refused before it is tokenized
    (900_000, replies.CONTEXT_LENGTH, "900000 tokens"),  # tokenized on a worker thread
])
def test_a_huge_prompt_gets_an_error_while_a_small_request_is_answered(server, chars, code, match):
    box = {}
    big = threading.Thread(target=lambda: box.update(reply=_raw_generate(server.endpoint, prompt="x" * chars)))
    with Client(server.endpoint, timeout=WAIT_S) as c:
        c.info()
        big.start()
        time.sleep(0.05)  # the big frame is on its way
        started = time.monotonic()
        small = c.generate(prompt="small", max_tokens=2, temperature=0)
        answered_s = time.monotonic() - started
    big.join(WAIT_S)
    assert small.finish_reason in ("length", "stop") and answered_s < 5.0, answered_s
    reply = box["reply"]
    assert isinstance(reply, replies.Error) and reply.code == code and match in reply.message, reply


def _ipc_dir(scheduler_pid: int) -> Path:
    argv = Path(f"/proc/{scheduler_pid}/cmdline").read_bytes().split(b"\0")
    endpoint = argv[argv.index(b"--frontend-to-scheduler") + 1].decode()
    return Path(endpoint.removeprefix("ipc://")).parent


def _wait_gone(pid: int) -> None:
    deadline = time.monotonic() + WAIT_S
    while Path(f"/proc/{pid}").exists() and Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z":
        assert time.monotonic() < deadline, f"process {pid} still runs"
        time.sleep(0.05)


def test_a_killed_frontend_leaves_no_socket_dir_nor_pid_file(model_dir, tmp_path):  # noqa: F811
    s = start(tmp_path, model_dir)
    ipc_dir, pid_file = _ipc_dir(s.scheduler_pid), tmp_path / "pid"
    assert ipc_dir.is_dir() and pid_file.exists()
    s.proc.send_signal(signal.SIGKILL)
    s.proc.wait(WAIT_S)
    _wait_gone(s.scheduler_pid)
    assert not ipc_dir.exists() and not pid_file.exists()


def test_an_error_that_poisons_the_device_ends_the_scheduler_with_a_clear_line(model_dir, tmp_path):  # noqa: F811
    os.environ[FAULTS_ENV] = f"cuda:{CUDA}"
    try:
        s = start(tmp_path, model_dir)
    finally:
        del os.environ[FAULTS_ENV]
    with Client(s.endpoint, timeout=WAIT_S) as c, pytest.raises(ServerError, match="exited with code 3") as info:
        c.generate(prompt=f"{chr(CUDA)} boom", max_tokens=3)
    assert info.value.code == replies.SCHEDULER_DIED
    assert s.proc.wait(WAIT_S) == 1
    assert "the device is unusable after this error; exiting (code 3)" in s.log.read_text()
