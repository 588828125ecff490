"""Stream safetensors tensors into preallocated destinations, checking names and shapes."""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch
from safetensors import safe_open

from worker.errors import CheckpointError


def checkpoint_files(model_dir: str | Path) -> list[Path]:
    model_dir = Path(model_dir)
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        files = [model_dir / n for n in names]
    else:
        files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{model_dir}: no *.safetensors files")
    missing = [f.name for f in files if not f.is_file()]
    if missing:
        raise CheckpointError(f"{model_dir}: safetensors index names missing files {missing}")
    return files


def tensor_names(files: list[Path]) -> set[str]:
    names: set[str] = set()
    for path in files:
        with safe_open(path, framework="pt") as f:
            names.update(f.keys())
    return names


def load_tensors(files: list[Path], targets: dict[str, torch.Tensor], label: str = "loading") -> None:
    """Copy every tensor named in ``targets`` into its destination (casting dtype, moving device).

    A missing name or a shape mismatch raises ``CheckpointError`` naming the tensor; tensors of the
    file that no target asks for are skipped without being read.
    """
    total = sum(t.numel() * t.element_size() for t in targets.values())
    progress = _Progress(label, total)
    seen: set[str] = set()
    for path in files:
        with safe_open(path, framework="pt") as f:
            for name in f.keys():
                dst = targets.get(name)
                if dst is None:
                    continue
                src = f.get_slice(name)
                shape = tuple(src.get_shape())
                if shape != tuple(dst.shape):
                    raise CheckpointError(f"{path.name}: tensor {name} has shape {shape}, expected {tuple(dst.shape)}")
                dst.copy_(f.get_tensor(name))
                seen.add(name)
                progress.advance(dst.numel() * dst.element_size())
    progress.close()
    missing = sorted(set(targets) - seen)
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise CheckpointError(f"checkpoint is missing tensor {missing[0]}{more}")


class _Progress:
    """A one-line stderr progress bar by bytes (only drawn on a terminal)."""

    def __init__(self, label: str, total: int):
        self.label, self.total, self.done = label, max(total, 1), 0
        self.start = self.last = time.monotonic()
        self.tty = sys.stderr.isatty()

    def advance(self, nbytes: int) -> None:
        self.done += nbytes
        now = time.monotonic()
        if self.tty and now - self.last > 0.1:
            self.last = now
            self._draw(now)

    def _draw(self, now: float) -> None:
        frac = self.done / self.total
        bar = "#" * int(30 * frac)
        rate = self.done / max(now - self.start, 1e-9) / 1e9
        sys.stderr.write(f"\r{self.label} [{bar:<30}] {frac:6.1%} {self.done / 1e9:.2f} GB {rate:.2f} GB/s")
        sys.stderr.flush()

    def close(self) -> None:
        if self.tty:
            self._draw(time.monotonic())
            sys.stderr.write("\n")
