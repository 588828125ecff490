"""Where a checkpoint's dense tensors go as they are read (shared by the families' weight layouts)."""
from __future__ import annotations

from typing import Callable

import torch


class Targets:
    """Checkpoint name -> destination, plus the reorderings that run once everything is read: a
    name whose rows need moving reads into a staging tensor first."""

    def __init__(self):
        self.direct: dict[str, torch.Tensor] = {}
        self.fixups: list[Callable[[], None]] = []

    def staged(self, name: str, like: torch.Tensor, shape: tuple[int, ...], place: Callable[[torch.Tensor], None]):
        buf = torch.empty(shape, dtype=like.dtype, device=like.device)
        self.direct[name] = buf
        self.fixups.append(lambda: place(buf))

    def finish(self) -> None:
        for fix in self.fixups:
            fix()
