"""One config chain from the command line (RunnerConfig ⊂ SchedulerConfig): every option sets the
field of its name, the defaults are the config classes', the choices the modules' own names, and
``python -m frontend --help`` lists every option once, grouped, with defaults, without torch."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import fields, is_dataclass
from pathlib import Path

import pytest

from moe_offload import choices
from scheduler.cli_options import engine_parser, scheduler_config
from scheduler.config import KV_TIER_COPIES, KV_TIER_MODES, SchedulerConfig
from worker.runner_config import ATTENTION_BACKENDS, DTYPES, KV_CACHE_DTYPES, RunnerConfig

ROOT = Path(__file__).resolve().parents[1]
GROUPS = ["server", "scheduler", "model", "memory", "offload", "KV tier"]
EVERY_OPTION_CHANGED = [
    "--model", "m", "--device", "cpu", "--dtype", "float16", "--page-size", "8", "--attention", "torch",
    "--no-cuda-graph", "--cuda-graph-max-batch", "8", "--dummy-weights", "--seed-weights", "3",
    "--gpu-memory-limit", "20", "--moe-cache-size", "64", "--kv-reserve-tokens", "100", "--kv-tokens", "512",
    "--kv-cache-dtype", "fp8",
    "--max-prefill-tokens", "256", "--kv-host-size", "2", "--state-snapshots", "5", "--moe-policy", "lru",
    "--no-prefill-pipeline",
    "--prefill-invalidate", "eager", "--prefill-stage", "memcpy", "--expert-dtype", "fp8", "--lent-slots", "reserve",
    "--expert-prefetch", "on", "--expert-prefetch-cap", "2", "--expert-fill", "gather",
    "--routing", "synthetic", "--record-routing", "t.pt", "--record-routing-tokens", "9",
    "--max-running", "4", "--no-prefix-cache", "--no-overlap", "--no-warm-up", "--check-pages",
    "--kv-tier-mode", "writeback", "--kv-tier-copy", "memcpy"]


def config(*argv: str) -> SchedulerConfig:
    return scheduler_config(engine_parser().parse_args(list(argv)))


def leaves(obj, prefix: str = "") -> dict:
    """Every field of a config chain by its dotted path."""
    out = {}
    for f in fields(obj):
        value = getattr(obj, f.name)
        out.update(leaves(value, f"{prefix}{f.name}.") if is_dataclass(value) else {prefix + f.name: value})
    return out


def test_defaults_are_the_config_classes():
    assert config("--model", "m") == SchedulerConfig(RunnerConfig("m"))


def test_every_field_is_set_by_its_option():
    default, changed = leaves(config("--model", "m")), leaves(config(*EVERY_OPTION_CHANGED))
    same = {path for path in default if default[path] == changed[path]}
    # the other two cache sizes exclude --moe-cache-size, --gpus above 1 excludes --kv-host-size (and so
    # --expert-placement, which needs it); model_dir is the one field both name "m"
    assert same == {"runner.model_dir", "runner.experts.cache_fraction", "runner.experts.cache_auto", "runner.gpus",
                    "runner.expert_placement"}
    assert config("--moe-cache-fraction", "0.5").runner.experts.cache_fraction == 0.5
    assert config("--moe-cache-auto").runner.experts.cache_auto
    assert config("--gpus", "2").runner.gpus == 2
    assert config("--gpus", "2", "--expert-placement", "popularity:f").runner.expert_placement == "popularity:f"
    with pytest.raises(ValueError, match="--expert-placement 'hot' is not one of round-robin, popularity:FILE"):
        config("--gpus", "2", "--expert-placement", "hot")
    with pytest.raises(ValueError, match="--kv-host-size needs --gpus 1"):
        config("--gpus", "2", "--kv-host-size", "1")
    with pytest.raises(ValueError, match="--expert-prefetch-cap 2: .* with --expert-prefetch on"):
        config("--model", "m", "--expert-prefetch-cap", "2")  # the cap of a prefetch that is off
    with pytest.raises(ValueError, match="--expert-prefetch-cap -1"):
        config("--model", "m", "--expert-prefetch", "on", "--expert-prefetch-cap", "-1")
    assert changed["runner.experts.seed"] == changed["runner.routing.seed"] == 3  # --seed-weights seeds both


def test_choices_are_the_modules_own_names():
    by_option = {a.option_strings[0]: a.choices for a in engine_parser()._actions if a.choices}
    assert by_option == {"--dtype": DTYPES, "--attention": ["auto", *ATTENTION_BACKENDS],
                         "--kv-cache-dtype": KV_CACHE_DTYPES,
                         "--moe-policy": choices.POLICIES, "--prefill-invalidate": choices.INVALIDATE_MODES,
                         "--prefill-stage": choices.STAGE_MODES, "--expert-dtype": choices.EXPERT_DTYPES,
                         "--lent-slots": choices.LENT_SLOT_RULES, "--expert-fill": choices.FILL_MODES,
                         "--kv-tier-mode": KV_TIER_MODES,
                         "--kv-tier-copy": KV_TIER_COPIES}


def test_cache_sizes_are_exclusive_in_one_place():
    with pytest.raises(ValueError, match="--moe-cache-size and --moe-cache-auto are mutually exclusive"):
        config("--moe-cache-size", "4", "--moe-cache-auto")


def test_scheduler_refuses_exclusive_options_in_one_line_before_torch():
    done = subprocess.run([sys.executable, "-X", "importtime", "-m", "scheduler", "--frontend-to-scheduler", "x",
                           "--scheduler-to-frontend", "y", "--model", "m", "--moe-cache-size", "4",
                           "--moe-cache-fraction", "0.5"], capture_output=True, text=True, cwd=ROOT, env=_env())
    assert done.returncode == 2
    assert "error: --moe-cache-size and --moe-cache-fraction are mutually exclusive" in done.stderr
    assert not _torch_imported(done.stderr)


def test_help_lists_every_option_once_grouped_with_defaults_without_torch():
    """The frontend's --help appends the scheduler's options (a child process); both run under the
    import profiler, and neither may import torch."""
    done = subprocess.run([sys.executable, "-m", "frontend", "--help"], capture_output=True, text=True, cwd=ROOT,
                          env={**_env(), "PYTHONPROFILEIMPORTTIME": "1"}, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "scheduler.config" in done.stderr  # the child's imports were profiled too
    assert not _torch_imported(done.stderr)
    text = done.stdout
    titles = re.findall(r"^(\S[^:\n]*):\n", text, re.M)
    assert titles == ["options", *GROUPS]
    listed = re.findall(r"^  (-{1,2}[\w-]+)", text, re.M)
    engine = engine_parser()._actions
    assert len(listed) == len(set(listed))  # each option once
    assert {a.option_strings[0] for a in engine} | {"-h", "--endpoint", "--http-port", "--api-key"} <= set(listed)
    blocks = dict(zip(listed, re.split(r"^  -{1,2}[\w-]+", text, flags=re.M)[1:]))
    for action in engine:
        if action.default not in (None, True, False):
            assert f"(default: {action.default})" in " ".join(blocks[action.option_strings[0]].split())


def test_scheduler_help_is_quick_without_torch():
    done = subprocess.run([sys.executable, "-X", "importtime", "-m", "scheduler", "--help"], capture_output=True,
                          text=True, cwd=ROOT, env=_env(), timeout=60)
    assert done.returncode == 0 and "--frontend-to-scheduler" in done.stdout
    assert "worker.cli_options" in done.stderr and not _torch_imported(done.stderr)


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (str(ROOT), os.environ.get("PYTHONPATH"))))}


def _torch_imported(importtime: str) -> bool:
    return re.search(r"\|\s+torch$", importtime, re.M) is not None
