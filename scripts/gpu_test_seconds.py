"""Rewrite ``tests/gpu_seconds.json`` (the GPU suite's file weights, ``tests/gpu_order.py``) from the
per-test logs of GPU runs (``SLUICE_TEST_LOG``, as ``scripts/gpu_check.sh`` and a device call's
suite runs write them). Give the logs oldest first: a test's seconds are its latest run's (setup,
call and teardown together).

    python scripts/gpu_test_seconds.py run1/test_times.log run2/test_times.log [--card "H200"]
"""
from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing
from tests.gpu_order import SECONDS_FILE, file_of  # noqa: E402


def test_seconds(paths: list[Path]) -> dict[str, float]:
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


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("logs", nargs="+", type=Path)
    p.add_argument("--card", default="H200", help="the GPU the logs come from")
    p.add_argument("--out", type=Path, default=SECONDS_FILE)
    args = p.parse_args()
    tests = {nodeid: round(seconds, 2) for nodeid, seconds in sorted(test_seconds(args.logs).items())}
    doc = {"card": args.card, "logs": [str(path) for path in args.logs], "tests": tests}
    args.out.write_text(json.dumps(doc, indent=0, sort_keys=True) + "\n")
    files = {file_of(nodeid) for nodeid in tests}
    print(f"{len(tests)} tests in {len(files)} files, {sum(tests.values()):.0f} s in all -> {args.out}")


if __name__ == "__main__":
    main()
