"""The GPU suite's files, heaviest first.

``pytest -m cuda -n N --dist loadfile`` gives each file to one worker, in the order the files are
collected, and xdist by default reorders them by their number of tests. A file's tests are not
alike: 4 engine tests can take longer than 69 kernel checks. So a worker that picks up a heavy
file last keeps the whole run waiting. Handing the files out heaviest first (the longest-processing-
time rule) ends the run close to ``total / N`` when no file is longer than that.

``tests/gpu_seconds.json`` holds each test's seconds from earlier GPU runs (``SLUICE_TEST_LOG``;
``python scripts/gpu_test_seconds.py LOG...`` rewrites it). A test it lacks is looked up by its
name in another file (a test moved between files keeps its name), else weighs the median of its
file's measured tests, else the median of all.
"""
from __future__ import annotations

import json
import statistics
from pathlib import Path

SECONDS_FILE = Path(__file__).with_name("gpu_seconds.json")


def file_of(nodeid: str) -> str:
    return nodeid.split("::", 1)[0]


def name_of(nodeid: str) -> str:
    return nodeid.split("::", 1)[-1]


def load_seconds(path: Path = SECONDS_FILE) -> dict[str, float]:
    """Test id -> seconds, from ``gpu_seconds.json``; empty when it is missing."""
    return json.loads(path.read_text())["tests"] if path.exists() else {}


def expected_seconds(nodeids: list[str], seconds: dict[str, float]) -> dict[str, float]:
    """Each test's expected seconds (the module docstring says how a test without a record weighs)."""
    by_name = {name_of(nodeid): s for nodeid, s in seconds.items()}
    per_file: dict[str, list[float]] = {}
    for nodeid, s in seconds.items():
        per_file.setdefault(file_of(nodeid), []).append(s)
    typical = statistics.median(seconds.values()) if seconds else 1.0

    def weight(nodeid: str) -> float:
        if nodeid in seconds:
            return seconds[nodeid]
        if name_of(nodeid) in by_name:
            return by_name[name_of(nodeid)]
        known = per_file.get(file_of(nodeid))
        return statistics.median(known) if known else typical

    return {nodeid: weight(nodeid) for nodeid in nodeids}


def heaviest_first(nodeids: list[str], seconds: dict[str, float]) -> list[str]:
    """``nodeids`` grouped by file, the files by decreasing total weight (ties keep collection
    order), each file's tests in their own order."""
    weights = expected_seconds(nodeids, seconds)
    groups: dict[str, list[str]] = {}
    for nodeid in nodeids:
        groups.setdefault(file_of(nodeid), []).append(nodeid)
    order = sorted(groups, key=lambda name: -sum(weights[n] for n in groups[name]))  # stable
    return [nodeid for name in order for nodeid in groups[name]]


def makespan(nodeids: list[str], weights: dict[str, float], workers: int) -> float:
    """When the last of ``workers`` ends, each taking the next file in ``nodeids``' order when it
    is free (xdist's loadfile hands a worker its next file as its last tests run)."""
    files: dict[str, float] = {}
    for nodeid in nodeids:
        files[file_of(nodeid)] = files.get(file_of(nodeid), 0.0) + weights[nodeid]
    ends = [0.0] * workers
    for seconds in files.values():
        ends[ends.index(min(ends))] += seconds
    return max(ends)


def by_count(nodeids: list[str]) -> list[str]:
    """xdist's default loadfile order: the files by decreasing number of tests (stable)."""
    groups: dict[str, list[str]] = {}
    for nodeid in nodeids:
        groups.setdefault(file_of(nodeid), []).append(nodeid)
    return [nodeid for name in sorted(groups, key=lambda name: -len(groups[name])) for nodeid in groups[name]]
