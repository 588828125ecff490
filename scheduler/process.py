"""The scheduler process's life once its ``SchedulerConfig`` is built: load the model (the runner
makes and logs the memory plan), warm up, serve until shutdown."""
from __future__ import annotations

import atexit
import logging
import sys
import time

from scheduler.config import SchedulerConfig
from scheduler.engine import Engine
from scheduler.faults import FaultHooks
from scheduler.messages.from_scheduler import ModelInfo
from scheduler.server import SchedulerServer
from scheduler.warmup import warm_up
from worker.distributed.parallel_runner import start_runner
from worker.errors import CheckpointError
from worker.geometry_tokenizer import tokenizer_dir
from worker.runner import ModelRunner

log = logging.getLogger("sluice.scheduler")


def serve(config: SchedulerConfig, pull_endpoint: str, push_endpoint: str) -> int:
    """Serve the frontend at its endpoints until it shuts us down; the exit code (2: the model
    refused to load)."""
    runner = _load(config)
    if runner is None:
        return 2
    try:
        return _serve(config, runner, pull_endpoint, push_endpoint)
    finally:
        runner.close()  # an expert-parallel rank 0 stops the other ranks


def _serve(config: SchedulerConfig, runner: ModelRunner, pull_endpoint: str, push_endpoint: str) -> int:
    engine = Engine(runner, config.engine, FaultHooks.from_env())
    if config.warm_up:
        warm_up(engine)
    cfg, model_dir = runner.model_config, config.runner.model_dir
    info = ModelInfo(name=model_dir, tokenizer_path=str(tokenizer_dir(model_dir)), max_context_tokens=cfg.max_context,
                     vocab_size=cfg.vocab_size, eos_token_ids=list(cfg.eos_token_ids))
    try:
        SchedulerServer(engine, info, pull_endpoint, push_endpoint, config.check_pages).serve_forever()
    finally:
        _note_expert_store(runner)
    return 0


def _load(config: SchedulerConfig) -> ModelRunner | None:
    """The ModelRunner (rank 0 of ``--gpus`` ranks), or None after printing why it cannot load."""
    tokenizer_dir(config.runner.model_dir)  # a geometry's is written once, before the long model load
    log.info("loading the model %s (device %s) ...", config.runner.model_dir, config.runner.device)
    started = time.monotonic()
    try:
        runner = start_runner(config.runner)
    except (CheckpointError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return None
    log.info("model loaded in %.1f s", time.monotonic() - started)
    atexit.register(runner.save_routing_record)  # at exit: after Shutdown, or SIGTERM (sys.exit)
    return runner


def _note_expert_store(runner: ModelRunner) -> None:
    store = getattr(runner.experts, "store", None)
    if store is not None:
        log.info("the expert store %s (%.2f GB of RAM) stays in /dev/shm so that a restart maps it at once; "
                 "free it with: python scripts/expert_store.py remove %s", store.path, store.nbytes / 1e9, store.name)
