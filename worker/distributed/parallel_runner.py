"""Rank 0 of an expert-parallel run: the scheduler's (or ``scripts/generate.py``'s) own runner, which
starts the other ranks, sends each of them every step before running it, and stops them.

```
 rank 0 forward:  header, payload (gloo) -> token buffer (device group) -> forward (all_reduce per MoE layer)
 rank r loop:     header, payload        -> token buffer                -> forward (all_reduce per MoE layer)
```
"""
from __future__ import annotations

import contextlib
from dataclasses import replace

import torch
import torch.distributed as dist

from worker.batch import SequenceChunk
from worker.cuda_graph import DecodeGraphs
from worker.distributed import step_message
from worker.distributed.group import RankGroup, free_address
from worker.distributed.processes import RankProcesses
from worker.distributed.rank_stats import gather_stats, numeric
from worker.distributed.rank_worker import SIZES_LEN, RankRunner, rank_device, rank_main
from worker.runner import LaunchedStep, ModelRunner, RunnerConfig, torch_device
from worker.sampling import Sampling
from worker.token_mask import TokenMask


def start_runner(config: RunnerConfig) -> ModelRunner:
    """The runner of ``config.gpus``: one process, or rank 0 of that many expert-parallel ranks
    (call ``close`` at the end: it stops the ranks)."""
    gpus = config.gpus
    if gpus == 1:
        return ModelRunner(config)
    device = torch_device(config)
    if device.type == "cuda" and torch.cuda.device_count() < gpus:
        raise ValueError(f"--gpus {gpus} needs {gpus} CUDA devices; {torch.cuda.device_count()} are visible")
    return ParallelRunner(config, gpus)


class ParallelRunner(RankRunner):
    def __init__(self, config: RunnerConfig, world: int):
        address = free_address()
        self.processes = RankProcesses(world, rank_main, (world, address, config))
        group = RankGroup(0, world, address, rank_device(config, 0))
        try:
            super().__init__(replace(config, device=str(group.device)), group)
        except BaseException:
            self.processes.stopping.set()  # the ranks' exits are expected now
            group.broadcast_host(torch.zeros(SIZES_LEN, dtype=torch.int64))  # they leave at once
            self.processes.stop()
            group.close()
            raise
        self.in_step = False
        sizes = [1, (self.kv_pool.num_pages - 1) * self.page_size, self.plan.prefill_tokens]
        with self._collective():
            group.broadcast_host(torch.tensor(sizes, dtype=torch.int64))
            dist.barrier(group=group.control)  # every rank has loaded

    @torch.inference_mode()
    def launch(self, chunks: list[SequenceChunk], sampling: list[Sampling], steps: list[int],
               token_buffer: torch.Tensor | None = None, mask: TokenMask | None = None) -> LaunchedStep:
        """The other ranks run the whole step and sample unmasked: only rank 0's tokens are used
        (the token buffer is its); rank 0 samples when ``sample`` is called."""
        buffer_len = 0 if token_buffer is None else token_buffer.numel()
        head, payload = step_message.encode(step_message.Step(chunks, sampling, steps, buffer_len))
        self.in_step = True  # until the step returns: an exit half-way leaves the ranks mid-protocol
        with self._collective():
            self.group.broadcast_host(head)
            self.group.broadcast_host(payload)
            if token_buffer is not None:
                self.group.broadcast_device(token_buffer)
            out = super().launch(chunks, sampling, steps, token_buffer, mask)
        self.in_step = False
        return out

    def stats(self) -> dict[str, int | float | str]:
        """Rank 0's counters as one runner's (the totals as before), and every rank's as
        ``rank{r}.{key}`` (rank_stats); asks the ranks between steps, reads their devices. After
        ``close`` only rank 0's remain."""
        if self.processes.stopping.is_set():
            return super().stats()
        own = self.rank_stats()
        with self._collective():
            self.group.broadcast_host(step_message.header(step_message.Op.STATS, payload_len=len(numeric(own))))
            ranks = gather_stats(self.group, own)
        return {**super().stats(), **ranks}

    def reset_stats(self) -> None:
        with self._collective():
            self.group.broadcast_host(step_message.header(step_message.Op.RESET_STATS))
        super().reset_stats()

    def close(self) -> None:
        """Stop the other ranks (after the last step) and leave the process group."""
        if self.processes.stopping.is_set():
            return
        self.processes.stopping.set()
        if self.in_step:  # left mid-step (SIGTERM, an error): the ranks cannot take a STOP now
            self.processes.kill()
            return
        with self._collective():
            self.group.broadcast_host(step_message.header(step_message.Op.STOP))
        self.processes.stop()
        self.group.close()

    def _decode_graphs(self) -> DecodeGraphs | None:
        graphs = super()._decode_graphs()
        return None if graphs is None else AnnouncedGraphs(graphs, self._announce_capture)

    def _announce_capture(self) -> None:
        with self._collective():
            self.group.broadcast_host(step_message.header(step_message.Op.CAPTURE_GRAPHS))

    @contextlib.contextmanager
    def _collective(self):
        """A failed collective most likely means a rank died: the watcher then ends the run with
        the one clear error; anything else is raised as it came."""
        try:
            yield
        except RuntimeError:
            self.processes.wait_for_death()
            raise


class AnnouncedGraphs:
    """Rank 0's decode graphs: capturing them all first tells the other ranks to capture theirs
    (a capture runs the step's all_reduces, so every rank captures the same buckets in order).
    Everything else is the wrapped ``DecodeGraphs``."""

    def __init__(self, graphs: DecodeGraphs, announce):
        self.graphs, self.announce = graphs, announce

    def capture_all(self) -> None:
        self.announce()
        self.graphs.capture_all()

    def __getattr__(self, name: str):
        if name == "graphs":
            raise AttributeError(name)
        return getattr(self.graphs, name)
