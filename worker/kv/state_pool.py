"""The recurrent state of linear-attention layers (hybrid models), a fixed-size slot per sequence:
where KV pages hold a full-attention layer's memory, a slot holds every linear layer's conv window
and delta-rule state.

```
 conv[j] : [slots, conv_dim, K - 1]     model dtype   the last K - 1 inputs of the conv
 ssm[j]  : [slots, Hv, Dk, Dv]          float32       the delta rule's state (bf16 would drift)
 slot 0                    scratch: padded decode rows read and write it, no sequence owns it
 slots 1 .. running        a running request's, slot = its token-buffer row + 1
 slots running + 1 ..      snapshots of the prefix cache, handed out from a free list
```

Slots move by fixed-shape device copies (``copy``: an index_select and an index_copy per bank,
no host read); the host tier keeps its snapshots in ``HostStatePool``.
"""
from __future__ import annotations

import torch

from worker.models.family_config import LinearAttention
from worker.kv.gpu_pool import PagedPool


class StatePool(PagedPool):
    def __init__(self, num_layers: int, running: int, snapshots: int, la: LinearAttention, dtype: torch.dtype,
                 device: torch.device):
        self.num_layers, self.running, self.num_slots = num_layers, running, 1 + running + snapshots
        self.conv = torch.zeros(num_layers, self.num_slots, la.conv_dim, la.conv_kernel - 1, dtype=dtype, device=device)
        self.ssm = torch.zeros(num_layers, self.num_slots, la.num_v_heads, la.head_k_dim, la.head_v_dim,
                               dtype=torch.float32, device=device)
        self.device = device
        self._free = list(range(self.num_slots - 1, running, -1))  # snapshot slots, lowest first
        self._label = "state snapshots"

    @staticmethod
    def slot_bytes_of(num_layers: int, la: LinearAttention, dtype: torch.dtype) -> int:
        conv = la.conv_dim * (la.conv_kernel - 1) * dtype.itemsize
        return num_layers * (conv + la.num_v_heads * la.head_k_dim * la.head_v_dim * 4)

    @property
    def slot_bytes(self) -> int:
        return (self.conv[:, 0].numel() * self.conv.element_size()) + self.ssm[:, 0].numel() * 4

    @property
    def capacity(self) -> int:
        """Snapshot slots that can ever be allocated."""
        return self.num_slots - 1 - self.running

    def running_slot(self, row: int) -> int:
        if not 0 <= row < self.running:
            raise ValueError(f"token-buffer row {row} has no state slot ({self.running} running slots)")
        return 1 + row

    def layer(self, j: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Linear layer j's ``(conv [slots, C, K-1], ssm [slots, Hv, Dk, Dv])``."""
        return self.conv[j], self.ssm[j]

    def copy(self, src: list[int], dst: list[int]) -> None:
        """``slot dst[i] = slot src[i]`` in every layer, on the current stream."""
        if len(src) != len(dst) or not all(0 <= s < self.num_slots for s in src + dst):
            raise ValueError(f"state copy {src} -> {dst} outside {self.num_slots} slots")
        if not src:
            return
        index = torch.tensor(src + dst, dtype=torch.int64)
        if self.device.type == "cuda":
            index = index.pin_memory().to(self.device, non_blocking=True)
        s, d = index.split(len(src))
        for bank in (self.conv, self.ssm):
            bank.index_copy_(1, d, bank.index_select(1, s))

    def zero(self, slots: torch.Tensor) -> None:
        """Clear ``slots [n]`` (device) in every layer: sequences that start from nothing."""
        for bank in (self.conv, self.ssm):
            bank.index_fill_(1, slots, 0)


class HostStatePool(PagedPool):
    """Pinned host copies of state slots, slot-major (a snapshot is one contiguous block per bank)."""

    def __init__(self, like: StatePool, num_slots: int):
        pin = like.device.type == "cuda"
        self.conv = torch.zeros(num_slots, *like.conv[:, 0].shape, dtype=like.conv.dtype, pin_memory=pin)
        self.ssm = torch.zeros(num_slots, *like.ssm[:, 0].shape, dtype=torch.float32, pin_memory=pin)
        self.num_slots = num_slots
        self._free = list(range(num_slots - 1, -1, -1))
        self._label = "host state snapshots"

    @property
    def capacity(self) -> int:
        return self.num_slots

    def write_from(self, pool: StatePool, src: list[int], dst: list[int]) -> None:
        """GPU slots ``src`` -> host slots ``dst`` on the current stream (non-blocking into pinned memory)."""
        for s, d in zip(src, dst):
            self.conv[d].copy_(pool.conv[:, s], non_blocking=True)
            self.ssm[d].copy_(pool.ssm[:, s], non_blocking=True)

    def load_into(self, pool: StatePool, src: list[int], dst: list[int]) -> None:
        """Host slots ``src`` -> GPU slots ``dst`` on the current stream."""
        for s, d in zip(src, dst):
            pool.conv[:, d].copy_(self.conv[s], non_blocking=True)
            pool.ssm[:, d].copy_(self.ssm[s], non_blocking=True)
