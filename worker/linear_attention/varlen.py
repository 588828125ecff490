"""The packed (varlen) batch layout shared by the conv and the delta rule: B sequences back to back,
``cu_seqlens [B+1]`` on the device and the same list on the host, one state slot per sequence.
The host list sizes grids and loops; the device copy is what kernels read."""
from __future__ import annotations

import torch


def check_varlen(T: int, slots: torch.Tensor, cu_seqlens: torch.Tensor, cu_seqlens_host: list[int]) -> None:
    """ValueError unless B >= 1 sequences of length >= 1 cover exactly the T packed tokens."""
    B = slots.shape[0]
    if B == 0 or cu_seqlens.shape != (B + 1,) or len(cu_seqlens_host) != B + 1:
        raise ValueError(f"{B} slots need B >= 1 and cu_seqlens of {B + 1} entries "
                         f"(device {tuple(cu_seqlens.shape)}, host {len(cu_seqlens_host)})")
    if cu_seqlens.device != slots.device or cu_seqlens.dtype not in (torch.int32, torch.int64):
        raise ValueError("cu_seqlens must be an integer tensor on the slots' device")
    if cu_seqlens_host[0] != 0 or cu_seqlens_host[-1] != T or \
            any(b <= a for a, b in zip(cu_seqlens_host, cu_seqlens_host[1:])):
        raise ValueError(f"cu_seqlens {cu_seqlens_host} must rise strictly from 0 to T={T} (no empty sequences)")


def to_device(values: list[int] | list[list[int]], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A host-built index tensor on ``device``: through pinned memory and a non-blocking copy on
    CUDA, since a copy from pageable memory makes the host wait."""
    host = torch.tensor(values, dtype=dtype)
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)
