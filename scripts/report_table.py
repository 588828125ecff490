"""The benchmarks' text tables: a header line, then a line per row, each column a key of the row
dicts with its format spec (alignment, width, precision)."""
from __future__ import annotations

import re
from typing import Sequence


def print_table(columns: Sequence[tuple[str, str, str]], rows: Sequence[dict], gap: bool = False) -> None:
    """``columns``: (header, row key, format spec such as ``">8.1f"``); a header takes its column's
    alignment and width. ``gap`` puts a blank line first."""
    heads = " ".join(f"{head:{re.match(r'[<>^]?[0-9]*', spec).group()}}" for head, _, spec in columns)
    print(f"\n{heads}" if gap else heads)
    for row in rows:
        print(" ".join(f"{row[key]:{spec}}" for _, key, spec in columns))
