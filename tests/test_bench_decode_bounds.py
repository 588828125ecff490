"""scripts/bench_decode.py: a resident row's HBM bound counts the distinct experts that the same
batch looked up behind a cache, not ``min(E, batch * k)``."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))  # bench_decode imports report_table
from bench_decode import HBM_BYTES_PER_S, resident_bounds_from_lookups  # noqa: E402

EXPERT, DENSE, LAYERS = 9_437_184, 2.46e9, 48


def row(fraction, batch, per_layer, tok_s, prefetch="off", experts="bf16"):
    step = (DENSE + per_layer * LAYERS * EXPERT) / HBM_BYTES_PER_S
    return dict(gpus=1, fraction=fraction, experts=experts, prefetch=prefetch, batch=batch, tok_s=tok_s,
                experts_per_layer=per_layer, distinct="assumed" if fraction >= 1 else "looked up",
                dense_bytes=DENSE, expert_bytes=EXPERT, layers=LAYERS, step_pcie=0.0,
                bound_tok_s=batch / step, ratio=tok_s * step / batch)


def test_a_resident_row_takes_the_distinct_experts_its_batch_looked_up():
    resident = row(1.0, 8, 64, 1077.6)  # min(128, 8 * 8) assumed
    cached = row(0.25, 8, 37.8, 44.5)
    guessing = row(0.25, 8, 60.0, 39.4, prefetch="on")  # prefetch's ahead lookups are not the routing
    other = row(1.0, 32, 128, 2733.7)  # no cached row of batch 32: keeps the assumption
    assumed = resident["ratio"]
    resident_bounds_from_lookups([resident, cached, guessing, other])
    assert resident["distinct"] == "from cache" and resident["experts_per_layer"] == 37.8
    step = (DENSE + 37.8 * LAYERS * EXPERT) / HBM_BYTES_PER_S
    assert resident["bound_tok_s"] == pytest.approx(8 / step)
    assert resident["ratio"] == pytest.approx(1077.6 * step / 8) and resident["ratio"] < assumed
    assert other["distinct"] == "assumed" and other["experts_per_layer"] == 128
    assert cached["distinct"] == "looked up" and cached["experts_per_layer"] == 37.8
