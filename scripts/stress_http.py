"""The HTTP half of ``scripts/stress.py`` (``--http URL``): the bad requests of
``stress_http_probes``, clients that vanish (mid-stream, before the reply, mid-body) and many
concurrent clients, against the five POST endpoints.

A bad request must get a 4xx whose body is its API's error object (OpenAI's ``{"error": {...}}``,
Anthropic's ``{"type": "error", "error": {...}}`` under /v1/messages); a 5xx, a misshapen error or
a 2xx to a request that is bad by construction counts as wrong. After each attack every endpoint
must answer a good request, else it counts as a crash. ``row`` is ``stress.Row``."""
from __future__ import annotations

import asyncio
import json
import random
import socket
import sys
import time
from typing import Any, Iterator, NamedTuple
from urllib.parse import urlsplit

import httpx

from scripts.stress_http_probes import (ATTACKS, CHAT, COMPLETIONS, COUNT, MESSAGES, PATHS, RESPONSES, Probe, good,
                                        with_messages)

REPLY_S = 30.0
SHARES = len(ATTACKS) + 3  # of the duration: one per attack, the vanishing clients, two for the load
SHOWN = 3  # wrong replies printed per attack
LONG_PATHS = (CHAT, COMPLETIONS, RESPONSES, MESSAGES)  # the vanishers' streams, as long as the context allows


class Target(NamedTuple):
    url: str
    model: str
    context: int  # tokens
    reply_s: float  # a request unanswered this long counts as no reply


def target(url: str, reply_s: float = REPLY_S) -> Target:
    """The server at ``url`` and the model it serves."""
    card = httpx.get(url + "/v1/models", timeout=reply_s).json()["data"][0]
    return Target(url, card["id"], card["max_model_len"], reply_s)


def _long(path: str, context: int) -> dict:
    tokens = min(2000, context // 2)
    if path == RESPONSES:
        return {"max_output_tokens": tokens}
    return {"max_tokens": tokens, **({} if path == MESSAGES else {"ignore_eos": True})}


def error_shaped(path: str, data: Any) -> bool:
    """Anthropic's error object under /v1/messages, OpenAI's elsewhere."""
    if not isinstance(data, dict) or not isinstance(data.get("error"), dict):
        return False
    error = data["error"]
    if not (isinstance(error.get("message"), str) and isinstance(error.get("type"), str)):
        return False
    return data.get("type") == "error" if path.startswith(MESSAGES) else set(error) >= {"param", "code"}


def run_attack(t: Target, probes: Iterator[Probe], seconds: float, row) -> None:
    deadline = time.monotonic() + seconds
    with httpx.Client(timeout=t.reply_s) as client:
        while time.monotonic() < deadline:
            probe = next(probes)
            row.sent += 1
            judge(probe, _send(client, t.url, probe), row)


def _send(client: httpx.Client, url: str, probe: Probe) -> httpx.Response | None:
    data = probe.body if isinstance(probe.body, bytes) else json.dumps(probe.body).encode()
    content = (data[i:i + (1 << 20)] for i in range(0, len(data), 1 << 20)) if probe.chunked else data
    try:
        # a fresh connection each time: the server may close one after an error (a body it did not read)
        return client.post(url + probe.path, content=content,
                           headers={"content-type": "application/json", "connection": "close"})
    except httpx.TimeoutException:
        return None
    except httpx.TransportError as exc:  # e.g. the server answered 413 and closed while the body was going
        return httpx.Response(499, text=f"transport error: {exc!r}")


def judge(probe: Probe, reply: httpx.Response | None, row) -> None:
    if reply is None:
        row.unanswered += 1
        _show(row, probe, "no reply")
        return
    try:
        data = reply.json()
    except ValueError:
        data = None
    if 400 <= reply.status_code < 500 and error_shaped(probe.path, data):
        row.errors += 1
    elif reply.status_code < 300 and not probe.bad:
        row.other += 1
    else:
        row.wrong += 1
        _show(row, probe, f"{reply.status_code} {reply.text[:200]!r}")


def _show(row, probe: Probe, what: str) -> None:
    if row.wrong + row.unanswered <= SHOWN:
        body = probe.body[:120] if isinstance(probe.body, bytes) else json.dumps(probe.body)[:200]
        print(f"{row.attack}: {probe.path} {body!r} -> {what}", file=sys.stderr)


def answers_good_requests(t: Target) -> str | None:
    """None when every endpoint answers a small good request (sent together); else what went wrong."""
    problems = asyncio.run(_good_replies(t))
    return "; ".join(problems) or None


async def _good_replies(t: Target) -> list[str]:
    async with httpx.AsyncClient(timeout=t.reply_s) as client:
        replies = await asyncio.gather(*(client.post(t.url + path, json=good(path, t.model)) for path in PATHS),
                                       return_exceptions=True)
    return [f"{path}: {r!r}" if isinstance(r, Exception) else f"{path}: {r.status_code} {r.text[:200]}"
            for path, r in zip(PATHS, replies) if isinstance(r, Exception) or r.status_code != 200]


# ==== clients that vanish ====

def vanish(t: Target, rng: random.Random, seconds: float, row) -> None:
    """Raw sockets that go away: after a few events of a stream, before the reply, mid-body."""
    deadline = time.monotonic() + seconds
    host, port = urlsplit(t.url).hostname, urlsplit(t.url).port or 80
    while time.monotonic() < deadline:
        path = rng.choice(LONG_PATHS)
        kind = rng.choice(["mid-stream", "before the reply", "mid-body"])
        stream = kind == "mid-stream" or rng.random() < 0.5
        body = json.dumps(good(path, t.model, stream=stream, **_long(path, t.context)))
        head = (f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(body)}\r\n\r\n").encode()
        row.sent += 1
        with socket.create_connection((host, port), timeout=t.reply_s) as sock:
            if kind == "mid-body":
                sock.sendall(head + body.encode()[:len(body) // 2])
            else:
                sock.sendall(head + body.encode())
            if kind == "before the reply":
                time.sleep(rng.uniform(0, 0.5))
            elif kind == "mid-stream":
                _read_events(sock, rng.randint(1, 5), row)
                continue
        row.other += 1


def _read_events(sock: socket.socket, events: int, row) -> None:
    """Read until ``events`` SSE events came (then the caller closes the socket), or count why not."""
    seen = b""
    try:
        while seen.count(b"\n\n") < events + 1:  # the head ends with a blank line too
            part = sock.recv(65536)
            if not part:
                break
            seen += part
    except TimeoutError:
        row.unanswered += 1
        return
    if seen.startswith(b"HTTP/1.1 200") and seen.count(b"\n\n") >= events + 1:
        row.other += 1
    else:
        row.wrong += 1
        print(f"{row.attack}: a stream that ended early: {seen[:300]!r}", file=sys.stderr)


# ==== many clients ====

async def load(t: Target, clients: int, seconds: float, seed: int, row) -> None:
    """Concurrent clients on every endpoint: whole replies, whole streams, streams left after one event."""
    deadline = time.monotonic() + seconds

    async def one(client: httpx.AsyncClient, i: int) -> None:
        rng = random.Random(seed * 1000 + i)
        while time.monotonic() < deadline:
            await _one_request(client, t.url, _load_body(rng, t.model), rng, row)

    limits = httpx.Limits(max_connections=clients)
    async with httpx.AsyncClient(timeout=t.reply_s, limits=limits) as client:
        await asyncio.gather(*(one(client, i) for i in range(clients)))


def _load_body(rng: random.Random, model: str) -> tuple[str, dict]:
    path = rng.choice(PATHS)
    prompt = [{"role": "user", "content": f"Tell me about sluice number {rng.randrange(1000)}."}]
    limit = "max_output_tokens" if path == RESPONSES else "max_tokens"
    tokens = {} if path == COUNT else {limit: rng.choice([1, 4, 8])}
    return path, with_messages(path, model, prompt, **tokens)


async def _one_request(client: httpx.AsyncClient, url: str, request: tuple[str, dict], rng: random.Random,
                       row) -> None:
    path, body = request
    kind = "whole" if path == COUNT else rng.choice(["whole", "stream", "vanish"])
    row.sent += 1
    try:
        if kind == "whole":
            status = (await client.post(url + path, json=body)).status_code
        else:
            async with client.stream("POST", url + path, json={**body, "stream": True}) as reply:
                status = reply.status_code
                async for line in reply.aiter_lines():
                    if kind == "vanish" and line.startswith("data:"):
                        break  # leaving the block closes the connection mid-stream
    except httpx.TimeoutException:
        row.unanswered += 1
        return
    if status == 200:
        row.other += 1
    else:
        row.wrong += 1
        print(f"{row.attack}: {path} -> {status}", file=sys.stderr)


# ==== all of them ====

def attack_all(t: Target, health, make_row, rng: random.Random, share: float, clients: int, seed: int) -> list:
    """Every attack for ``share`` seconds (the load for two), each followed by good requests."""
    rows = []
    for name, make in ATTACKS.items():
        rows.append(make_row(name))
        run_attack(t, make(rng, t.model), share, rows[-1])
        if not _alive(t, health, rows[-1]):
            return rows
    rows.append(make_row("http vanishing clients"))
    vanish(t, rng, share, rows[-1])
    if _alive(t, health, rows[-1]):
        rows.append(make_row(f"http load, {clients} clients"))
        asyncio.run(load(t, clients, 2 * share, seed, rows[-1]))
        _alive(t, health, rows[-1])
    return rows


def _alive(t: Target, health, row) -> bool:
    if not health.check(row):
        return False
    problem = answers_good_requests(t)
    if problem is not None:
        print(f"CRASH after {row.attack}: a good request got {problem}", file=sys.stderr)
        row.crashes += 1
    return problem is None
