"""Host costs of the scheduler that grow with an agent session's context (CPU only, no model).

1. The prefix cache over one session: each turn inserts the whole history (whole pages) and looks
   up the nodes ending at two of its page boundaries, one walk each, as gpt-oss's windows are
   found at a request's end (a hybrid's snapshots share one walk: ``nodes_ending_at``). The bound
   is three compares of the context's tokens against a tuple of them, one a walk: a walk down the
   session's path need not read a token twice.
2. The decode step's host tensor of one row's page table (`worker.batch.host_int64` against
   `torch.tensor` on the list), at the last turn's pages.

    python scripts/bench_scheduler_host.py [--turns 60] [--context 4000] [--turn-tokens 2112]

``node_ending_at`` and ``insert`` keep their signatures, so an older tree's ``scheduler/`` runs
the first part as it was (e.g. ``git show REV:scheduler/radix_cache.py``).
"""
from __future__ import annotations

import argparse
import random
import time

import torch

from scheduler.radix_cache import RadixCache

PAGE = 16


def timed(fn, repeat: int = 1) -> float:
    """Seconds a call, the best of ``repeat``."""
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def session(args: argparse.Namespace) -> None:
    rng, tree, next_page = random.Random(0), RadixCache(PAGE), 1
    tokens = [rng.randrange(10, 50000) for _ in range(args.context)]
    total = {"insert": 0.0, "lookups": 0.0, "bound": 0.0}
    print(f"{'turn':>5} {'context':>8} {'insert ms':>10} {'2 lookups ms':>13} {'bound ms':>9} {'ratio':>6}")
    for turn in range(args.turns):
        num = len(tokens) // PAGE
        pages = list(range(next_page, next_page + num))
        next_page += num
        ends = [num * PAGE - 5 * PAGE, num * PAGE]
        cached = tuple(tokens[:num * PAGE])
        row = {"insert": timed(lambda: tree.insert(tokens, pages)),
               "lookups": timed(lambda: [tree.node_ending_at(tokens, end) for end in ends]),
               "bound": timed(lambda: tuple(tokens[:num * PAGE]) == cached, 3)}
        for key, value in row.items():
            total[key] += value
        if turn % 10 == 9 or turn == args.turns - 1:
            walk = row["insert"] + row["lookups"]
            print(f"{turn:>5} {len(tokens):>8} {1e3 * row['insert']:>10.2f} {1e3 * row['lookups']:>13.2f} "
                  f"{1e3 * row['bound']:>9.2f} {3 * row['bound'] / walk:>6.2f}")
        tokens = tokens + [rng.randrange(10, 50000) for _ in range(args.turn_tokens)]
    walks = total["insert"] + total["lookups"]
    print(f"all turns: insert {total['insert']:.3f} s, lookups {total['lookups']:.3f} s; bound (three passes over "
          f"each turn's context) {3 * total['bound']:.3f} s, ratio {3 * total['bound'] / walks:.2f}")


def packing(args: argparse.Namespace) -> None:
    from worker.batch import host_int64  # here: an older tree without it still runs the first part

    last_turn = args.context + (args.turns - 1) * args.turn_tokens
    pages = list(range(1, last_turn // PAGE + 1))
    by_list = timed(lambda: torch.tensor(pages, dtype=torch.int64), 20)
    by_array = timed(lambda: host_int64(pages), 20)
    print(f"page-table row of {len(pages)} pages: torch.tensor {1e6 * by_list:.0f} us, host_int64 "
          f"{1e6 * by_array:.0f} us")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--turns", type=int, default=60)
    parser.add_argument("--context", type=int, default=4000, help="tokens of the first turn")
    parser.add_argument("--turn-tokens", type=int, default=2112, help="tokens each turn adds")
    args = parser.parse_args(argv)
    session(args)
    packing(args)


if __name__ == "__main__":
    main()
