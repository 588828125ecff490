"""What quantizing the experts at fill costs a model: the default model (or ``--model``) with its
experts in bf16 (the reference: the checkpoint's own weights) against each ``--formats`` format
(fp8 128x128, nvfp4, mxfp4), resident, on the CPU in float32, so that only the experts' format
differs. Per prompt: the relative L2 error of the logits after the prompt, and how many of 64
greedy tokens equal the reference's (free-running: the count at equal positions, and the first
position where they part). A report, not a bound: small models lose more than large ones.
``--kv-fp8`` adds a row for what ``--kv-cache-dtype fp8`` costs: bf16 experts over a KV pool of
float8 e4m3.

    python scripts/quant_quality.py [--model DIR] [--formats fp8 nvfp4 mxfp4] [--kv-fp8] [--tokens 64] [--threads 1]
        [--json FILE]
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from frontend.tokenizer import ChatTokenizer  # noqa: E402
from moe_offload.experts import ExpertBanks  # noqa: E402
from moe_offload.formats import dequantize_w13, room_of  # noqa: E402
from scheduler.generate import generate  # noqa: E402
from scheduler.messages.to_scheduler import SamplingParams  # noqa: E402
from worker.batch import SequenceChunk  # noqa: E402
from worker.expert_placement import ExpertOptions  # noqa: E402
from worker.runner import ModelRunner, RunnerConfig  # noqa: E402
from report_table import bench_parser, print_table, write_json  # noqa: E402  (beside this script)

PROMPTS = ["What is the capital of France?", "Write a haiku about rivers.", "def fibonacci(n):",
           "Explain why the sky is blue in two sentences.", "List three uses of a paperclip:"]
GREEDY = SamplingParams()


def runner_for(model: str, expert_dtype: str, kv_cache_dtype: str = "auto") -> ModelRunner:
    """Resident experts in ``expert_dtype``, then expanded once to the float32 values they hold: the
    eager twin computes with exactly those, but would expand each used expert at every step."""
    runner = ModelRunner(RunnerConfig(model, device="cpu", dtype="float32", kv_tokens=4096,
                                      kv_cache_dtype=kv_cache_dtype, experts=ExpertOptions(expert_dtype=expert_dtype)))
    runner.experts.banks = dequantized(runner.experts.banks)
    return runner


def dequantized(banks: ExpertBanks) -> ExpertBanks:
    fmt = banks.format
    if fmt.family == "float":
        return banks
    w13 = [banks.w13, *(t for t in (banks.w13_scale, banks.w13_channel_scale) if t is not None)]
    w2 = [banks.w2, *(t for t in (banks.w2_scale, banks.w2_channel_scale) if t is not None)]
    layers = range(banks.num_layers)
    return ExpertBanks(torch.stack([dequantize_w13(fmt, tuple(t[i] for t in w13), torch.float32) for i in layers]),
                       torch.stack([room_of(fmt).dequantize(fmt, tuple(t[i] for t in w2), torch.float32)
                                    for i in layers]))


def last_logits(runner: ModelRunner, ids: list[int]) -> torch.Tensor:
    pages = runner.kv_pool.allocate(runner.kv_pool.pages_for(len(ids)))
    try:
        return runner.forward([SequenceChunk(ids, 0, pages)], [GREEDY], [0]).logits[0].float()
    finally:
        runner.kv_pool.free(pages)


def measure(runner: ModelRunner, prompts: list[list[int]], tokens: int) -> list[tuple[torch.Tensor, list[int]]]:
    return [(last_logits(runner, ids), generate(runner, ids, GREEDY, tokens).token_ids) for ids in prompts]


def compare(name: str, got: list, want: list, tokens: int) -> dict:
    errors, equal, parted = [], [], []
    for (logits, ids), (ref_logits, ref_ids) in zip(got, want):
        errors.append(((logits - ref_logits).norm() / ref_logits.norm()).item())
        equal.append(sum(a == b for a, b in zip(ids, ref_ids)))
        parted.append(next((i for i, (a, b) in enumerate(zip(ids, ref_ids)) if a != b), tokens))
    return dict(format=name, rel_logit_err=sum(errors) / len(errors), max_rel_logit_err=max(errors),
                greedy_equal=sum(equal) / (tokens * len(got)), first_parting=sum(parted) / len(parted),
                per_prompt_equal=equal, per_prompt_parting=parted)


def main() -> None:
    p = bench_parser(__doc__)
    p.add_argument("--model", default=None, help="checkpoint directory (default: the default model)")
    p.add_argument("--formats", nargs="+", default=["fp8", "nvfp4", "mxfp4"])
    p.add_argument("--kv-fp8", action="store_true", help="also a row of bf16 experts over a float8 e4m3 KV pool")
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    if args.model is None:
        from worker.default_model import default_model_dir

        args.model = str(default_model_dir())
    torch.manual_seed(0)
    torch.set_num_threads(args.threads)  # a 135M model on a shared CPU: more threads mostly wait on each other
    tok = ChatTokenizer.from_dir(args.model)
    prompts = [tok.encode_chat([{"role": "user", "content": text}]) for text in PROMPTS]
    reference = measure(runner_for(args.model, "bf16"), prompts, args.tokens)
    rows = [compare(fmt, measure(runner_for(args.model, fmt), prompts, args.tokens), reference, args.tokens)
            for fmt in args.formats]
    if args.kv_fp8:
        fp8_kv = runner_for(args.model, "bf16", kv_cache_dtype="fp8")
        rows.append(compare("fp8 KV", measure(fp8_kv, prompts, args.tokens), reference, args.tokens))
    print(f"expert formats (and --kv-fp8) vs bf16 experts, {Path(args.model).name}, {len(prompts)} prompts, {args.tokens} greedy "
          f"tokens, CPU float32")
    print_table([("format", "format", ">7"), ("rel logit err", "rel_logit_err", ">13.4f"),
                 ("max", "max_rel_logit_err", ">7.4f"), ("greedy equal", "greedy_equal", ">12.3f"),
                 ("first parting", "first_parting", ">13.1f")], rows)
    for row in rows:
        print(f"{row['format']}: equal tokens per prompt {row['per_prompt_equal']}, parting at {row['per_prompt_parting']}")
    write_json(args.json, rows)


if __name__ == "__main__":
    main()
