"""scripts/bench_copy_runs.py: its ways of staging a layer's misses put the same bytes in the same
buffer slots (an expert record holds every bank's row at its offset), so its timings compare
copies of the same data; the bytes it counts are the bytes it moves."""
from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))  # it imports report_table
from bench_copy_runs import ALIGN, Layout, bank_bytes, layer_runs, offsets  # noqa: E402

CPU = torch.device("cpu")


@pytest.mark.parametrize("dtype, banks", [("bf16", 2), ("fp8", 4), ("nvfp4", 6), ("mxfp4", 4)])
def test_bank_bytes_follow_the_format(dtype, banks):
    sizes = bank_bytes(dtype, 96, 64)
    assert len(sizes) == banks
    per_value = {"bf16": 2, "fp8": 1, "nvfp4": 0.5, "mxfp4": 0.5}[dtype]
    assert sizes[0] == 2 * 96 * 64 * per_value and sizes[1] == 64 * 96 * per_value


def test_offsets_are_aligned_and_do_not_overlap():
    offs, record = offsets([5, 300, 1, 256])
    assert offs == [0, ALIGN, 3 * ALIGN, 4 * ALIGN] and record == 5 * ALIGN


def test_runs_cover_exactly_the_misses():
    runs = layer_runs(random.Random(3), 40, 0.25)
    moved = [e for src, dst, n in runs for e in range(src, src + n)]
    assert len(moved) == 30 == len(set(moved)) and all(src == dst for src, dst, _ in runs)


@pytest.mark.parametrize("dtype", ["fp8", "nvfp4"])
def test_banks_and_records_stage_the_same_bytes(dtype):
    torch.manual_seed(0)
    layout = Layout(bank_bytes(dtype, 48, 64), 24, CPU)
    runs = layer_runs(random.Random(1), 24, 0.25)
    copies = layout.copy("banks", runs)
    assert layout.copy("banks2", runs) == copies  # on a CPU: the same copies, one stream
    assert layout.copy("records", runs) == len(runs) <= copies
    misses = [e for src, _, n in runs for e in range(src, src + n)]
    for pool, host, off, size in zip(layout.pool, layout.host, layout.offsets, layout.sizes):
        assert torch.equal(pool[misses], host[misses])
        assert torch.equal(layout.pool_records[misses, off:off + size], pool[misses])
    assert layout.moved_bytes("records", runs) == len(misses) * layout.record
    unbridged = sum(size for size, bridge in zip(layout.sizes, layout.bridge) if not bridge)
    assert layout.moved_bytes("banks", runs) == layout.moved_bytes("banks2", runs) >= len(misses) * unbridged
