"""``python -m frontend.client``: one completion (``--prompt``), server stats (``--stats``) or an
interactive multi-turn chat (``--chat``) that streams each reply and keeps the history."""

from __future__ import annotations

import argparse
import sys

from frontend.client import DEFAULT_ENDPOINT, DEFAULT_TIMEOUT_S, Client, ServerError, collect


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m frontend.client", description=__doc__, allow_abbrev=False
    )
    p.add_argument("--endpoint", default=DEFAULT_ENDPOINT)
    p.add_argument("--api-key", help="the server's --api-key (default: $SLUICE_API_KEY)")
    mode = p.add_mutually_exclusive_group(required=True)
    mode.add_argument("--prompt", help="complete this text and print the completion")
    mode.add_argument("--chat", action="store_true", help="interactive chat (Ctrl-D ends it)")
    mode.add_argument("--stats", action="store_true", help="print the server's stats")
    p.add_argument("--system", help="system message for --chat")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--stream", action="store_true", help="print --prompt's completion as it comes")
    p.add_argument(
        "--timeout", type=float, default=DEFAULT_TIMEOUT_S, help="seconds to wait for each reply"
    )
    return p.parse_args(argv)


def _print_stream(stream) -> str:
    completion = collect(_echo(stream))
    print(flush=True)
    return completion.text


def _echo(stream):
    for chunk in stream:
        print(chunk.text, end="", flush=True)
        yield chunk


def _chat(client: Client, args: argparse.Namespace, sampling: dict) -> None:
    history = [{"role": "system", "content": args.system}] if args.system else []
    while True:
        try:
            line = input("you> ")
        except EOFError:
            print()
            return
        if not line.strip():
            continue
        history.append({"role": "user", "content": line})
        print("assistant> ", end="", flush=True)
        try:
            with client.stream(messages=history, **sampling) as stream:
                reply = _print_stream(stream)
        except ServerError as exc:  # e.g. the history outgrew the context: say so, keep chatting
            print(f"\nerror: {exc}", file=sys.stderr)
            history.pop()
            continue
        history.append({"role": "assistant", "content": reply})


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    sampling = dict(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
        stop=args.stop,
        timeout=args.timeout,
    )
    with Client(args.endpoint, timeout=args.timeout, api_key=args.api_key) as client:
        try:
            if args.stats:
                for key, value in sorted(client.stats().items()):
                    print(f"{key}: {value}")
            elif args.chat:
                _chat(client, args, sampling)
            elif args.stream:
                with client.stream(prompt=args.prompt, **sampling) as stream:
                    _print_stream(stream)
            else:
                print(client.generate(prompt=args.prompt, **sampling).text)
        except (ServerError, TimeoutError, ValueError) as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 1
        except KeyboardInterrupt:
            return 130
    return 0
