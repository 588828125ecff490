"""What the scheduler process is built from, defaults declared once, here, without torch (the
command line's ``--help`` reads them):

    SchedulerConfig
      runner: worker.runner_config.RunnerConfig   the model, memory plan inputs, offload options
      engine: EngineConfig                         batching, prefix cache, KV tier policy
      warm_up, check_pages                         the process around them

Sizes (the prefill chunk, the host KV tier) are not here: the memory plan (``worker.memory_plan``)
resolves them from the runner's options, and the engine reads the plan.
"""
from __future__ import annotations

from dataclasses import dataclass

from worker.runner_config import RunnerConfig

KV_TIER_MODES = ("writeback", "writethrough")  # see scheduler.kv_tier
KV_TIER_COPIES = ("kernel", "memcpy")  # host<->GPU page moves: the zero-copy kernel, or a memcpy per run


@dataclass(frozen=True)
class EngineConfig:
    max_running: int = 64
    prefix_cache: bool = True
    overlap: bool = True
    # "writethrough" mirrors cached pages to the host as they enter (off the critical path); "writeback"
    # writes them when evicted, inside the admission that needs the room: on an H200 (qwen3-30b-geometry,
    # 25% experts, 6 sessions over 3x the pool) TTFT was 970 ms against 1401 ms (scripts/bench_kv_tier.py)
    kv_tier_mode: str = "writethrough"
    kv_tier_copy: str = "kernel"


@dataclass(frozen=True)
class SchedulerConfig:
    runner: RunnerConfig
    engine: EngineConfig = EngineConfig()
    warm_up: bool = True  # compile kernels and capture decode graphs before reporting ready
    check_pages: bool = False  # the KV page self-check after every step
