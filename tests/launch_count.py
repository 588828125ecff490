"""Counts the device launches of a piece of work on the CPU, so a test can pin a decode step's
kernels per layer without a GPU.

The work runs with the Triton kernels interpreted (``TRITON_INTERPRET=1``, ``SLUICE_KERNELS=
triton``): each kernel launch counts one, by its name; every aten op that would launch a kernel on
a GPU counts one too (views and allocations launch nothing). The interpreter's own tensor copies
inside a launch are not counted. A cuBLAS matmul counts one here though it may be two kernels on a
GPU (split-K), so this is the glue's count, not the profiler's.

``sync_errors`` is its GPU counterpart for the hot-path rule: the block runs under
``set_sync_debug_mode("error")``, so a hidden device-to-host sync raises.
"""
from __future__ import annotations

import contextlib
from collections import Counter
from typing import Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode

_aten = torch.ops.aten
# ops that allocate or relabel without touching device memory
_NO_KERNEL = {_aten.empty, _aten.empty_like, _aten.empty_strided, _aten.new_empty, _aten.new_empty_strided,
              _aten.lift_fresh, _aten.detach, _aten.alias, _aten.sym_size, _aten.sym_stride, _aten.sym_numel}


def launches_kernel(func: torch._ops.OpOverload) -> bool:
    """Whether ``func`` launches a kernel on a GPU: not an allocation, not a view (an op whose
    result aliases its input without writing it)."""
    if func.overloadpacket in _NO_KERNEL:
        return False
    return not any(r.alias_info is not None and not r.alias_info.is_write for r in func._schema.returns)


class LaunchCounter(TorchDispatchMode):
    """``launches``: ``"aten.<op>"`` or ``"triton.<kernel>"`` -> launches seen."""

    def __init__(self):
        super().__init__()
        self.launches: Counter[str] = Counter()
        self.inside_kernel = 0  # > 0 while the interpreter runs a Triton kernel

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not self.inside_kernel and launches_kernel(func):
            self.launches[f"aten.{func.overloadpacket.__name__}"] += 1
        return func(*args, **(kwargs or {}))

    @property
    def total(self) -> int:
        return sum(self.launches.values())


@contextlib.contextmanager
def count_launches() -> Iterator[LaunchCounter]:
    """Count the launches of the work inside the block (Triton kernels must be interpreted)."""
    from triton.runtime.interpreter import InterpretedFunction

    counter = LaunchCounter()
    original = InterpretedFunction.run

    def run(kernel, *args, grid, warmup, **kwargs):
        if not warmup:
            counter.launches[f"triton.{kernel.__name__}"] += 1
        counter.inside_kernel += 1
        try:
            return original(kernel, *args, grid=grid, warmup=warmup, **kwargs)
        finally:
            counter.inside_kernel -= 1

    InterpretedFunction.run = run
    try:
        with counter:
            yield counter
    finally:
        InterpretedFunction.run = original


class sync_errors:
    """``torch.cuda.set_sync_debug_mode("error")`` for the block (when ``on``); back to "default"
    after it."""

    def __init__(self, on: bool = True):
        self.on = on

    def __enter__(self):
        if self.on:
            torch.cuda.set_sync_debug_mode("error")

    def __exit__(self, *exc):
        if self.on:
            torch.cuda.set_sync_debug_mode("default")
