"""``python -m frontend.client``: one answer (``--prompt``), server stats (``--stats``) or an
interactive multi-turn chat (``--chat``) that streams each reply and keeps the history.

``--prompt`` is sent as a user message through the model's chat template when it has one (an
instruct model), as raw text to complete otherwise or with ``--raw``. Sampling options left unset
take the model's defaults (its generation_config.json; greedy when it does not ask to sample)."""

from __future__ import annotations

import argparse
import sys

from frontend.client import DEFAULT_ENDPOINT, DEFAULT_TIMEOUT_S, Client, ServerError, collect


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m frontend.client",
        description=__doc__,
        allow_abbrev=False,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    model = "the model's default"
    p.add_argument("--endpoint", default=DEFAULT_ENDPOINT, help=f"server endpoint (default: {DEFAULT_ENDPOINT})")
    p.add_argument("--api-key", help="the server's --api-key (default: $SLUICE_API_KEY)")
    mode = p.add_mutually_exclusive_group(required=True)
    mode.add_argument("--prompt", help="ask this (or, with --raw, complete it) and print the answer")
    mode.add_argument("--chat", action="store_true", help="interactive chat (Ctrl-D ends it)")
    mode.add_argument("--stats", action="store_true", help="print the server's stats")
    p.add_argument("--raw", action="store_true", help="send --prompt as raw text to complete, without the chat template")
    p.add_argument("--system", help="system message for --chat and --prompt (default: none)")
    p.add_argument("--max-tokens", type=int, default=256, help="most tokens to generate (default: 256)")
    p.add_argument("--temperature", type=float, help=f"0 is greedy (default: {model})")
    p.add_argument("--top-p", type=float, help=f"nucleus sampling mass (default: {model})")
    p.add_argument("--top-k", type=int, help=f"sample among the k likeliest tokens, 0 off (default: {model})")
    p.add_argument("--seed", type=int, help="sampling seed (default: a random one)")
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable; default: none)")
    p.add_argument("--stream", action="store_true", help="print --prompt's answer as it comes")
    p.add_argument(
        "--timeout",
        type=float,
        default=DEFAULT_TIMEOUT_S,
        help=f"seconds to wait for each reply (default: {DEFAULT_TIMEOUT_S:g})",
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


def _prompt_params(client: Client, args: argparse.Namespace) -> dict:
    """``--prompt`` as a chat turn for a model with a chat template (unless --raw), else raw."""
    if args.raw or not client.info().chat_template:
        return dict(prompt=args.prompt)
    system = [{"role": "system", "content": args.system}] if args.system else []
    return dict(messages=[*system, {"role": "user", "content": args.prompt}])


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
                with client.stream(**_prompt_params(client, args), **sampling) as stream:
                    _print_stream(stream)
            else:
                print(client.generate(**_prompt_params(client, args), **sampling).text)
        except (ServerError, TimeoutError, ValueError) as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 1
        except KeyboardInterrupt:
            return 130
    return 0
