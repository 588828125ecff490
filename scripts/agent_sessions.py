"""Agent sessions against a running server (``scripts/serve.sh``): each session sends a long task
prompt, then turn after turn its whole history plus a tool result, as an agent loop does; all
sessions run at once. Per turn it records the time to the first token, the turn's time, the prompt
tokens, and how many of them the server served from its prefix cache.

    python scripts/agent_sessions.py [--endpoint tcp://127.0.0.1:5557] [--sessions 4] [--turns 5]
        [--context 4000] [--tool-tokens 300] [--max-tokens 64] [--id-range 1000] [--seed 0]
        [--content fresh|shared] [--text [--http URL]] [--json FILE]

The bound it chases is the design's promise, that a turn costs what its new tokens cost: every
token of the previous turns (history and the model's own answers) served from the cache. The
ratio is cached prompt tokens over that ideal, for turns after the first. Prompts are token ids
drawn from ``[10, id-range)`` so the history stays token-exact across turns.

``--text`` sends chat messages instead, as an agent client does: the task and each tool result are
slices of this repository's source files (``CHARS_PER_TOKEN`` characters a requested token), each
reply goes back into the history as the assistant's text, and the frontend renders the chat
template and tokenizes the whole conversation every turn (its kept pieces: frontend/prompt_pieces.py).
The ideal then is the previous turn's prompt and reply tokens; a reply whose text tokenizes
differently (random weights write odd bytes) is not found in the cache past where it differs.

``--http URL`` (with ``--text``) sends each turn through the server's OpenAI API instead, by the
official ``openai`` client (streamed chat completions, ``ignore_eos`` in the body), as Codex or an
openai-agents loop does: the HTTP parsing, the reply's SSE and, for gpt-oss, harmony's rendering
are in the turn then. Its TTFT is the first chunk with text (the stream's opening role chunk
carries none), and the cached tokens come from the usage's ``prompt_tokens_details``.

``scripts/agent_ab.py`` runs this workload against two builds of the server, one after the other.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import functools
import json
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from frontend.client import DEFAULT_ENDPOINT, AsyncClient

CONTENT_MODES = ("fresh", "shared")
CHARS_PER_TOKEN = 3.5  # --text: characters of source a requested token (the default model's BPE on code)
ROOT = Path(__file__).resolve().parents[1]


@functools.cache
def source_text() -> str:
    """This repository's Python files, in a fixed order: the text of --text prompts."""
    return "".join(p.read_text() for p in sorted(ROOT.glob("[fmsw]*/**/*.py")))


@dataclass(frozen=True)
class Workload:
    sessions: int = 4  # run at once
    turns: int = 5
    context: int = 4000  # tokens of a session's first prompt
    tool_tokens: int = 300  # new tokens each later turn adds (a tool result)
    max_tokens: int = 64  # tokens the model answers per turn
    id_range: int = 1000  # prompt token ids are drawn from [10, id_range)
    seed: int = 0
    content: str = "fresh"  # fresh: each session its own random tokens; shared: one first prompt for all
    text: bool = False  # chat messages of source text instead of token ids

    def generator(self, stream: str) -> random.Random:
        return random.Random(f"{self.seed}/{stream}")

    def first_prompt(self, sid: int) -> list[int]:
        """A session's task prompt; with ``shared`` content every session opens with the same one
        (the radix cache then serves it to all), and the tool results make them diverge."""
        gen = self.generator("first" if self.content == "shared" else f"first/{sid}")
        return self.tokens(gen, self.context)

    def tokens(self, gen: random.Random, n: int) -> list[int]:
        return [gen.randrange(10, self.id_range) for _ in range(n)]

    def message(self, gen: random.Random, n: int) -> dict[str, str]:
        """A user message of about ``n`` tokens of source text, from a random place."""
        text, chars = source_text(), int(n * CHARS_PER_TOKEN)
        start = gen.randrange(0, max(1, len(text) - chars))
        return {"role": "user", "content": text[start:start + chars]}


def add_workload_args(p: argparse.ArgumentParser, **defaults) -> None:
    """The workload's flags; ``defaults`` override Workload's (e.g. ``turns=120``)."""
    d = dataclasses.replace(Workload(), **defaults)
    p.add_argument("--sessions", type=int, default=d.sessions, help="sessions run at once")
    p.add_argument("--turns", type=int, default=d.turns, help="turns per session")
    p.add_argument("--context", type=int, default=d.context, help="tokens of the first prompt of a session")
    p.add_argument("--tool-tokens", type=int, default=d.tool_tokens, help="new tokens a later turn adds (a tool result)")
    p.add_argument("--max-tokens", type=int, default=d.max_tokens, help="tokens the model answers per turn")
    p.add_argument("--id-range", type=int, default=d.id_range, help="prompt token ids are drawn from [10, this)")
    p.add_argument("--seed", type=int, default=d.seed, help="seed of the sessions' random tokens")
    p.add_argument("--content", default=d.content, choices=CONTENT_MODES,
                   help="fresh: every session draws its own random tokens; shared: all open with one first prompt")
    p.add_argument("--text", action="store_true",
                   help="chat messages of source text, which the server renders and tokenizes, not token ids")


def workload_from_args(args: argparse.Namespace) -> Workload:
    return Workload(args.sessions, args.turns, args.context, args.tool_tokens, args.max_tokens, args.id_range,
                    args.seed, args.content, args.text)


class ZmqTurns:
    """Turns through Sluice's own client over ZMQ (``prompt``: ``input_ids`` or ``messages``)."""

    def __init__(self, client: AsyncClient):
        self.client = client

    async def turn(self, prompt: dict, max_tokens: int) -> tuple[dict, list[int], str]:
        """One greedy request: its timings and usage, and the tokens and text it generated."""
        start = time.perf_counter()
        ttft, output, text, usage = None, [], [], None
        async for chunk in self.client.stream(**prompt, max_tokens=max_tokens, temperature=0, ignore_eos=True):
            if ttft is None and chunk.token_ids:
                ttft = time.perf_counter() - start
            output += chunk.token_ids
            text.append(chunk.text)
            usage = chunk.usage or usage
        row = dict(seconds=time.perf_counter() - start, ttft_s=ttft, prompt_tokens=usage.prompt_tokens,
                   cached_tokens=usage.cached_prompt_tokens, new_tokens=len(output))
        return row, output, "".join(text)


class HttpTurns:
    """Turns through the server's OpenAI API by the official ``openai`` client (``prompt``:
    ``messages``); no token ids come back, so the reply is its text."""

    def __init__(self, client, model: str):
        self.client, self.model = client, model

    async def turn(self, prompt: dict, max_tokens: int) -> tuple[dict, list[int], str]:
        start = time.perf_counter()
        ttft, text, usage = None, [], None
        stream = await self.client.chat.completions.create(
            model=self.model, messages=prompt["messages"], max_tokens=max_tokens, temperature=0, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
        async for chunk in stream:
            delta = chunk.choices[0].delta if chunk.choices else None
            # reasoning (gpt-oss's analysis, a thinking model's) is text the client sees first too
            if delta is not None and (delta.content or delta.tool_calls or getattr(delta, "reasoning_content", None)):
                ttft = ttft if ttft is not None else time.perf_counter() - start
                text.append(delta.content or "")
            usage = chunk.usage or usage
        seconds = time.perf_counter() - start  # a reply with no visible text: its TTFT is the whole turn
        details = usage.prompt_tokens_details
        row = dict(seconds=seconds, ttft_s=ttft if ttft is not None else seconds, prompt_tokens=usage.prompt_tokens,
                   cached_tokens=details.cached_tokens if details is not None else 0,
                   new_tokens=usage.completion_tokens)
        return row, [], "".join(text)


@contextlib.asynccontextmanager
async def connect(endpoint: str, timeout: float, http: str | None = None):
    """The turns of one run: over ZMQ to ``endpoint``, or by HTTP to ``http`` (the served model's
    name read from ``/v1/models``)."""
    if http is None:
        async with AsyncClient(endpoint, timeout=timeout) as client:
            yield ZmqTurns(client)
        return
    import openai

    async with openai.AsyncOpenAI(base_url=http.rstrip("/") + "/v1", api_key="none", max_retries=0,
                                  timeout=timeout) as client:
        yield HttpTurns(client, (await client.models.list()).data[0].id)


async def session(client: ZmqTurns | HttpTurns, sid: int, workload: Workload, t0: float,
                  on_turn: Callable[[dict], None] | None = None) -> list[dict]:
    """One session's turns; ``on_turn`` sees each turn's row as it ends (progress of a long run)."""
    if workload.text:
        return await text_session(client, sid, workload, t0, on_turn)
    gen = workload.generator(f"tools/{sid}")
    history = workload.first_prompt(sid)
    turns = []
    for turn in range(workload.turns):
        prompt = history + (workload.tokens(gen, workload.tool_tokens) if turn else [])
        started = time.perf_counter() - t0
        row, output, _ = await client.turn({"input_ids": prompt}, workload.max_tokens)
        turns.append(dict(session=sid, turn=turn, started_s=started, ideal_cached=len(history) if turn else 0, **row))
        if on_turn is not None:
            on_turn(turns[-1])
        history = prompt + output
    return turns


async def text_session(client: ZmqTurns | HttpTurns, sid: int, workload: Workload, t0: float,
                       on_turn: Callable[[dict], None] | None = None) -> list[dict]:
    """``session`` in chat messages (--text): the reply's text joins the history as the assistant's."""
    gen = workload.generator(f"tools/{sid}")
    first = workload.generator("first" if workload.content == "shared" else f"first/{sid}")
    history, ideal, turns = [workload.message(first, workload.context)], 0, []
    for turn in range(workload.turns):
        prompt = history + ([workload.message(gen, workload.tool_tokens)] if turn else [])
        started = time.perf_counter() - t0
        row, _, reply = await client.turn({"messages": prompt}, workload.max_tokens)
        turns.append(dict(session=sid, turn=turn, started_s=started, ideal_cached=ideal, **row))
        if on_turn is not None:
            on_turn(turns[-1])
        history, ideal = prompt + [{"role": "assistant", "content": reply}], row["prompt_tokens"] + row["new_tokens"]
    return turns


async def run_sessions(endpoint: str, workload: Workload, timeout: float,
                       on_turn: Callable[[dict], None] | None = None, http: str | None = None) -> list[dict]:
    """Every turn of every session, session by session; ``started_s`` counts from the first send.
    ``http``: the server's OpenAI API, by the openai client (``workload.text`` only)."""
    if http is not None and not workload.text:
        raise ValueError("--http sends chat messages: add --text")
    t0 = time.perf_counter()
    async with connect(endpoint, timeout, http) as client:
        per_session = await asyncio.gather(*(session(client, s, workload, t0, on_turn)
                                             for s in range(workload.sessions)))
    return [t for turns in per_session for t in turns]


async def server_stats(endpoint: str, timeout: float) -> dict:
    async with AsyncClient(endpoint, timeout=timeout) as client:
        return await client.stats()


def summarise(rows: list[dict]) -> dict:
    first = [r for r in rows if r["turn"] == 0]
    later = [r for r in rows if r["turn"] > 0]
    ideal = sum(r["ideal_cached"] for r in later)
    return dict(first_ttft_s=statistics.mean(r["ttft_s"] for r in first),
                later_ttft_s=statistics.mean(r["ttft_s"] for r in later) if later else float("nan"),
                later_prompt_tokens=statistics.mean(r["prompt_tokens"] for r in later) if later else 0,
                cached_ratio=sum(r["cached_tokens"] for r in later) / ideal if ideal else float("nan"))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--endpoint", default=DEFAULT_ENDPOINT)
    p.add_argument("--http", metavar="URL", default=None,
                   help="send the turns to the server's OpenAI API at URL (e.g. http://127.0.0.1:8000), by the "
                        "openai client; needs --text")
    add_workload_args(p)
    p.add_argument("--timeout", type=float, default=600.0, help="seconds a turn may wait for a reply")
    p.add_argument("--json")
    args = p.parse_args()
    if args.http and not args.text:
        p.error("--http sends chat messages: add --text")
    rows = asyncio.run(run_sessions(args.endpoint, workload_from_args(args), args.timeout, http=args.http))
    print(f"{'session':>7} {'turn':>4} {'prompt':>7} {'cached':>7} {'ideal':>7} {'TTFT s':>7} {'turn s':>7}")
    for r in rows:
        print(f"{r['session']:>7} {r['turn']:>4} {r['prompt_tokens']:>7} {r['cached_tokens']:>7} "
              f"{r['ideal_cached']:>7} {r['ttft_s']:>7.3f} {r['seconds']:>7.3f}")
    s = summarise(rows)
    print(f"first turns: TTFT {s['first_ttft_s']:.3f} s; later turns: TTFT {s['later_ttft_s']:.3f} s over "
          f"{s['later_prompt_tokens']:.0f}-token prompts; cached / ideal (all earlier turns' tokens) "
          f"{s['cached_ratio']:.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(turns=rows, summary=s), f, indent=1)


if __name__ == "__main__":
    main()
