"""Prefill and decode tokens/s of a model through Sluice's engine (default: the embedded model).

    python scripts/bench_default_model.py [--model DIR] [--prompt-tokens 2048] [--batch 1 8 32]
"""
from __future__ import annotations

import time
from dataclasses import replace

import torch

from scheduler.engine import Engine, EngineConfig
from scheduler.request import Request
from worker.runner import ModelRunner, RunnerConfig
from scheduler.messages.to_scheduler import SamplingParams
from report_table import bench_parser, print_table, write_json  # beside this script

HBM_BYTES_PER_S = 4.3e12


def timed_run(engine: Engine, reqs: list[Request]) -> tuple[float, float]:
    """Seconds to the first token of every request (prefill) and for the rest (decode)."""
    sync = torch.cuda.synchronize if engine.device.type == "cuda" else (lambda: None)
    for r in reqs:
        engine.submit(r)
    sync()
    start = time.perf_counter()
    first = None
    while engine.has_work:
        engine.step()
        if first is None and all(r.output for r in reqs):
            sync()
            first = time.perf_counter()
    sync()
    return first - start, time.perf_counter() - first


def main() -> None:
    p = bench_parser(__doc__)
    p.add_argument("--model")
    p.add_argument("--prompt-tokens", type=int, default=2048)
    p.add_argument("--decode-tokens", type=int, default=128)
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--device", default="auto")
    args = p.parse_args()
    if args.model is None:
        from worker.default_model import default_model_dir
        args.model = str(default_model_dir())
    runner = ModelRunner(RunnerConfig(args.model, device=args.device, kv_tokens=(args.prompt_tokens + args.decode_tokens) * max(args.batch) + 4096))
    cfg = runner.model_config
    per_layer = sum(t.numel() * t.element_size() for t in vars(runner.weights.layers[0]).values() if t is not None)
    expert = runner.weights.experts.w13[0, 0].numel() * 3 // 2 * runner.weights.experts.w13.element_size()
    rows = []
    for batch in [1] + args.batch:  # the first run warms up
        engine = Engine(runner, EngineConfig(max_running=max(batch, 1), prefix_cache=False),
                        plan=replace(runner.plan, prefill_tokens=args.prompt_tokens * batch))
        gen = torch.Generator().manual_seed(batch)
        reqs = [Request(str(i), torch.randint(0, cfg.vocab_size, (args.prompt_tokens,), generator=gen).tolist(),
                        SamplingParams(), args.decode_tokens, frozenset(), ignore_eos=True) for i in range(batch)]
        prefill_s, decode_s = timed_run(engine, reqs)
        engine.check_pages()
        # decode reads the dense weights and each distinct routed expert once per step
        experts_read = min(cfg.num_experts, batch * cfg.top_k)
        step_bytes = cfg.num_layers * (per_layer + experts_read * expert) + runner.weights.lm_head.numel() * runner.weights.lm_head.element_size()
        decode_tps = batch * (args.decode_tokens - 1) / decode_s
        bound_tps = batch * HBM_BYTES_PER_S / step_bytes
        rows.append(dict(batch=batch, prefill_tok_s=batch * args.prompt_tokens / prefill_s, decode_tok_s=decode_tps,
                         decode_hbm_bound_tok_s=bound_tps, ratio=decode_tps / bound_tps))
    rows = rows[1:]
    print(f"model {args.model} on {runner.device} ({torch.cuda.get_device_name() if runner.device.type == 'cuda' else 'cpu'}), "
          f"{runner.dtype}, prompt {args.prompt_tokens}, decode {args.decode_tokens}")
    print_table([("batch", "batch", ">5"), ("prefill tok/s", "prefill_tok_s", ">14.0f"),
                 ("decode tok/s", "decode_tok_s", ">13.1f"), ("HBM bound tok/s", "decode_hbm_bound_tok_s", ">16.0f"),
                 ("ratio", "ratio", ">6.3f")], rows)
    write_json(args.json, rows)


if __name__ == "__main__":
    main()
