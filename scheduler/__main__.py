"""``python -m scheduler``: the scheduler process (normally spawned by the frontend)."""
from __future__ import annotations

import argparse
import atexit
import logging
import signal
import sys

from scheduler.engine import Engine, EngineConfig
from scheduler.kv_tier import MODES
from scheduler.messages.from_scheduler import ModelInfo
from scheduler.server import SchedulerServer
from scheduler.warmup import warm_up
from worker.errors import CheckpointError
from worker.host_kv_pool import DEFAULT_FRACTION, default_host_bytes
from worker.cli_options import add_runner_args, resolve_model, runner_config
from worker.geometry_tokenizer import tokenizer_dir
from worker.runner import ModelRunner


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m scheduler", description=__doc__,
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter, allow_abbrev=False)
    p.add_argument("--frontend-to-scheduler", required=True, help="ZMQ endpoint to PULL requests from")
    p.add_argument("--scheduler-to-frontend", required=True, help="ZMQ endpoint to PUSH outputs to")
    add_runner_args(p)
    p.add_argument("--max-running", type=int, default=EngineConfig.max_running, help="requests batched at once")
    p.add_argument("--no-prefix-cache", dest="prefix_cache", action="store_false", help="disable the radix prefix cache (it is on: %(default)s)")
    p.add_argument("--no-overlap", dest="overlap", action="store_false", help="disable overlap scheduling (it is on: %(default)s)")
    p.add_argument("--no-warm-up", dest="warm_up", action="store_false",
                   help="report ready without compiling kernels and capturing decode graphs first (the first "
                        "requests then pay for it)")
    p.add_argument("--check-pages", action="store_true", help="run the KV page self-check after every step")
    p.add_argument("--kv-host-size", type=float, default=None, metavar="GiB",
                   help=f"host-RAM KV tier in GiB; 0 disables it; None: {DEFAULT_FRACTION * 100:.0f}%% of the "
                        "host RAM available once the model is loaded (on GPU; 0 on CPU)")
    p.add_argument("--kv-tier-mode", default=EngineConfig.kv_tier_mode, choices=list(MODES),
                   help="writethrough (default): mirror a prefix to the host when it enters the cache, so "
                        "eviction copies nothing; writeback: copy it when the GPU evicts it (on the critical path "
                        "of the admission that needs the room)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s scheduler %(levelname)s %(message)s")
    args = parse_args(argv)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the frontend stops us with Shutdown or SIGTERM
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    model_dir = resolve_model(args.model)
    tokenizer_path = str(tokenizer_dir(model_dir))  # a geometry's is written once, before the long model load
    try:
        runner = ModelRunner(runner_config(args, model_dir))
    except (CheckpointError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    atexit.register(runner.save_routing_record)  # at exit: after Shutdown, or SIGTERM (sys.exit)
    cfg = runner.model_config
    host_gib = args.kv_host_size
    if host_gib is None:  # on CPU the KV pool already lives in host RAM: a second copy buys nothing
        host_gib = default_host_bytes() / 2**30 if runner.device.type == "cuda" else 0.0
    engine = Engine(runner, EngineConfig(runner.max_prefill_tokens, args.max_running, args.prefix_cache, args.overlap,
                                         kv_host_gib=host_gib, kv_tier_mode=args.kv_tier_mode))
    if args.warm_up:
        warm_up(engine)
    info = ModelInfo(name=model_dir, tokenizer_path=tokenizer_path, max_context_tokens=cfg.max_context,
                     vocab_size=cfg.vocab_size, eos_token_ids=list(cfg.eos_token_ids))
    SchedulerServer(engine, info, args.frontend_to_scheduler, args.scheduler_to_frontend,
                    args.check_pages).serve_forever()
    return 0


if __name__ == "__main__":
    sys.exit(main())
