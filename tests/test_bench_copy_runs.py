"""scripts/bench_copy_runs.py: its ways of staging a layer's misses put the same bytes in the same
buffer slots (the mirror's own staging; an expert record holds every bank's row at its offset), so
its timings compare copies of the same data; the bytes it counts are the bytes it moves."""
from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))  # it imports report_table
from bench_copy_runs import Layout, bank_bytes  # noqa: E402

CPU = torch.device("cpu")


@pytest.mark.parametrize("dtype, banks", [("bf16", 2), ("fp8", 4), ("nvfp4", 6), ("mxfp4", 4)])
def test_bank_bytes_follow_the_format(dtype, banks):
    sizes = bank_bytes(dtype, 96, 64)
    assert len(sizes) == banks
    per_value = {"bf16": 2, "fp8": 1, "nvfp4": 0.5, "mxfp4": 0.5}[dtype]
    assert sizes[0] == 2 * 96 * 64 * per_value and sizes[1] == 64 * 96 * per_value


@pytest.mark.parametrize("dtype", ["fp8", "nvfp4"])
def test_every_way_stages_the_misses_bytes(dtype):
    torch.manual_seed(0)
    experts = 24
    layout = Layout(bank_bytes(dtype, 48, 64), experts, 0.25, random.Random(1), CPU)
    mirror = layout.mirror
    for layer in range(2):
        misses = [j for _, j, n in mirror.runs[layer] for j in range(j, j + n)]
        assert len(misses) == 18 == len(set(misses))  # a quarter of the experts are hits
        copies = layout.copy("banks", layer)
        assert layout.copy("records", layer) == len(mirror.runs[layer]) <= copies
        rows = slots = [layer * experts + j for j in misses]  # two layers: host row and buffer slot coincide
        for b, (host, off, size) in enumerate(zip(layout.host, layout.offsets, layout.sizes)):
            assert torch.equal(mirror.banks[b][1][slots], host[rows])
            assert torch.equal(layout.pool_records[slots, off:off + size], host[rows, 0])
        assert layout.moved_bytes("records", layer) == len(misses) * layout.record
        unbridged = sum(size for size, (*_, bridge) in zip(layout.sizes, mirror.copy_banks) if not bridge)
        assert layout.records_mirror.copies_per_run == 1
        assert layout.moved_bytes("banks", layer) >= len(misses) * unbridged
