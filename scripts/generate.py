"""Offline generation for people:

    scripts/generate.py [--model DIR] --prompt TEXT [--chat] [--max-tokens N] [--temperature T] [--seed S]

Without ``--model`` it uses (and if needed prepares) the embedded default model. The prompt is
tokenized as the server tokenizes it (``frontend.tokenizer``: a raw prompt with the special tokens
tokenizer.json adds, a chat through the model's template), then runs through the engine's loop
(``scheduler.generate``).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, uninstalled

from frontend.tokenizer import ChatTokenizer  # noqa: E402
from scheduler.generate import generate  # noqa: E402
from scheduler.messages.to_scheduler import SamplingParams  # noqa: E402
from worker.cli_options import add_runner_args, resolve_model, runner_config  # noqa: E402
from worker.distributed.parallel_runner import start_runner  # noqa: E402
from worker.errors import CheckpointError  # noqa: E402
from worker.geometry_tokenizer import tokenizer_dir  # noqa: E402
from worker.runner import ModelRunner  # noqa: E402


def load_tokenizer(path: str | Path) -> ChatTokenizer:
    if not (Path(path) / "tokenizer.json").is_file():
        raise CheckpointError(f"{path}: no tokenizer.json")
    return ChatTokenizer.from_dir(path)


def prompt_tokens(tokenizer: ChatTokenizer, prompt: str, chat: bool) -> list[int]:
    """The ids the server would make of ``prompt`` sent as a prompt, or as one user message."""
    return tokenizer.encode_chat([{"role": "user", "content": prompt}]) if chat else tokenizer.encode(prompt)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="scripts/generate.py", description=__doc__.split("\n\n")[0])
    add_runner_args(parser)
    parser.add_argument("--prompt", required=True)
    parser.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--stats", action="store_true", help="print prefill and decode tokens/s to stderr")
    args = parser.parse_args(argv)
    try:
        return _run(args)
    except (CheckpointError, ValueError, MemoryError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2


def _run(args: argparse.Namespace) -> int:
    model_dir = resolve_model(args.model)
    params = SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed)
    params.validate()
    if args.max_tokens < 1:
        raise ValueError(f"--max-tokens must be >= 1, got {args.max_tokens}")
    tokenizer = load_tokenizer(tokenizer_dir(model_dir))
    runner = start_runner(runner_config(args, model_dir))
    try:
        return _generate(args, runner, tokenizer, params)
    finally:
        runner.close()


def _generate(args: argparse.Namespace, runner: ModelRunner, tokenizer: ChatTokenizer,
              params: SamplingParams) -> int:
    prompt_ids = prompt_tokens(tokenizer, args.prompt, args.chat)
    if not prompt_ids:
        raise ValueError("the prompt is empty")
    gen = generate(runner, prompt_ids, params, args.max_tokens, runner.model_config.eos_token_ids)
    runner.save_routing_record()
    print(tokenizer.decode(gen.token_ids))
    if args.stats:
        print(f"prefill {len(prompt_ids)} tokens in {gen.prefill_seconds:.3f} s "
              f"({len(prompt_ids) / gen.prefill_seconds:.1f} tok/s); decode {len(gen.token_ids)} tokens in "
              f"{gen.decode_seconds:.3f} s ({(len(gen.token_ids) - 1) / max(gen.decode_seconds, 1e-9):.1f} tok/s)",
              file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
