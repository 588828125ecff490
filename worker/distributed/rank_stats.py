"""Every rank's expert counters, brought to rank 0 when the server asks for stats (between steps,
where reading counters is allowed), never during a step: rank 0 sends a STATS header on the
control group, each rank answers with its numeric counters in one float64 host tensor, and rank 0
gathers them.

```
 rank 0 stats():  header STATS (K values) --> gather [K] from every rank --> rank{r}.{key}
 rank r loop:     header STATS            --> its K numeric counters, sorted by key
```

Every rank runs the same code on the same steps, so the ranks' counters have the same keys;
rank 0 tells the count, and a rank with another count fails loudly (a bug, never an input).
"""
from __future__ import annotations

import time
from typing import Callable

import torch
import torch.distributed as dist

from worker.distributed.group import RankGroup

Stats = dict[str, int | float]


def numeric(stats: dict) -> Stats:
    """The counters a rank answers with: numbers only (no policy names), sorted by key."""
    return {k: v for k, v in sorted(stats.items()) if isinstance(v, (int, float)) and not isinstance(v, bool)}


def send_stats(group: RankGroup, stats: dict, expected: int) -> None:
    """On rank r > 0: answer a STATS header that announced ``expected`` values."""
    values = list(numeric(stats).values())
    if len(values) != expected:
        raise ValueError(f"rank {group.rank} has {len(values)} counters, rank 0 has {expected}")
    dist.gather(torch.tensor(values, dtype=torch.float64), dst=0, group=group.control)


def gather_stats(group: RankGroup, own: dict) -> Stats:
    """On rank 0, after its STATS header: every rank's counters as ``rank{r}.{key}`` (rank 0's
    own included, so that each rank is one series), and ``ranks``, the world size."""
    mine = numeric(own)
    answers = [torch.zeros(len(mine), dtype=torch.float64) for _ in range(group.world)]
    dist.gather(torch.tensor(list(mine.values()), dtype=torch.float64), gather_list=answers, dst=0,
                group=group.control)
    out: Stats = {"ranks": group.world}
    for rank, values in enumerate(answers):
        out.update({f"rank{rank}.{key}": type(like)(value)
                    for (key, like), value in zip(mine.items(), values.tolist())})
    return out


class ReduceClock:
    """The experts' all_reduce, timed on the host where the call returns when the sum is done
    (gloo on host tensors). On CUDA, NCCL only enqueues the reduce: a host clock would time the
    launch, and events would need their own read; so a CUDA run reports no all_reduce time."""

    def __init__(self, reduce: Callable[[torch.Tensor], torch.Tensor], timed: bool):
        self.reduce, self.timed = reduce, timed
        self.seconds, self.calls = 0.0, 0

    def __call__(self, tensor: torch.Tensor) -> torch.Tensor:
        if not self.timed:
            return self.reduce(tensor)
        start = time.perf_counter()
        out = self.reduce(tensor)
        self.seconds += time.perf_counter() - start
        self.calls += 1
        return out

    def stats(self) -> Stats:
        return {"all_reduce_s": self.seconds, "all_reduces": self.calls} if self.timed else {}

    def reset_stats(self) -> None:
        self.seconds, self.calls = 0.0, 0
