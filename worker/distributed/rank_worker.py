"""Ranks 1..N-1: a ``ModelRunner`` holding this rank's experts, driven by the steps rank 0
broadcasts. Each rank runs the same forward on the same batch (its own KV pool, written alike),
meeting the others in the experts' all_reduce of every MoE layer; its outputs are dropped.

Start-up is in order: rank 0 loads first (it fills the shared expert store, if any), then sends
the sizes it resolved (KV pages, prefill chunk) so that every rank's pool and graphs match; the
ranks load (mapping the same store) and meet rank 0 at a barrier.
"""
from __future__ import annotations

import logging
import os
import signal
import sys
import time
from dataclasses import replace

import torch
import torch.distributed as dist

from moe_offload.experts import Experts
from worker.distributed.expert_parallel import ExpertParallel
from worker.distributed.group import RankGroup
from worker.distributed.placement import make_placement
from worker.distributed.processes import die_with_parent
from worker.distributed.rank_stats import ReduceClock, send_stats
from worker.distributed.step_message import HEADER_LEN, Op, decode
from worker.config import ModelConfig
from worker.errors import CheckpointError
from worker.runner import ModelRunner, RunnerConfig, torch_device

log = logging.getLogger("sluice.worker")

SIZES_LEN = 3  # [rank 0 loaded (1) or failed (0), kv_tokens, max_prefill_tokens]
KILL_ENV = "SLUICE_KILL_RANK"  # tests: "RANK:STEP" makes that rank SIGKILL itself before that step


class RankRunner(ModelRunner):
    """A runner of one rank of ``group``: its experts are the placement's (``--expert-placement``)."""

    def __init__(self, config: RunnerConfig, group: RankGroup):
        self.group = group
        self.reduce_clock = ReduceClock(group.all_reduce, timed=group.device.type != "cuda")
        super().__init__(config)

    def _check_model(self, cfg: ModelConfig) -> None:
        if cfg.is_hybrid:
            raise ValueError("--gpus N > 1 does not run hybrid models (linear-attention layers): the prefix cache "
                             "copies their state snapshots on rank 0's GPU only; run them with --gpus 1")

    def _this_rank(self, experts: Experts) -> Experts:
        cfg = self.model_config
        placement = make_placement(self.config.expert_placement, cfg.num_layers, cfg.num_experts, self.group.world)
        return ExpertParallel.wrap(experts, self.group.rank, placement, self.reduce_clock, self.device)

    def rank_stats(self) -> dict[str, int | float | str]:
        """This rank's experts' counters and its all_reduce time (where timed); reads the device."""
        return {**ModelRunner.stats(self), **self.reduce_clock.stats()}

    def reset_stats(self) -> None:
        super().reset_stats()
        self.reduce_clock.reset_stats()


def rank_device(config: RunnerConfig, rank: int) -> torch.device:
    """The device of ``rank``: GPU ``rank`` when the run is on CUDA, else the CPU."""
    device = torch_device(config)
    return torch.device("cuda", rank) if device.type == "cuda" else device


PEER_DEATH_GRACE_S = 5.0  # a failed rank's wait for rank 0 to end the run, before it reports itself


def rank_main(rank: int, world: int, address: str, config: RunnerConfig) -> None:
    """A spawned rank's whole life: join, load after rank 0, serve steps until STOP."""
    die_with_parent()
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s rank {rank} %(levelname)s %(message)s")
    group = RankGroup(rank, world, address, rank_device(config, rank))
    sizes = group.broadcast_host(torch.zeros(SIZES_LEN, dtype=torch.int64)).tolist()
    if not sizes[0]:  # rank 0 failed to load and says why itself
        return
    try:
        runner = RankRunner(replace(config, device=str(group.device), kv_tokens=sizes[1],
                                    max_prefill_tokens=sizes[2], routing=replace(config.routing, record=None)),
                            group)
    except (CheckpointError, ValueError, MemoryError) as err:
        print(f"error: rank {rank}: {err}", file=sys.stderr, flush=True)
        sys.exit(2)
    dist.barrier(group=group.control)
    try:
        serve_steps(runner, group, _kill_step(rank))
    except Exception as err:
        # A collective fails on every rank when one rank dies; rank 0's watcher then says which one
        # and kills the rest within PEER_DEATH_GRACE_S. A rank still alive after it failed for itself.
        time.sleep(PEER_DEATH_GRACE_S)
        print(f"error: rank {rank}: a step failed: {type(err).__name__}: {err}", file=sys.stderr, flush=True)
        sys.exit(1)
    group.close()


def serve_steps(runner: RankRunner, group: RankGroup, kill_at: int = -1) -> None:
    """Run what rank 0 sends until STOP. A failed step ends this rank (and so the run): rank 0
    cannot know where in the step the ranks fell out of step with each other."""
    token_buffer = None
    step = 0
    while True:
        head = group.broadcast_host(torch.zeros(HEADER_LEN, dtype=torch.int64)).tolist()
        op = Op(head[0])
        if op is Op.STOP:
            return
        if op is not Op.STEP:
            control(runner, group, op, head)
            continue
        message = decode(head, group.broadcast_host(torch.empty(head[2], dtype=torch.int64)))
        if message.buffer_len:
            if token_buffer is None or token_buffer.numel() != message.buffer_len:
                token_buffer = torch.zeros(message.buffer_len, dtype=torch.int64, device=runner.device)
            group.broadcast_device(token_buffer)
        if step == kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
        runner.forward(message.chunks, message.sampling, message.steps, token_buffer if message.buffer_len else None)
        step += 1


def control(runner: RankRunner, group: RankGroup, op: Op, head: list[int]) -> None:
    """Between steps: what rank 0 asks besides a step (its header is ``head``)."""
    if op is Op.CAPTURE_GRAPHS:
        runner.graphs.capture_all()
    elif op is Op.STATS:
        send_stats(group, runner.rank_stats(), expected=head[2])
    elif op is Op.RESET_STATS:
        runner.reset_stats()


def _kill_step(rank: int) -> int:
    spec = os.environ.get(KILL_ENV, "")
    if not spec:
        return -1
    target, step = (int(v) for v in spec.split(":"))
    return step if target == rank else -1
