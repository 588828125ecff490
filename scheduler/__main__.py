"""``python -m scheduler``: the scheduler process (normally spawned by the frontend)."""
from __future__ import annotations

import argparse
import atexit
import logging
import os
import shutil
import signal
import sys
import time

from scheduler.engine import Engine, EngineConfig
from scheduler.faults import FaultHooks
from scheduler.kv_tier import MODES
from scheduler.messages.from_scheduler import ModelInfo
from scheduler.server import SchedulerServer
from scheduler.warmup import warm_up
from worker.cli_options import add_runner_args, resolve_model, runner_config
from worker.distributed.parallel_runner import start_runner
from worker.errors import CheckpointError
from worker.geometry_tokenizer import tokenizer_dir
from worker.kv.host_pool import DEFAULT_FRACTION, default_host_bytes
from worker.runner import ModelRunner

log = logging.getLogger("sluice.scheduler")

REMOVE_ON_EXIT_ENV = "SLUICE_REMOVE_ON_EXIT"  # set by frontend.launch: its socket dir and pid file


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
                   help="writethrough: mirror a prefix to the host when it enters the cache, so "
                        "eviction copies nothing; writeback: copy it when the GPU evicts it (on the critical path "
                        "of the admission that needs the room)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s scheduler %(levelname)s %(message)s")
    args = parse_args(argv)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the frontend stops us with Shutdown or SIGTERM
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # also sent when the frontend dies
    try:
        return serve(args)
    finally:
        _remove_frontend_files()


def _remove_frontend_files() -> None:
    """The frontend removes its socket dir and pid file when it stops; when it died instead, this
    is the process left to do it (a stale pid file would point py-spy at a dead process)."""
    for path in filter(None, os.environ.get(REMOVE_ON_EXIT_ENV, "").split(os.pathsep)):
        if os.path.isdir(path):
            shutil.rmtree(path, ignore_errors=True)
        elif os.path.exists(path):
            os.unlink(path)


def serve(args: argparse.Namespace) -> int:
    model_dir = resolve_model(args.model)
    tokenizer_path = str(tokenizer_dir(model_dir))  # a geometry's is written once, before the long model load
    log.info("loading the model %s (device %s) ...", model_dir, args.device)
    started = time.monotonic()
    try:
        if args.gpus > 1 and args.kv_host_size:
            raise ValueError("--kv-host-size needs --gpus 1: the host KV tier moves pages of rank 0's KV pool only, "
                             "and every rank keeps its own")
        runner = start_runner(runner_config(args, model_dir), args.gpus)
    except (CheckpointError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    log.info("model loaded in %.1f s", time.monotonic() - started)
    try:
        return _serve(args, runner, model_dir, tokenizer_path)
    finally:
        runner.close()


def _serve(args: argparse.Namespace, runner: ModelRunner, model_dir: str, tokenizer_path: str) -> int:
    atexit.register(runner.save_routing_record)  # at exit: after Shutdown, or SIGTERM (sys.exit)
    cfg = runner.model_config
    host_gib = args.kv_host_size
    if host_gib is None:  # on CPU the KV pool already lives in host RAM: a second copy buys nothing
        host_gib = default_host_bytes() / 2**30 if runner.device.type == "cuda" and args.gpus == 1 else 0.0
    engine = Engine(runner, EngineConfig(runner.max_prefill_tokens, args.max_running, args.prefix_cache, args.overlap,
                                         kv_host_gib=host_gib, kv_tier_mode=args.kv_tier_mode),
                    FaultHooks.from_env())
    if args.warm_up:
        warm_up(engine)
    info = ModelInfo(name=model_dir, tokenizer_path=tokenizer_path, max_context_tokens=cfg.max_context,
                     vocab_size=cfg.vocab_size, eos_token_ids=list(cfg.eos_token_ids))
    try:
        SchedulerServer(engine, info, args.frontend_to_scheduler, args.scheduler_to_frontend,
                        args.check_pages).serve_forever()
    finally:
        _note_expert_store(runner)
    return 0


def _note_expert_store(runner: ModelRunner) -> None:
    store = getattr(runner.experts, "store", None)
    if store is not None:
        log.info("the expert store %s (%.2f GB of RAM) stays in /dev/shm so that a restart maps it at once; "
                 "free it with: python scripts/expert_store.py remove %s", store.path, store.nbytes / 1e9, store.name)


if __name__ == "__main__":
    sys.exit(main())
