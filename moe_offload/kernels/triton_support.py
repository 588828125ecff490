"""Lazy Triton plumbing shared by every kernel file, moe_offload's and the worker's (attention, norms,
RoPE, KV page copies): which path an op takes, and small helpers. Public: the worker imports it.

An op runs its Triton kernel on CUDA tensors and its eager twin elsewhere. ``backend="triton"``
(or ``SLUICE_KERNELS=triton``) forces the kernel, which on CPU tensors needs the interpreter
(``TRITON_INTERPRET=1`` set before triton is first imported); ``"eager"`` forces the twin.
"""
from __future__ import annotations

import functools
import importlib.util
import os

import torch

BACKEND_ENV = "SLUICE_KERNELS"
BACKENDS = ("auto", "triton", "eager")
PDL_ENV = "SLUICE_PDL"  # "0" turns programmatic dependent launch off (the A/B switch)


def use_triton(tensor: torch.Tensor, backend: str | None = None) -> bool:
    """Whether an op on ``tensor``'s device runs its Triton kernel."""
    choice = backend or os.environ.get(BACKEND_ENV, "auto")
    if choice not in BACKENDS:
        raise ValueError(f"kernel backend {choice!r} is not one of {BACKENDS}")
    if choice == "eager":
        return False
    if choice == "triton":
        if not tensor.is_cuda and not interpreting():
            raise RuntimeError("Triton kernels on CPU tensors need TRITON_INTERPRET=1 before triton is imported")
        return True
    return tensor.is_cuda and triton_available()


@functools.cache
def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def interpreting() -> bool:
    """Whether kernels decorated now become interpreted functions (Triton reads this env var)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def reg_cap(regs: int) -> dict[str, int]:
    """Launch arguments capping a kernel's registers per thread at ``regs`` (ptxas' maxnreg; 0: no
    cap). Only a cap below what the kernel takes uncapped means anything: ptxas may spend up to a
    cap it is given, so a cap above raises the count. Fewer registers, more programs an SM holds."""
    return {"maxnreg": regs} if regs else {}


def pdl_args(tensor: torch.Tensor) -> dict[str, bool]:
    """Launch arguments for programmatic dependent launch (PDL), on for CUDA devices of compute
    capability 9 or more unless ``SLUICE_PDL=0``: ``kernel[grid](..., **pdl_args(x))``.

    A PDL launch may begin while the kernel before it on the stream still runs. The kernel takes
    the ``PDL`` constexpr and, when set, first calls ``tl.extra.cuda.gdc_wait()`` (it returns once
    the previous kernel has finished and its writes are visible, so every access after it is
    ordered as without PDL) and then ``gdc_launch_dependents()`` (the next kernel may launch). So
    when a kernel starts, every kernel two launches before it has finished: before its wait it may
    read a model's weights (no kernel writes them) and what no launch since the one two before it
    writes, nothing that the launch just before it may write (``tests/test_pdl.py`` names each such
    read). What it saves is the launch latency between two kernels of a step, and the first reads."""
    on = tensor.is_cuda and os.environ.get(PDL_ENV, "1") != "0" and _capability(tensor.device) >= 9
    return {"PDL": on, "launch_pdl": on}


@functools.cache
def _capability(device: torch.device) -> int:
    return torch.cuda.get_device_capability(device)[0]


def next_pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def num_warps_for(block: int) -> int:
    """Warps for a one-program kernel holding ``block`` elements per tensor in registers."""
    return 4 if block <= 1024 else 8 if block <= 4096 else 16


_RAW_DTYPES = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def raw_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """The same memory as integers, for kernels that copy bytes whatever the dtype (fp8 pointers
    need not be supported by every Triton target or the interpreter). One-byte items with an even
    last dimension go in pairs (int16), so a copy kernel's block of elements moves as many bytes
    for fp8 banks as for bf16 ones, where every stride but the last is even too (expert records'
    rows: ``expert_records``)."""
    pairs = tensor.stride(-1) == 1 and all(s % 2 == 0 for s in (*tensor.stride()[:-1], tensor.storage_offset()))
    if tensor.element_size() == 1 and tensor.shape[-1] % 2 == 0 and pairs:
        return tensor.view(torch.int16)
    return tensor.view(_RAW_DTYPES[tensor.element_size()])
