"""A pytest plugin for device runs: each failure's traceback is appended to ``$OUT/failures.txt``
as it happens, so a run cut short by its time limit (``pytest -q -n`` prints tracebacks only at
the end) still says why its failures failed.

    PYTHONPATH=scripts python -m pytest -m cuda -v -n 8 --dist loadfile -p pytest_failtrace tests/
"""
from __future__ import annotations

import os


def pytest_runtest_logreport(report) -> None:
    if report.failed:
        with open(os.path.join(os.environ.get("OUT", "/tmp"), "failures.txt"), "a") as f:
            f.write(f"==== {report.nodeid} ({report.when})\n{str(report.longrepr)[-4000:]}\n\n")
