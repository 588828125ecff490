"""``python -m scheduler``: the scheduler process (normally spawned by the frontend)."""
from __future__ import annotations

import argparse
import logging
import signal
import sys

from scheduler.engine import Engine, EngineConfig
from scheduler.messages.from_scheduler import ModelInfo
from scheduler.server import SchedulerServer
from worker.errors import CheckpointError
from worker.runner import ModelRunner, RunnerConfig


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m scheduler", description=__doc__,
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter, allow_abbrev=False)
    p.add_argument("--frontend-to-scheduler", required=True, help="ZMQ endpoint to PULL requests from")
    p.add_argument("--scheduler-to-frontend", required=True, help="ZMQ endpoint to PUSH outputs to")
    p.add_argument("--model", default=None, help="checkpoint directory (default: the embedded default model)")
    p.add_argument("--device", default=RunnerConfig.device)
    p.add_argument("--dtype", default=RunnerConfig.dtype, choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--page-size", type=int, default=RunnerConfig.page_size)
    p.add_argument("--kv-tokens", type=int, default=RunnerConfig.kv_tokens,
                   help="KV pool size in tokens (0: from free memory on GPU, 16384 on CPU)")
    p.add_argument("--attention", default=RunnerConfig.attention)
    p.add_argument("--max-prefill-tokens", type=int, default=EngineConfig.max_prefill_tokens,
                   help="prompt tokens per step (chunked prefill budget)")
    p.add_argument("--max-running", type=int, default=EngineConfig.max_running, help="requests batched at once")
    p.add_argument("--no-prefix-cache", dest="prefix_cache", action="store_false", help="disable the radix cache")
    p.add_argument("--no-overlap", dest="overlap", action="store_false", help="disable overlap scheduling")
    p.add_argument("--check-pages", action="store_true", help="run the KV page self-check after every step")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s scheduler %(levelname)s %(message)s")
    args = parse_args(argv)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the frontend stops us with Shutdown or SIGTERM
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    model_dir = args.model
    if model_dir is None:
        from worker.default_model import default_model_dir

        model_dir = str(default_model_dir())
    try:
        runner = ModelRunner(RunnerConfig(model_dir, device=args.device, dtype=args.dtype, page_size=args.page_size,
                                          kv_tokens=args.kv_tokens, attention=args.attention))
    except (CheckpointError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    cfg = runner.model_config
    engine = Engine(runner, EngineConfig(args.max_prefill_tokens, args.max_running, args.prefix_cache, args.overlap))
    info = ModelInfo(name=model_dir, tokenizer_path=model_dir, max_context_tokens=cfg.max_context,
                     vocab_size=cfg.vocab_size, eos_token_ids=list(cfg.eos_token_ids))
    SchedulerServer(engine, info, args.frontend_to_scheduler, args.scheduler_to_frontend,
                    args.check_pages).serve_forever()
    return 0


if __name__ == "__main__":
    sys.exit(main())
