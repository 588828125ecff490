"""Index pairs grouped into runs that one copy moves: the copy engine's calls cost microseconds
each, so a list of rows to move becomes as few slice copies as its consecutive stretches allow."""
from __future__ import annotations


def copy_runs(src: list[int], dst: list[int]) -> list[tuple[int, int, int]]:
    """Maximal ``(src_start, dst_start, length)`` runs of pairs consecutive on both sides."""
    runs: list[tuple[int, int, int]] = []
    for s, d in zip(src, dst):
        if runs and runs[-1][0] + runs[-1][2] == s and runs[-1][1] + runs[-1][2] == d:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((s, d, 1))
    return runs
