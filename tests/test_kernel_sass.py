"""scripts/kernel_sass.py compiles the 4-bit kernels for sm90 on a machine without a GPU and reads
the cubin with Triton's own tools: the summary names registers and the load widths."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_the_per_slot_down_compiles_for_sm90_with_16_byte_weight_copies():
    bindir = Path(pytest.importorskip("triton").__file__).parent / "backends" / "nvidia" / "bin"
    if not (bindir / "ptxas").exists():
        pytest.skip("this Triton carries no ptxas")
    run = subprocess.run([sys.executable, "scripts/kernel_sass.py", "--formats", "nvfp4", "--kernels", "down_slot"],
                         cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    line = next(line for line in run.stdout.splitlines() if "down_slot" in line)
    assert int(line.split("regs")[1].split()[0]) > 0
    # nvfp4's 8-byte groups load as one run of a row's words where K is a multiple of the step
    assert "LDGSTS.E.BYPASS.128" in line and "LDGSTS.E.64" not in line, line
