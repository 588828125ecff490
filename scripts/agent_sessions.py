"""Agent sessions against a running server (``scripts/serve.sh``): each session sends a long task
prompt, then turn after turn its whole history plus a tool result, as an agent loop does; all
sessions run at once. Per turn it records the time to the first token, the prompt tokens, and how
many of them the server served from its prefix cache.

    python scripts/agent_sessions.py [--endpoint tcp://127.0.0.1:5557] [--sessions 4] [--turns 5]
        [--context 4000] [--tool-tokens 300] [--max-tokens 64] [--id-range 1000] [--json FILE]

The bound it chases is the design's promise, that a turn costs what its new tokens cost: every
token of the previous turns (history and the model's own answers) served from the cache. The
ratio is cached prompt tokens over that ideal, for turns after the first. Prompts are token ids
drawn from ``[10, id-range)`` so the history stays token-exact across turns.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time

from frontend.client import DEFAULT_ENDPOINT, AsyncClient


async def session(client: AsyncClient, sid: int, args: argparse.Namespace) -> list[dict]:
    gen = random.Random(sid)
    history = [gen.randrange(10, args.id_range) for _ in range(args.context)]
    turns = []
    for turn in range(args.turns):
        prompt = history + ([gen.randrange(10, args.id_range) for _ in range(args.tool_tokens)] if turn else [])
        start = time.perf_counter()
        ttft, output, usage = None, [], None
        async for chunk in client.stream(input_ids=prompt, max_tokens=args.max_tokens, temperature=0,
                                         ignore_eos=True):
            if ttft is None and chunk.token_ids:
                ttft = time.perf_counter() - start
            output += chunk.token_ids
            usage = chunk.usage or usage
        turns.append(dict(session=sid, turn=turn, seconds=time.perf_counter() - start, ttft_s=ttft,
                          prompt_tokens=usage.prompt_tokens, cached_tokens=usage.cached_prompt_tokens,
                          ideal_cached=len(history) if turn else 0, new_tokens=len(output)))
        history = prompt + output
    return turns


async def run(args: argparse.Namespace) -> list[dict]:
    async with AsyncClient(args.endpoint, timeout=args.timeout) as client:
        per_session = await asyncio.gather(*(session(client, s, args) for s in range(args.sessions)))
    return [t for turns in per_session for t in turns]


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
    p.add_argument("--sessions", type=int, default=4)
    p.add_argument("--turns", type=int, default=5)
    p.add_argument("--context", type=int, default=4000, help="tokens of the first prompt of a session")
    p.add_argument("--tool-tokens", type=int, default=300, help="new tokens a later turn adds (a tool result)")
    p.add_argument("--max-tokens", type=int, default=64, help="tokens the model answers per turn")
    p.add_argument("--id-range", type=int, default=1000, help="prompt token ids are drawn from [10, this)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds a turn may wait for a reply")
    p.add_argument("--json")
    args = p.parse_args()
    rows = asyncio.run(run(args))
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
