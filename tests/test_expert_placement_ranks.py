"""Placement of experts on expert-parallel ranks (``worker.distributed.placement``): round-robin
by id, or balanced by a routing record's counts, with a fixed ``E / N`` experts a rank."""
from __future__ import annotations

import pytest
import torch

from moe_offload.routing_trace import RoutingTrace
from worker.distributed.placement import balanced, make_placement, rank_loads, round_robin


def test_round_robin_is_id_modulo_ranks():
    placement = round_robin(3, 8, 2)
    assert placement.owned(1)[2].tolist() == [1, 3, 5, 7] and placement.strided(1) == (1, 2)
    assert torch.equal(placement.local_of(), torch.arange(8).expand(3, -1) // 2)
    assert round_robin(2, 16, 3).owned(0).shape == (2, 6)  # N need not divide E


def test_popularity_balances_a_skewed_table_better_than_round_robin():
    gen = torch.Generator().manual_seed(0)
    counts = (1000 * torch.rand(4, 16, generator=gen) ** 4).long()  # a few hot experts per layer
    counts[:, 0::2] *= 3  # and the even ones (all rank 0's by id) hotter
    spread = {name: (loads.max(0).values - loads.min(0).values).sum().item()
              for name, loads in (("rr", rank_loads(round_robin(4, 16, 2), counts)),
                                  ("pop", rank_loads(balanced(counts, 2), counts)))}
    assert spread["pop"] < spread["rr"] / 4, spread
    placement = balanced(counts, 2)
    assert all(placement.owned(r).shape == (4, 8) for r in range(2)) and placement.strided(0) is None
    for r in range(2):  # local_of numbers each rank's experts 0..n-1
        assert placement.local_of().gather(1, placement.owned(r)).tolist() == [list(range(8))] * 4


def _record(path, layers: int, experts: int) -> str:
    ids = torch.randint(0, experts, (5, layers, 2))
    RoutingTrace(experts, torch.zeros(5, dtype=torch.int64), torch.ones(5, dtype=torch.int64),
                 torch.arange(5), ids, torch.ones(5, layers, 2)).save(str(path))
    return str(path)


def test_bad_placements_are_refused_in_one_line(tmp_path):
    record = _record(tmp_path / "r.pt", 2, 8)
    assert make_placement(f"popularity:{record}", 2, 8, 2).owned(1).shape == (2, 4)
    with pytest.raises(ValueError, match="records 2 layers of 8 experts; the model has 3 of 8"):
        make_placement(f"popularity:{record}", 3, 8, 2)
    with pytest.raises(ValueError, match="is not one of round-robin, popularity:FILE"):
        make_placement("hottest", 2, 8, 2)
    with pytest.raises(ValueError, match="popularity needs --gpus 3 to divide the 8 experts"):
        make_placement(f"popularity:{record}", 2, 8, 3)
