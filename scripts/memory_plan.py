"""The memory plan a server would log, without a GPU: how the GPU memory free once the weights are
loaded splits into the expert cache, the KV pool and a prefill chunk's activations, for a model
under the serving options given.

    python scripts/memory_plan.py --gpu-free 29.13 --model qwen3-30b-geometry --dummy-weights \
        --moe-cache-auto --kv-reserve-tokens 140000 [--expert-dtype nvfp4] [--max-running 64 ...]

``--gpu-free`` is the figure a server logs as "memory plan (N GiB GPU free)" (a hybrid model's
state pool is allocated before it, so that figure is after it). The host KV tier is sized from this
machine's RAM, as a server sizes it from its own. The options are the scheduler's own
(``scheduler/cli_options.py``); the plan is ``worker.memory_plan.plan_memory``'s, as a runner on a
GPU makes it, with bf16 compute unless ``--dtype`` says otherwise.
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from scheduler.cli_options import engine_parser, scheduler_config  # noqa: E402
from worker.config import ModelConfig  # noqa: E402
from worker.device_memory import GIB  # noqa: E402
from worker.memory_plan import plan_memory  # noqa: E402
from worker.runner import expert_format, plan_inputs, torch_dtype  # noqa: E402


def main(argv: list[str] | None = None) -> None:
    parser = engine_parser()
    parser.add_argument("--gpu-free", type=float, required=True, metavar="GiB",
                        help="GPU memory free once the weights are loaded (a server logs it with its plan)")
    args = parser.parse_args(argv)
    config = scheduler_config(args).runner
    cfg, cuda = ModelConfig.from_dir(config.model_dir), torch.device("cuda")
    dtype = torch_dtype(config, cuda)
    fmt = expert_format(cfg, config, dtype)
    plan = plan_memory(plan_inputs(cfg, config, fmt, dtype, cuda, int(args.gpu_free * GIB), 0), cfg, config)
    print(f"{config.model_dir}, {fmt.name} experts, --max-running {config.state_slots}")
    print(plan.table(cfg.num_layers * cfg.num_experts, f"{fmt.name} experts, policy {config.experts.policy}"))


if __name__ == "__main__":
    main()
