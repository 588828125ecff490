"""What a failure inside a step means, and the fault hooks the tests use to cause one.

A step that raises fails only the requests in it (``Engine`` contains it); an error that poisons
the CUDA context (an illegal address, a device-side assert) leaves every later launch failing too,
so the process must end: ``poisons_device`` tells the two apart.

Hooks, for tests only: ``$SLUICE_FAULTS`` is a comma-separated list of ``kind:token[:seconds]``;
a request whose prompt starts with ``token`` triggers the hook each time a step prepares one of
its prefill chunks:
``raise`` (a ValueError), ``cuda`` (a RuntimeError worded as a sticky CUDA error) or ``sleep``
(the step takes ``seconds`` longer)."""
from __future__ import annotations

import os
import time
from typing import NamedTuple

import torch

FAULTS_ENV = "SLUICE_FAULTS"
_STICKY_CUDA = ("CUDA error", "device-side assert", "illegal memory access", "unspecified launch failure")


def poisons_device(exc: BaseException) -> bool:
    if isinstance(exc, torch.cuda.OutOfMemoryError):  # recoverable: the allocation failed, not the context
        return False
    accelerator_error = getattr(torch, "AcceleratorError", None)
    if accelerator_error is not None and isinstance(exc, accelerator_error):
        return True
    return isinstance(exc, RuntimeError) and any(s in str(exc) for s in _STICKY_CUDA)


class Fault(NamedTuple):
    kind: str  # raise | cuda | sleep
    token: int
    seconds: float


class FaultHooks:
    def __init__(self, faults: list[Fault]):
        self.by_token = {f.token: f for f in faults}

    @classmethod
    def from_env(cls) -> FaultHooks:
        spec = os.environ.get(FAULTS_ENV, "")
        faults = []
        for item in filter(None, spec.split(",")):
            kind, token, *seconds = item.split(":")
            if kind not in ("raise", "cuda", "sleep"):
                raise ValueError(f"${FAULTS_ENV}: unknown fault kind {kind!r} in {item!r}")
            faults.append(Fault(kind, int(token), float(seconds[0]) if seconds else 0.0))
        return cls(faults)

    def on_prepare(self, prompt: list[int]) -> None:
        fault = self.by_token.get(prompt[0]) if self.by_token and prompt else None
        if fault is None:
            return
        if fault.kind == "sleep":
            time.sleep(fault.seconds)
        elif fault.kind == "cuda":
            raise RuntimeError("CUDA error: an illegal memory access was encountered (injected by a test)")
        else:
            raise ValueError(f"fault injected by a test (prompt starts with {fault.token})")
