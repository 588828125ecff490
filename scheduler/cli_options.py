"""The scheduler process's command-line options: the runner's groups (``worker.cli_options``) and
the scheduler's own (scheduler, KV tier), defaults read from ``scheduler.config``. Torch is not
imported here, so ``--help`` answers at once.

``python -m scheduler.cli_options`` prints the engine options' help alone: the frontend's
``--help`` (and so ``scripts/serve.sh --help``) appends it to its own."""
from __future__ import annotations

import argparse
from dataclasses import replace

from scheduler.config import KV_TIER_COPIES, KV_TIER_MODES, EngineConfig, SchedulerConfig
from worker.cli_options import add_runner_args, config_fields, resolve_model, runner_config

E, S = EngineConfig, SchedulerConfig


def engine_parser() -> argparse.ArgumentParser:
    """Every option the scheduler takes from the frontend's command line, in groups, no ``-h``."""
    p = argparse.ArgumentParser(add_help=False, usage=argparse.SUPPRESS, allow_abbrev=False,
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    _add_scheduler_args(p.add_argument_group("scheduler", "batching, the prefix cache and the process"))
    add_runner_args(p)
    _add_kv_tier_args(p.add_argument_group("KV tier", "host-RAM KV pages beside the GPU pool (its size: "
                                                      "--kv-host-size, under 'memory')"))
    return p


def _add_scheduler_args(g: argparse._ArgumentGroup) -> None:
    g.add_argument("--max-running", type=int, default=E.max_running, metavar="N", help="requests batched at once")
    g.add_argument("--no-prefix-cache", dest="prefix_cache", action="store_false",
                   help="disable the radix prefix cache (it is on: %(default)s)")
    g.add_argument("--no-overlap", dest="overlap", action="store_false",
                   help="disable overlap scheduling (it is on: %(default)s)")
    g.add_argument("--no-warm-up", dest="warm_up", action="store_false",
                   help="report ready without compiling kernels and capturing decode graphs first (the first "
                        "requests then pay for it; warm-up is on: %(default)s)")
    g.add_argument("--check-pages", action="store_true", help="run the KV page self-check after every step")


def _add_kv_tier_args(g: argparse._ArgumentGroup) -> None:
    g.add_argument("--kv-tier-mode", default=E.kv_tier_mode, choices=KV_TIER_MODES,
                   help="writethrough: mirror a prefix to the host when it enters the cache, so "
                        "eviction copies nothing; writeback: copy it when the GPU evicts it (on the critical path "
                        "of the admission that needs the room)")
    g.add_argument("--kv-tier-copy", default=E.kv_tier_copy, choices=KV_TIER_COPIES,
                   help="how pages move between host and GPU: kernel (one zero-copy launch per move) or memcpy "
                        "(a copy-engine memcpy per run of contiguous pages)")


def scheduler_config(args: argparse.Namespace) -> SchedulerConfig:
    """The ``SchedulerConfig`` of parsed ``args``; resolves ``--model`` (None: the default model,
    built on first use). ValueError: options that cannot go together."""
    engine = EngineConfig(**config_fields(args, EngineConfig))
    runner = replace(runner_config(args, resolve_model(args.model)), state_slots=engine.max_running)
    return SchedulerConfig(runner, engine, **config_fields(args, SchedulerConfig))


if __name__ == "__main__":
    print(engine_parser().format_help(), end="")
