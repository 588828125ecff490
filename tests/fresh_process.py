"""Run a GPU test's body in a new interpreter. For tests that read this process's allocator
(``torch.cuda.memory_reserved``): an earlier test in the same xdist worker can leave memory reserved
that ``empty_cache`` cannot return (a segment with one live block, garbage not yet collected), and a
plan sized under a limit then sees less than the limit. A fresh process holds nothing."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def run_fresh(target: str, timeout: float = 300) -> None:
    """Call ``module:function`` (no arguments) in a new interpreter at the repository root; its failure,
    with its output, fails the caller."""
    module, function = target.split(":")
    path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))  # the caller's packages too
    proc = subprocess.run([sys.executable, "-c", f"import {module}; {module}.{function}()"], cwd=REPO,
                          env={**os.environ, "PYTHONPATH": path}, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{target} failed in a fresh process:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
