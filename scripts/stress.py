"""Attack a running Sluice server and check that it survives: random frames, type and range fuzz of
every Generate field, huge values, nested structures, multi-frame messages, 50 MB frames,
grammars (broken, unsatisfiable, huge, mistyped),
concurrent load with aborts and disconnects, and (``--kill``) kill -9 of either process.
With ``--http URL`` the HTTP API too (``scripts/stress_http.py``): malformed, huge and mistyped
bodies, fields that would change the output, bad schemas, forced tools that do not exist,
clients that vanish mid-stream, many clients; every bad request must get its API's error and a 4xx.

    scripts/serve.sh --pid-file /tmp/sluice.pid &            # then, once it is ready:
    python scripts/stress.py --endpoint tcp://127.0.0.1:5557 --http http://127.0.0.1:8000 --duration 60

Bounded in time (``--duration``, shared among the attacks). Prints a table of what was sent, how
many error replies came back, how many got no reply, wrong replies (HTTP: a 5xx, an error not in
its API's shape, a 2xx to a bad request) and crashes (the server stopped answering or the scheduler
changed pid), then whether every KV page came back. Exits 1 on a crash, a wrong reply or a leak.
``--busy N`` runs N busy-loop processes beside the server meanwhile, as when CI shares its cores
(``OMP_WAIT_POLICY=ACTIVE scripts/serve.sh`` serves with spinning threads, as before 2026-12-07).
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import random
import reprlib
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import msgspec
import zmq
import zmq.asyncio

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, uninstalled

from frontend.api import ProtocolError, replies, requests  # noqa: E402
from frontend.client import AsyncClient, Client, ServerError  # noqa: E402
from scripts import stress_http  # noqa: E402

REPLY_S = 30.0  # an attack frame that gets no reply within this is counted as unanswered
HUGE_INTS = [2**63, 2**63 - 1, 2**64 - 1, -(2**63)]  # msgpack holds no int outside [-2**63, 2**64)
ODD_VALUES = [None, True, "1", "", "x" * 1000, [], [1, 2], {}, {"a": 1}, 1.5, float("inf"), float("-inf"),
              float("nan"), -1, 0, *HUGE_INTS]
FIELDS = ["grammar", "rid", "prompt", "messages", "input_ids", "temperature", "top_k", "top_p", "seed", "max_tokens",
          "stop", "stream", "ignore_eos", "v", "type"]


@dataclass
class Row:
    attack: str
    sent: int = 0
    errors: int = 0  # Error replies
    other: int = 0  # any other reply (a completion, an abort chunk, ...)
    unanswered: int = 0
    wrong: int = 0  # HTTP: a 5xx, a misshapen error, a 2xx to a bad request
    crashes: int = 0


def _gen(**fields) -> bytes:
    base = {"type": "generate", "v": 1, "rid": "stress", "prompt": "hi", "max_tokens": 2}
    return msgspec.msgpack.encode({**base, **fields})


def random_frames(rng: random.Random) -> Iterator[list[bytes]]:
    while True:
        yield [rng.randbytes(rng.choice([0, 1, 2, 7, 37, 300, 5000]))]


def field_fuzz(rng: random.Random) -> Iterator[list[bytes]]:
    while True:
        field, value = rng.choice(FIELDS), rng.choice(ODD_VALUES)
        yield [_gen(**{field: value})]


def nested(rng: random.Random) -> Iterator[list[bytes]]:
    while True:
        depth = rng.choice([100, 10_000, 200_000])
        yield [rng.choice([b"\x91" * depth + b"\x00", b"\x81\xa1k" * depth + b"\x00",
                           _gen(messages=[{"role": "user", "content": "x"}] * depth)])]


def multi_frame(rng: random.Random) -> Iterator[list[bytes]]:
    while True:
        yield [b"lead", _gen()] if rng.random() < 0.5 else [_gen(), _gen()]


GRAMMARS = [
    'start: %json {"type": "strin"}',  # not a schema
    'start: %json {"allOf": [{"type": "string"}, {"type": "integer"}]}',  # unsatisfiable
    'start: %json {"type": "array", "uniqueItems": true}',  # unimplemented
    'start: "ok" <[999999]>',  # a token the vocabulary lacks
    "start: " + '"a" ' * 70_000,  # under the size cap, large to compile
    "start: " + '"a" ' * 100_000,  # over it
    'start: %json {"type": "object", "properties": {' + ", ".join(
        f'"p{i}": {{"type": "string", "pattern": "[a-z]{{1,30}}@[a-z]{{2,9}}"}}' for i in range(1500)) + "}}",
    "start: /(a|b){1,100000}/",
    'start: "yes" | "no"',  # a fine one
    "start:",
    "",
]


def grammars(rng: random.Random) -> Iterator[list[bytes]]:
    """Constrained requests (the frame carries the scheduler's Grammar): broken, unsatisfiable,
    huge, mistyped, and fine."""
    while True:
        lark = rng.choice(GRAMMARS)
        grammar = rng.choice([{"lark": lark}, {"lark": lark, "what": "stress"}, {"lark": 7}, "start: x", [lark]])
        yield [_gen(grammar=grammar, max_tokens=rng.choice([2, 50]))]


def big_frames(rng: random.Random) -> Iterator[list[bytes]]:
    while True:
        yield [_gen(prompt="x" * 50_000_000) if rng.random() < 0.5 else _gen(input_ids=[1] * 5_000_000)]


ATTACKS: dict[str, Callable[[random.Random], Iterator[list[bytes]]]] = {
    "random frames": random_frames,
    "field type/range fuzz": field_fuzz,
    "nested structures": nested,
    "multi-frame": multi_frame,
    "50 MB frames": big_frames,
    "grammars": grammars,
}


class Health:
    """Is the server there, with the same scheduler? ``check`` counts a crash when not."""

    def __init__(self, endpoint: str):
        self.endpoint = endpoint
        self.scheduler_pid = self.stats()["scheduler_pid"]

    def stats(self) -> dict:
        with Client(self.endpoint, timeout=REPLY_S) as c:
            return c.stats()

    def check(self, row: Row) -> bool:
        try:
            pid = self.stats()["scheduler_pid"]
        except (TimeoutError, ServerError) as exc:
            print(f"CRASH after {row.attack}: {exc}", file=sys.stderr)
            row.crashes += 1
            return False
        if pid != self.scheduler_pid:
            print(f"CRASH after {row.attack}: the scheduler pid changed", file=sys.stderr)
            row.crashes += 1
            return False
        return True


def run_attack(endpoint: str, name: str, frames: Iterator[list[bytes]], seconds: float) -> Row:
    row, deadline = Row(name), time.monotonic() + seconds
    with zmq.Context() as ctx:
        while time.monotonic() < deadline:
            with ctx.socket(zmq.DEALER) as sock:  # a fresh peer each time: a dropped one stays dropped
                sock.setsockopt(zmq.LINGER, 0)
                sock.connect(endpoint)
                frame = next(frames)
                sock.send_multipart(frame)
                row.sent += 1
                if not _count_reply(sock, row):
                    _say_unanswered(name, frame)
    return row


def _say_unanswered(attack: str, frame: list[bytes]) -> None:
    """Which frame got no reply, decoded where it is msgpack (a fuzzed field shows by name)."""
    short = reprlib.Repr()
    short.maxdict, short.maxstring, short.maxother = 32, 60, 60
    try:
        shown = short.repr([msgspec.msgpack.decode(part) for part in frame])
    except (msgspec.DecodeError, RecursionError):
        shown = short.repr(frame)
    print(f"no reply to a frame of {attack}: {shown}", file=sys.stderr)


def _count_reply(sock: zmq.Socket, row: Row) -> bool:
    """Count the reply to the frame just sent; False when none came within REPLY_S."""
    deadline = time.monotonic() + REPLY_S
    while sock.poll(max(1, int(1000 * (deadline - time.monotonic())))):
        try:
            reply = replies.decode(sock.recv_multipart()[-1])
        except ProtocolError:
            row.other += 1
            return True
        if isinstance(reply, replies.Pending):
            continue
        if isinstance(reply, replies.Error):
            row.errors += 1
        else:
            row.other += 1
        return True
    row.unanswered += 1  # e.g. a frame over --max-message-mb: ZMQ drops the connection
    return False


async def load(endpoint: str, clients: int, seconds: float, seed: int) -> Row:
    """Concurrent clients: whole completions, streams aborted mid-way, clients that vanish."""
    row = Row(f"load, {clients} clients")
    deadline = time.monotonic() + seconds

    async def one(i: int) -> None:
        rng = random.Random(seed * 1000 + i)
        while time.monotonic() < deadline:
            # A request still running at the deadline gets REPLY_S more, then counts as unanswered.
            client = AsyncClient(endpoint, timeout=deadline + REPLY_S - time.monotonic())
            try:
                await _one_request(client, rng, row)
            finally:
                await client.close()

    await asyncio.gather(*(one(i) for i in range(clients)))
    return row


async def _one_request(client: AsyncClient, rng: random.Random, row: Row) -> None:
    kind = rng.choice(["complete", "abort", "vanish"])
    params = dict(prompt=f"Tell me about sluice number {rng.randrange(1000)}.", max_tokens=rng.choice([1, 4, 8]),
                  temperature=rng.choice([0.0, 0.7]), seed=rng.randrange(2**31))
    row.sent += 1
    try:
        if kind == "complete":
            await client.generate(**params)
        elif kind == "abort":
            stream = client.stream(**params)
            await stream.__anext__()
            await stream.aclose()  # leaving the stream early aborts the request
        else:
            await _vanish(client.endpoint, params)
        row.other += 1
    except ServerError:
        row.errors += 1
    except TimeoutError:
        row.unanswered += 1


async def _vanish(endpoint: str, params: dict) -> None:
    """Send a request and go away without a word: the keep-alive must find out and abort it."""
    ctx = zmq.asyncio.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.connect(endpoint)
    await sock.send(requests.encode(requests.Generate(rid="vanish", stream=True, **params)))
    await asyncio.sleep(0.2)
    sock.close(linger=0)
    ctx.term()


def leaked_pages(health: Health) -> int | None:
    """Once nothing runs, every KV page must be free or in the prefix cache (None: the scheduler
    does not report its pages, e.g. the tests' fake scheduler)."""
    deadline = time.monotonic() + REPLY_S * 2
    while True:
        s = health.stats()
        if "kv_pages_total" not in s:
            return None
        idle = s["requests_running"] == 0 and s["requests_waiting"] == 0 and s["frontend_active_requests"] == 0
        if idle or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    return s["kv_pages_total"] - s["kv_pages_free"] - s["kv_pages_cached"]


def kill(target: str, health: Health, frontend_pid: int | None) -> Row:
    """kill -9 of a process while a request runs: its client must get an error soon (when the
    scheduler died) and, when the frontend died, the scheduler must exit and remove its socket dir.
    A scheduler left running or a socket dir left behind counts as a crash."""
    row = Row(f"kill -9 {target}")
    pid = health.scheduler_pid if target == "scheduler" else frontend_pid
    ipc_dir = _socket_dir(health.scheduler_pid)
    with Client(health.endpoint, timeout=REPLY_S) as c:
        stream = c.stream(prompt="a long story " * 4, max_tokens=200, ignore_eos=True, temperature=0)
        next(iter(stream))
        os.kill(pid, signal.SIGKILL)
        row.sent += 1
        try:
            for _ in stream:
                pass
            row.other += 1
        except ServerError:
            row.errors += 1
        except TimeoutError:
            row.unanswered += 1  # the frontend died: nobody can answer; the client's timeout ends it
    if target == "frontend" and not _exits(health.scheduler_pid, REPLY_S):
        print(f"CRASH: the scheduler (pid {health.scheduler_pid}) outlived its frontend", file=sys.stderr)
        row.crashes += 1
    elif target == "frontend" and ipc_dir is not None and ipc_dir.exists():
        print(f"CRASH: the socket dir {ipc_dir} outlived both processes", file=sys.stderr)
        row.crashes += 1
    return row


def _socket_dir(scheduler_pid: int) -> Path | None:
    try:
        argv = Path(f"/proc/{scheduler_pid}/cmdline").read_bytes().split(b"\0")
        endpoint = argv[argv.index(b"--frontend-to-scheduler") + 1].decode()
    except (OSError, ValueError, IndexError):  # not Linux, or another host's server
        return None
    return Path(endpoint.removeprefix("ipc://")).parent if endpoint.startswith("ipc://") else None


def _exits(pid: int, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.1)
    return False


def print_table(rows: list[Row], leak: int | None) -> None:
    print(f"{'attack':28s} {'sent':>7s} {'errors':>7s} {'other':>7s} {'no reply':>9s} {'wrong':>6s} {'crashes':>8s}")
    for r in rows:
        print(f"{r.attack:28s} {r.sent:7d} {r.errors:7d} {r.other:7d} {r.unanswered:9d} {r.wrong:6d} {r.crashes:8d}")
    print(f"leaked KV pages: {'not checked' if leak is None else leak}")


def zmq_attacks(endpoint: str, health: Health, rng: random.Random, share: float, clients: int,
                seed: int) -> list[Row]:
    rows: list[Row] = []
    for name, make in ATTACKS.items():
        rows.append(run_attack(endpoint, name, make(rng), share))
        if not health.check(rows[-1]):
            return rows
    rows.append(asyncio.run(load(endpoint, clients, 2 * share, seed)))
    health.check(rows[-1])
    return rows


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--endpoint", default="tcp://127.0.0.1:5557", help="the server's client endpoint")
    p.add_argument("--http", metavar="URL", help="attack the HTTP API at this URL too (e.g. http://127.0.0.1:8000)")
    p.add_argument("--http-only", action="store_true", help="with --http: no ZMQ attacks (the endpoint gives stats)")
    p.add_argument("--duration", type=float, default=60.0, help="seconds for all attacks together")
    p.add_argument("--clients", type=int, default=16, help="concurrent clients of the load attacks")
    p.add_argument("--reply-timeout", type=float, default=stress_http.REPLY_S,
                   help="seconds an HTTP request may take before it counts as unanswered (a loaded host wants more)")
    p.add_argument("--seed", type=int, default=0, help="seed of the fuzzers")
    p.add_argument("--kill", choices=["scheduler", "frontend"], help="end with kill -9 of this process")
    p.add_argument("--frontend-pid", type=int, help="pid of the frontend, for --kill frontend")
    p.add_argument("--busy", type=int, default=0, metavar="N",
                   help="N busy-loop processes on the cores while the attacks run, as when CI shares the machine")
    return p


@contextlib.contextmanager
def busy_loops(n: int) -> Iterator[list[subprocess.Popen]]:
    """``n`` processes that spin on the CPU until the block ends (a host whose cores others use)."""
    loops = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]
    try:
        yield loops
    finally:
        for proc in loops:
            proc.kill()
            proc.wait()


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    with busy_loops(args.busy):
        rows, leak = attack(args)
    print_table(rows, leak)
    return 1 if any(r.crashes for r in rows) or leak or any(r.wrong for r in rows) else 0


def attack(args: argparse.Namespace) -> tuple[list[Row], int | None]:
    """Every attack that ``args`` asks for, then the leak check: the rows and the leaked pages."""
    rng = random.Random(args.seed)
    health = Health(args.endpoint)
    zmq_shares = 0 if args.http and args.http_only else len(ATTACKS) + 2  # each load gets two shares
    share = args.duration / (zmq_shares + (stress_http.SHARES if args.http else 0))
    rows = zmq_attacks(args.endpoint, health, rng, share, args.clients, args.seed) if zmq_shares else []
    if args.http and not any(r.crashes for r in rows):
        target = stress_http.target(args.http, args.reply_timeout)
        rows += stress_http.attack_all(target, health, Row, rng, share, args.clients, args.seed)
    crashed = any(r.crashes for r in rows)
    leak = None if crashed else leaked_pages(health)
    if args.kill and not crashed:
        rows.append(kill(args.kill, health, args.frontend_pid))
    return rows, leak


if __name__ == "__main__":
    sys.exit(main())
