"""Where a benchmark's GPU time goes: the kernels that a piece of work launches (torch.profiler sees
those inside replayed CUDA graphs too), the GPU-busy time as the union of their intervals, and each
kernel's share of it. Under PDL (``triton_support.pdl_args``) a kernel starts while the one before
it runs and waits for it, so its own interval overstates it; the busy time it adds past the
kernels before it does not, and those shares add up to the busy time."""
from __future__ import annotations

from typing import Callable

import torch

Span = tuple[str, float, float]  # a kernel's name, start and end (microseconds)


def cuda_kernels(run: Callable[[], None]) -> list[Span]:
    """The kernels ``run`` launches, from its start until the GPU is idle after it (on a machine
    without a GPU: none)."""
    from torch.profiler import ProfilerActivity, profile

    activity = ProfilerActivity.CUDA if torch.cuda.is_available() else ProfilerActivity.CPU
    with profile(activities=[activity]) as prof:
        run()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    return [(e.name, e.time_range.start, e.time_range.end) for e in prof.events()
            if e.device_type == torch.autograd.DeviceType.CUDA]


def busy_us(intervals: list[tuple[float, float]]) -> float:
    """The length of the union of ``[start, end)`` intervals."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total


def added_us(kernels: list[Span]) -> list[float]:
    """What each kernel ``(name, start, end)`` adds to the busy time: the part of its interval past
    the end of every interval that starts before it (its own order kept; they sum to ``busy_us``)."""
    added, reach = [0.0] * len(kernels), float("-inf")
    for i in sorted(range(len(kernels)), key=lambda i: kernels[i][1:]):
        start, end = kernels[i][1:]
        if end > reach:
            added[i] = end - max(start, reach)
            reach = end
    return added


def top_kernels(kernels: list[Span], top: int, per: float = 1.0) -> list[list]:
    """The ``top`` kernel names by the busy time they add, each as ``[name, launches, microseconds
    run, microseconds added]``, every figure divided by ``per`` (e.g. the steps profiled)."""
    by_name: dict[str, list[float]] = {}
    for (name, start, end), added in zip(kernels, added_us(kernels)):
        count_us = by_name.setdefault(name, [0, 0.0, 0.0])
        count_us[0] += 1
        count_us[1] += end - start
        count_us[2] += added
    ranked = sorted(by_name.items(), key=lambda kv: -kv[1][2])[:top]
    return [[name, n / per, us / per, add / per] for name, (n, us, add) in ranked]


def print_top_kernels(title: str, ranked: list[list]) -> None:
    print(f"\n{title}")
    print(f"  {'adds us':>9} {'runs us':>9} {'launches':>8}  (adds: the busy time past the kernels before it)")
    for name, launches, us, adds in ranked:
        print(f"  {adds:9.1f} {us:9.1f} {launches:7.1f}x  {name[:100]}")
