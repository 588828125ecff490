"""The benchmarks' text tables: a header line, then a line per row, each column a key of the row
dicts with its format spec (alignment, width, precision); and what every benchmark's command line
has (its docstring as description, ``--json PATH`` for the rows)."""
from __future__ import annotations

import argparse
import json
import os
import re
from pathlib import Path
from typing import Sequence


# The variables that change which kernels or tiles a benchmark times, where they are set (README's
# tuning lines; ``SLUICE_PDL`` is ``bench_decode.py``'s own column)
TIMING_SWITCHES = ("SLUICE_KERNELS", "SLUICE_ROPE_INSIDE", "SLUICE_ROPE_WARPS", "SLUICE_FP8_DECODE_TILES",
                   "SLUICE_W4_DECODE_TILES", "SLUICE_W4_BF16_PAIRS")


def switches() -> str:
    """``", switches NAME=value ..."`` for the ``TIMING_SWITCHES`` this process's environment sets, or
    nothing: a benchmark's header line names what it timed besides the defaults."""
    named = [f"{name}={os.environ[name]}" for name in TIMING_SWITCHES if name in os.environ]
    return f", switches {' '.join(named)}" if named else ""


def print_table(columns: Sequence[tuple[str, str, str]], rows: Sequence[dict], gap: bool = False) -> None:
    """``columns``: (header, row key, format spec such as ``">8.1f"``); a header takes its column's
    alignment and width. ``gap`` puts a blank line first."""
    heads = " ".join(f"{head:{re.match(r'[<>^]?[0-9]*', spec).group()}}" for head, _, spec in columns)
    print(f"\n{heads}" if gap else heads)
    for row in rows:
        print(" ".join(f"{row[key]:{spec}}" for _, key, spec in columns))


def print_sweep(rows: Sequence[dict], title: str, keys: Sequence[tuple[str, str]], config_width: int) -> None:
    """A tile sweep: per ``keys`` (row key, format spec) group, each config's time, the default
    marked ``*`` and the fastest ``<``."""
    print(f"\n{title}; * = default, < = best")
    for key in sorted({tuple(r[k] for k, _ in keys) for r in rows}):
        mine = [r for r in rows if tuple(r[k] for k, _ in keys) == key]
        best = min(r["time_us"] for r in mine)
        head = " ".join(f"{v:{spec}}" for v, (_, spec) in zip(key, keys))
        for r in mine:
            mark = ("*" if r["default"] else " ") + ("<" if r["time_us"] == best else " ")
            print(f"{head} {str(r['config']):>{config_width}} {r['time_us']:9.1f} us {mark}")


def bench_parser(doc: str) -> argparse.ArgumentParser:
    """A benchmark's parser: its docstring's first paragraph as the description, and ``--json``."""
    p = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    p.add_argument("--json", metavar="PATH", help="also write the rows here")
    return p


def write_json(path: str | None, data: object) -> None:
    """The rows to ``--json``'s path, where one was given."""
    if path:
        Path(path).write_text(json.dumps(data, indent=1))
