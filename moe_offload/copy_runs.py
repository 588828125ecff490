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


def bridge_gaps(runs: list[tuple[int, int, int]], max_gap: int) -> list[tuple[int, int, int]]:
    """``runs`` with every gap of at most ``max_gap`` rows between two runs copied too, where the two
    runs keep one offset between source and destination (the gap's rows then line up): fewer copies
    for more bytes, worth it where a row is a few bytes and a copy's set-up microseconds."""
    out: list[tuple[int, int, int]] = []
    for src, dst, length in runs:
        if out:
            last_src, last_dst, last_length = out[-1]
            gap = dst - (last_dst + last_length)
            if 0 <= gap <= max_gap and src - last_src == dst - last_dst:
                out[-1] = (last_src, last_dst, dst + length - last_dst)
                continue
        out.append((src, dst, length))
    return out
