"""Summarise a ``py-spy record --format raw`` profile: where the samples inside a prefill chunk
(``ModelRunner.forward``) went, and whether any of them waited in a synchronising call.

    py-spy record --idle --native --format raw -o prof.txt -- python scripts/bench_prefill.py ...
    python scripts/pyspy_summary.py prof.txt [--inside ModelRunner.forward] [--top 12]

A chunk that never syncs spends its host time enqueueing kernels; the bench's own
``torch.cuda.synchronize`` after the chunk (outside ``forward``) is where the host waits for the
GPU. A hidden sync shows as samples inside ``forward`` whose leaf is a synchronising call (native
frames such as ``cudaStreamSynchronize`` / ``cuMemcpyDtoH``, or the Python line that triggered it).
"""
from __future__ import annotations

import argparse
import re
from collections import Counter

SYNC_FRAMES = re.compile(r"synchroniz|cuMemcpyDtoH|cudaMemcpy[^A]|local_scalar_dense|nonzero|(?<![A-Za-z_])item \(",
                         re.IGNORECASE)


def parse(path: str) -> list[tuple[list[str], int]]:
    stacks = []
    with open(path) as f:
        for line in f:
            line = line.rstrip("\n")
            if not line:
                continue
            frames, _, count = line.rpartition(" ")
            stacks.append((frames.split(";"), int(count)))
    return stacks


def summarise(stacks: list[tuple[list[str], int]], inside: str, top: int) -> None:
    total = sum(n for _, n in stacks)
    leaves, sync_leaves = Counter(), Counter()
    within = 0
    for frames, n in stacks:
        at = next((i for i, f in enumerate(frames) if f.startswith(f"{inside} (")), None)
        if at is None:
            continue
        within += n
        leaf = frames[-1]
        python_leaf = next((f for f in reversed(frames) if ".py:" in f), leaf)
        leaves[f"{python_leaf}  <-  {leaf}" if leaf != python_leaf else leaf] += n
        hit = next((f for f in frames[at:] if SYNC_FRAMES.search(f)), None)
        if hit:
            sync_leaves[f"{hit}  (from {python_leaf})"] += n
    print(f"{total} samples, {within} inside {inside} ({within / max(total, 1):.1%})")
    print(f"top leaf frames inside {inside}:")
    for frame, n in leaves.most_common(top):
        print(f"  {n:>6} {n / max(within, 1):>6.1%}  {frame}")
    print(f"synchronising frames inside {inside}: {sum(sync_leaves.values())} samples")
    for frame, n in sync_leaves.most_common(top):
        print(f"  {n:>6}  {frame}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("profile")
    p.add_argument("--inside", default="ModelRunner.forward", help="function whose samples are the chunk")
    p.add_argument("--top", type=int, default=12)
    args = p.parse_args()
    summarise(parse(args.profile), args.inside, args.top)


if __name__ == "__main__":
    main()
