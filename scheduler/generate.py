"""Offline generation for people and tests: one request through the engine's loop (the one the
server drives), without sockets.

    python -m scheduler.generate [--model DIR] --prompt TEXT [--chat] [--max-tokens N]
                                 [--temperature T] [--seed S]

Without ``--model`` it uses (and if needed prepares) the embedded default model.
"""
from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass

from scheduler.engine import Engine, EngineConfig
from scheduler.messages.from_scheduler import TokenUpdate
from scheduler.messages.to_scheduler import SamplingParams
from scheduler.request import Request
from worker.cli_options import add_runner_args, resolve_model, runner_config
from worker.errors import CheckpointError
from worker.geometry_tokenizer import tokenizer_dir
from worker.runner import ModelRunner
from worker.tokenizer import ChatTokenizer


@dataclass
class Generation:
    token_ids: list[int]
    finish_reason: str  # "stop" | "length"
    prefill_seconds: float
    decode_seconds: float


def generate(runner: ModelRunner, prompt_ids: list[int], params: SamplingParams, max_tokens: int,
             eos_ids: tuple[int, ...] = (), max_prefill_tokens: int | None = None) -> Generation:
    """Prefill the prompt in chunks, then decode (greedy or sampled): an engine of one request on
    ``runner``, without a prefix cache, so its pages go back to the pool when it ends."""
    config = EngineConfig(max_prefill_tokens=max_prefill_tokens or runner.max_prefill_tokens, max_running=1,
                          prefix_cache=False)
    engine = Engine(runner, config)
    error = engine.submit(Request("generate", list(prompt_ids), params, max_tokens, frozenset(eos_ids)))
    if error:
        raise ValueError(error)
    tokens, finish, first = [], "length", None
    start = time.perf_counter()
    while engine.has_work:
        for update in _step(engine):
            first = first or time.perf_counter()
            tokens += update.token_ids
            finish = update.finish_reason or finish
    return Generation(tokens, finish, first - start, time.perf_counter() - first)


def _step(engine: Engine) -> list[TokenUpdate]:
    """One engine step; a failed step or a request the pool cannot admit raises here."""
    updates = engine.step()
    failures = engine.take_failures()
    if failures:
        raise RuntimeError(failures[0].message)
    if engine.waiting and not (engine.running or engine.in_flight):
        raise MemoryError("the KV pool has no free pages for the request")
    return updates


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m scheduler.generate", description=__doc__.split("\n\n")[0])
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
    tokenizer = ChatTokenizer(tokenizer_dir(model_dir))
    runner = ModelRunner(runner_config(args, model_dir))
    text = tokenizer.apply_chat_template([{"role": "user", "content": args.prompt}]) if args.chat else args.prompt
    prompt_ids = tokenizer.encode(text)
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
