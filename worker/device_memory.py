"""The GPU memory the engine sizes itself from: the card's, or with ``--gpu-memory-limit GiB`` a
card of that size (e.g. 32 to run as on an RTX 5090 from an H200).

Under a limit the memory plan (``worker.memory_plan``) sizes the expert cache (``--moe-cache-auto``
included), the KV pool and the prefill chunk from the memory left under the limit, and torch's
caching allocator is capped at the limit (``set_per_process_memory_fraction``), so an allocation
past it raises out-of-memory instead of quietly using the bigger card. The limit covers what torch allocates; the CUDA context and loaded
kernels (a few hundred MB, outside torch's allocator) come on top, as they would on the real card.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

GIB = 1 << 30


@dataclass(frozen=True)
class DeviceMemory:
    device: torch.device
    limit_bytes: int | None = None  # None: the whole card

    @classmethod
    def of(cls, device: torch.device, limit_gib: float | None) -> DeviceMemory:
        if limit_gib is not None and limit_gib <= 0:
            raise ValueError(f"--gpu-memory-limit must be a positive number of GiB, got {limit_gib:g}")
        if limit_gib is not None and device.type != "cuda":
            raise ValueError(f"--gpu-memory-limit limits GPU memory; the device is {device}")
        return cls(device, None if limit_gib is None else int(limit_gib * GIB))

    def cap(self) -> None:
        """Cap torch's allocator at the limit; refuse a limit larger than the card."""
        if self.limit_bytes is None or self.device.type != "cuda":
            return
        total = torch.cuda.get_device_properties(self.device).total_memory
        if self.limit_bytes > total:
            raise ValueError(f"--gpu-memory-limit {self.limit_bytes / GIB:g} GiB is more than the "
                             f"{total / GIB:.1f} GiB of {torch.cuda.get_device_name(self.device)}")
        index = self.device.index if self.device.index is not None else 0  # "cuda" is the first device here
        torch.cuda.set_per_process_memory_fraction(self.limit_bytes / total, index)  # needs an index

    def free(self) -> int:
        """Bytes free on the card, and under a limit no more than the limit less what torch's
        allocator holds (``memory_reserved``: the cap counts reserved bytes, not allocated ones)."""
        free, _ = torch.cuda.mem_get_info(self.device)
        if self.limit_bytes is not None:
            free = min(free, self.limit_bytes - torch.cuda.memory_reserved(self.device))
        return max(free, 0)

    def reusable(self) -> int:
        """Bytes torch's allocator holds but no tensor uses: free for new tensors, yet not on the card."""
        return torch.cuda.memory_reserved(self.device) - torch.cuda.memory_allocated(self.device)
