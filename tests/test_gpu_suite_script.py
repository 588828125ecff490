"""scripts/gpu_suite.sh: the GPU suite run after run until RUNS pass in a row, the row carried to
the next call on the same machine while the code is the same; run here with a stand-in ``python``
whose "suite" passes or fails as told (no GPU, no pytest)."""
from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FAKE = """#!/usr/bin/env bash
echo "$@" >> "$FAKE_DIR/calls"
[ -e "$FAKE_DIR/fail" ] && { echo "FAILED tests/test_x.py::test_y"; echo "1 failed"; exit 1; }
[ -e "$FAKE_DIR/sleep" ] && sleep "$(cat "$FAKE_DIR/sleep")"
[ -e "$FAKE_DIR/cut" ] && { echo "...."; exit 124; }  # as timeout reports a run it killed
echo "3 passed"
"""


def run(tmp_path: Path, runs: int, budget: int = 3000, fail: bool = False, cut: bool = False,
        **env: str) -> subprocess.CompletedProcess:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / "python").write_text(FAKE)
    (bin_dir / "python").chmod(0o755)
    for flag, on in (("fail", fail), ("cut", cut)):
        (tmp_path / flag).unlink(missing_ok=True)
        if on:
            (tmp_path / flag).touch()
    env = dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}", FAKE_DIR=str(tmp_path), OUT=str(tmp_path / "out"),
               SUITE_STATE=str(tmp_path / "state" / "row"), SUITE_BUDGET=str(budget), **env)
    return subprocess.run(["bash", "scripts/gpu_suite.sh", str(runs)], cwd=ROOT, env=env, capture_output=True,
                          text=True)


def calls(tmp_path: Path, what: str = "-m pytest") -> list[str]:
    """The stand-in's calls: the suite's runs, or (``what="scripts/expert_store.py"``) store removals."""
    return [line for line in (tmp_path / "calls").read_text().splitlines() if line.startswith(what)]


def test_a_cold_machine_removes_the_expert_stores_before_its_first_run_and_a_warm_one_keeps_them(tmp_path):
    assert "run 1: rc=0" in run(tmp_path, 1).stdout
    assert calls(tmp_path, "scripts/expert_store.py") == ["scripts/expert_store.py remove --all"]
    assert "run 2: rc=0" in run(tmp_path, 2).stdout  # warm: the suite's own stores stay
    assert len(calls(tmp_path, "scripts/expert_store.py")) == 1 and len(calls(tmp_path)) == 2


def test_runs_until_the_row_is_done_and_carries_it_to_the_next_call(tmp_path):
    cold = run(tmp_path, 2, budget=300)  # a first run needs room for compiling and tuning
    assert cold.returncode == 0 and "run 1 needs ~450 s" in cold.stdout and not (tmp_path / "calls").exists()
    first = run(tmp_path, 1)
    assert first.returncode == 0 and "run 1: rc=0" in first.stdout and "1 of 1 in a row" in first.stdout
    assert calls(tmp_path)[0].startswith("-m pytest -m cuda -n 6 --dist loadfile")
    second = run(tmp_path, 2, budget=300)  # the row goes on: a warm run fits
    assert second.returncode == 0 and "run 2: rc=0" in second.stdout and "2 of 2 in a row" in second.stdout
    assert (tmp_path / "out" / "suite2.tail").read_text().strip() == "3 passed"
    assert len(calls(tmp_path)) == 2
    assert run(tmp_path, 2).stdout.strip() == "suite: 2 of 2 in a row"  # done: nothing runs
    assert len(calls(tmp_path)) == 2


def test_a_failure_ends_the_call_and_starts_the_row_over(tmp_path):
    assert run(tmp_path, 1).returncode == 0
    failed = run(tmp_path, 3, fail=True)
    assert failed.returncode == 1 and "run 2: rc=1" in failed.stdout and "FAILED tests/test_x.py" in failed.stdout
    again = run(tmp_path, 1)
    assert "run 1: rc=0" in again.stdout and len(calls(tmp_path)) == 3


def test_a_row_kept_for_other_code_starts_over(tmp_path):
    (tmp_path / "state").mkdir()
    (tmp_path / "state" / "row").write_text("2 0123456789ab\n")  # two passes of another tree
    out = run(tmp_path, 2)
    assert "run 1: rc=0" in out.stdout and "run 2: rc=0" in out.stdout and len(calls(tmp_path)) == 2


def test_a_run_cut_off_by_the_budget_leaves_the_row_as_it_was(tmp_path):
    assert "1 of 1 in a row" in run(tmp_path, 1).stdout
    cut = run(tmp_path, 3, cut=True)
    assert cut.returncode == 0 and "run 2 cut off by the budget, not counted; 1 of 3 in a row" in cut.stdout
    assert "run 2: rc=0" in run(tmp_path, 3, budget=300).stdout  # the row goes on from its one pass


def test_the_first_run_on_a_machine_needs_the_cold_time_and_later_ones_the_warm(tmp_path):
    short = run(tmp_path, 1, budget=200, SUITE_COLD_S="150")
    assert "run 1: rc=0" in short.stdout
    later = run(tmp_path, 3, budget=200, SUITE_WARM_S="250")
    assert "run 2 needs ~250 s" in later.stdout and later.returncode == 0  # warm now, and 250 > 200
    assert len(calls(tmp_path)) == 1


def test_a_warm_run_needs_a_fifth_more_than_the_longest_warm_run_the_machine_finished(tmp_path):
    assert "run 1: rc=0" in run(tmp_path, 1).stdout  # cold: marks the machine warm, records nothing
    (tmp_path / "sleep").write_text("5")
    assert "run 2: rc=0" in run(tmp_path, 2, budget=300).stdout  # warm: 5 s recorded
    (tmp_path / "sleep").unlink()
    short = run(tmp_path, 3, budget=5)
    assert re.search(r"run 3 needs ~[67] s,", short.stdout) and len(calls(tmp_path)) == 2  # 5 s, or 6 on a slow host
    assert "run 3 needs ~4 s" in run(tmp_path, 3, budget=3, SUITE_WARM_S="4").stdout  # the variable still wins


def test_a_warm_run_cut_off_by_the_budget_counts_its_seconds_as_the_least_a_run_takes(tmp_path):
    assert "run 1: rc=0" in run(tmp_path, 1).stdout  # cold
    (tmp_path / "sleep").write_text("3")
    assert "run 2 cut off" in run(tmp_path, 3, budget=300, cut=True).stdout  # 3 s recorded
    (tmp_path / "sleep").unlink()
    assert re.search(r"run 2 needs ~[34] s,", run(tmp_path, 3, budget=2).stdout)  # 3 or 4 s, times 1.2
