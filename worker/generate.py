"""Offline generation for people and tests:

    python -m worker.generate [--model DIR] --prompt TEXT [--chat] [--max-tokens N]
                              [--temperature T] [--seed S]

Without ``--model`` it uses (and if needed prepares) the embedded default model.
"""
from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass

from worker.batch import SequenceChunk
from worker.errors import CheckpointError
from worker.cli_options import add_runner_args, resolve_model, runner_config
from worker.geometry_tokenizer import tokenizer_dir
from worker.distributed.parallel_runner import start_runner
from worker.runner import ModelRunner
from worker.sampling import SamplingParams
from worker.tokenizer import ChatTokenizer


@dataclass
class Generation:
    token_ids: list[int]
    finish_reason: str  # "stop" | "length"
    prefill_seconds: float
    decode_seconds: float


def generate(runner: ModelRunner, prompt_ids: list[int], params: SamplingParams, max_tokens: int,
             eos_ids: tuple[int, ...] = (), max_prefill_tokens: int | None = None) -> Generation:
    """Prefill the prompt in chunks, then decode one token at a time (greedy or sampled)."""
    pool, chunk = runner.kv_pool, max_prefill_tokens or runner.plan.prefill_tokens
    total = len(prompt_ids) + max_tokens
    if total > runner.model_config.max_context:
        raise ValueError(f"prompt ({len(prompt_ids)}) + max_tokens ({max_tokens}) exceeds the context "
                         f"of {runner.model_config.max_context} tokens")
    vocab = runner.model_config.vocab_size
    if prompt_ids and not 0 <= min(prompt_ids) <= max(prompt_ids) < vocab:  # on the GPU: a device-side assert
        raise ValueError(f"prompt token ids must lie in [0, {vocab}); got {min(prompt_ids)}..{max(prompt_ids)}")
    pages = pool.allocate(pool.pages_for(total))
    try:
        start = time.perf_counter()
        for pos in range(0, len(prompt_ids), chunk):
            out = runner.forward([SequenceChunk(prompt_ids[pos:pos + chunk], pos, pages)], [params], [0])
        tokens = [int(out.next_tokens[0])]
        mid = time.perf_counter()
        while len(tokens) < max_tokens and tokens[-1] not in eos_ids:
            step = len(tokens)
            out = runner.forward([SequenceChunk([tokens[-1]], len(prompt_ids) + step - 1, pages)], [params], [step])
            tokens.append(int(out.next_tokens[0]))
        end = time.perf_counter()
    finally:
        pool.free(pages)
    finish = "stop" if tokens[-1] in eos_ids else "length"
    return Generation(tokens, finish, mid - start, end - mid)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m worker.generate", description=__doc__.split("\n\n")[0])
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
    params = SamplingParams(args.temperature, args.top_k, args.top_p, args.seed)
    params.validate()
    if args.max_tokens < 1:
        raise ValueError(f"--max-tokens must be >= 1, got {args.max_tokens}")
    tokenizer = ChatTokenizer(tokenizer_dir(model_dir))
    runner = start_runner(runner_config(args, model_dir))
    try:
        return _generate(args, runner, tokenizer, params)
    finally:
        runner.close()


def _generate(args: argparse.Namespace, runner: ModelRunner, tokenizer: ChatTokenizer,
              params: SamplingParams) -> int:
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
