"""A byte-counting progress bar on stderr for long fills (no tqdm dependency)."""
from __future__ import annotations

import sys
import time
from typing import TextIO


class ProgressBar:
    """``label [#######.......] 12.30/58.00 GB 4.10 GB/s``: redrawn in place on a terminal, else
    printed as a line every few seconds so logs stay readable."""

    def __init__(self, total_bytes: int, label: str, stream: TextIO | None = None, width: int = 30):
        self.total = max(total_bytes, 1)
        self.label = label
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty()
        self.interval = 0.2 if self.tty else 5.0
        self.width = width
        self.done = 0
        self.start = self.drawn_at = time.monotonic()

    def advance(self, nbytes: int) -> None:
        self.done += nbytes
        now = time.monotonic()
        if now - self.drawn_at >= self.interval:
            self.drawn_at = now
            self._draw(now)

    def _draw(self, now: float) -> None:
        filled = self.width * min(self.done, self.total) // self.total
        rate = self.done / max(now - self.start, 1e-9) / 1e9
        bar = "#" * filled + "." * (self.width - filled)
        text = f"{self.label} [{bar}] {self.done / 1e9:.2f}/{self.total / 1e9:.2f} GB {rate:.2f} GB/s"
        self.stream.write(f"\r{text}" if self.tty else f"{text}\n")
        self.stream.flush()

    def __enter__(self) -> ProgressBar:
        return self

    def __exit__(self, *exc: object) -> None:
        self._draw(time.monotonic())
        if self.tty:
            self.stream.write("\n")
            self.stream.flush()
