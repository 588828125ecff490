"""The GPU suite's test times (``tests/gpu_seconds.json``, by which ``tests/gpu_order.py`` hands the
files out heaviest first) from the per-test logs of GPU runs (``SLUICE_TEST_LOG``, as
``scripts/gpu_check.sh`` and a device call's suite runs write them). Give the logs oldest first: a
test's seconds are its latest run's (setup, call and teardown together).

    python scripts/gpu_test_seconds.py run1/test_times.log run2/test_times.log [--card "H200"]
    python scripts/gpu_test_seconds.py --makespan 6 8   # no GPU needed: the suite's expected end

``--makespan`` writes nothing: it collects today's CUDA tests (``pytest --collect-only -m cuda``),
weighs them by the recorded times and prints when a loadfile run would end on that many workers,
in collection order, in xdist's order by test count and heaviest first. A model, not a measurement.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout without installing
from tests.gpu_order import (SECONDS_FILE, by_count, expected_seconds, file_of, heaviest_first,  # noqa: E402
                             load_seconds, makespan)


def seconds_per_test(paths: list[Path]) -> dict[str, float]:
    """Test id -> seconds of its phases, the latest log's where several logs have it."""
    latest: dict[str, float] = {}
    for path in paths:
        run: dict[str, float] = defaultdict(float)
        for line in path.read_text().splitlines():
            fields = line.split(maxsplit=4)  # seconds, phase, outcome, worker, test id (may hold spaces)
            if len(fields) == 5 and fields[1] in ("setup", "call", "teardown"):
                run[fields[4]] += float(fields[0])
        latest.update(run)
    return latest


def cuda_tests() -> list[str]:
    """Today's CUDA test ids, in collection order."""
    out = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-m", "cuda", "-p", "no:cacheprovider",
                          "tests/"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    return [line for line in out.splitlines() if "::" in line]


def print_makespans(workers: list[int]) -> None:
    ids = cuda_tests()
    seconds = load_seconds()
    weights = expected_seconds(ids, seconds)
    recorded = sum(1 for nodeid in ids if nodeid in seconds)
    print(f"{len(ids)} CUDA tests ({recorded} recorded), {sum(weights.values()):.0f} s expected in all")
    print(f"{'workers':>7} {'collection s':>13} {'by count s':>11} {'heaviest first s':>17}")
    for n in workers:
        ends = [makespan(order, weights, n) for order in (ids, by_count(ids), heaviest_first(ids, seconds))]
        print(f"{n:>7} {ends[0]:>13.0f} {ends[1]:>11.0f} {ends[2]:>17.0f}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("logs", nargs="*", type=Path)
    p.add_argument("--card", default="H200", help="the GPU the logs come from")
    p.add_argument("--out", type=Path, default=SECONDS_FILE)
    p.add_argument("--makespan", type=int, nargs="+", metavar="WORKERS", help="print the expected ends instead")
    args = p.parse_args()
    if args.makespan:
        print_makespans(args.makespan)
        return
    if not args.logs:
        p.error("give the logs to read (or --makespan)")
    tests = {nodeid: round(seconds, 2) for nodeid, seconds in sorted(seconds_per_test(args.logs).items())}
    doc = {"card": args.card, "logs": [str(path) for path in args.logs], "tests": tests}
    args.out.write_text(json.dumps(doc, indent=0, sort_keys=True) + "\n")
    files = {file_of(nodeid) for nodeid in tests}
    print(f"{len(tests)} tests in {len(files)} files, {sum(tests.values()):.0f} s in all -> {args.out}")


if __name__ == "__main__":
    main()
