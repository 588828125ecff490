"""The GPU suite's file order (``tests/gpu_order.py``) and the script that records its weights."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.gpu_order import by_count, expected_seconds, file_of, heaviest_first, load_seconds, makespan

ROOT = Path(__file__).resolve().parents[1]


def test_xdist_default_order_is_by_test_count():
    ids = ["a.py::t1", "b.py::t1", "b.py::t2", "c.py::t1"]
    assert by_count(ids) == ["b.py::t1", "b.py::t2", "a.py::t1", "c.py::t1"]


def test_files_go_heaviest_first_and_keep_their_tests_in_order():
    ids = ["a.py::t1", "a.py::t2", "b.py::t1", "c.py::t1", "c.py::t2", "d.py::t1"]
    seconds = {"a.py::t1": 1.0, "a.py::t2": 1.0, "b.py::t1": 9.0, "c.py::t1": 2.0, "c.py::t2": 3.0,
               "d.py::t1": 2.0}
    assert heaviest_first(ids, seconds) == ["b.py::t1", "c.py::t1", "c.py::t2", "a.py::t1", "a.py::t2", "d.py::t1"]


def test_a_test_without_a_record_weighs_its_name_then_its_file_then_the_median():
    seconds = {"old.py::moved[x]": 30.0, "f.py::t1": 4.0, "f.py::t2": 6.0, "g.py::t": 1.0}
    ids = ["new.py::moved[x]", "f.py::t3", "h.py::u"]
    assert expected_seconds(ids, seconds) == {"new.py::moved[x]": 30.0, "f.py::t3": 5.0, "h.py::u": 5.0}
    assert expected_seconds(["x.py::t"], {}) == {"x.py::t": 1.0}


def test_the_recorded_suite_ends_within_grahams_bound_and_no_later_than_in_other_orders():
    """Handing files out heaviest first is Graham's LPT rule: its end is within 4/3 of the best
    possible, which is at least the longest file and the total over the workers."""
    seconds = load_seconds()
    assert len(seconds) > 100, "tests/gpu_seconds.json holds the GPU runs' test times"
    ids = sorted(seconds)  # collection order is alphabetical by file
    for workers in (4, 6, 8):
        ordered = makespan(heaviest_first(ids, seconds), seconds, workers)
        files = {file_of(n): 0.0 for n in ids}
        for n in ids:
            files[file_of(n)] += seconds[n]
        best = max(max(files.values()), sum(files.values()) / workers)
        assert ordered <= (4 / 3) * best + 1e-9
        assert ordered <= makespan(ids, seconds, workers)
        assert ordered <= makespan(by_count(ids), seconds, workers)  # xdist's default order


def test_the_script_records_the_latest_run_of_each_test(tmp_path):
    old, new = tmp_path / "old.log", tmp_path / "new.log"
    old.write_text("     2.00 call     passed  gw0   tests/test_a.py::t[(1, 2)]\n"
                   "     5.00 call     passed  gw1   tests/test_b.py::t\n")
    new.write_text("     0.50 setup    passed  gw0   tests/test_a.py::t[(1, 2)]\n"
                   "     1.00 call     passed  gw0   tests/test_a.py::t[(1, 2)]\n"
                   "     0.00 teardown passed  gw0   tests/test_a.py::t[(1, 2)]\n")
    out = tmp_path / "seconds.json"
    subprocess.run([sys.executable, str(ROOT / "scripts/gpu_test_seconds.py"), str(old), str(new), "--out", str(out)],
                   check=True, capture_output=True)
    assert json.loads(out.read_text())["tests"] == {"tests/test_a.py::t[(1, 2)]": 1.5, "tests/test_b.py::t": 5.0}
    assert load_seconds(out) == {"tests/test_a.py::t[(1, 2)]": 1.5, "tests/test_b.py::t": 5.0}


def test_conftest_reorders_a_gpu_collection_and_turns_xdist_count_order_off(monkeypatch):
    """On a GPU the collection hook hands the files out heaviest first (by the recorded seconds);
    on a CPU it leaves the order and marks CUDA tests skipped."""
    import types

    import torch

    from tests import conftest

    seconds = load_seconds()
    heavy = max(seconds, key=seconds.get)  # the longest recorded test, against a new file's one test
    items = [types.SimpleNamespace(nodeid=n, keywords={}) for n in ("tests/test_zz_new.py::t", heavy)]
    config = types.SimpleNamespace(option=types.SimpleNamespace(loadscopereorder=True))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "a pretended GPU")  # no fla configs kept
    conftest.pytest_configure(config)
    conftest.pytest_collection_modifyitems(config, items)
    assert [i.nodeid for i in items] == [heavy, "tests/test_zz_new.py::t"]
    assert config.option.loadscopereorder is False
