"""The radix tree's walks by themselves: the one-walk lookup of several positions against one walk
each, and the page compare that a walk makes at every node (whole pages, stopped by the end)."""
from __future__ import annotations

import random

from hypothesis import given, settings, strategies as st

from scheduler.radix_cache import RadixCache
from scripts import bench_scheduler_host

P = 4


def shape(tree: RadixCache) -> list[tuple[tuple[int, ...], tuple[int, ...], list[int]]]:
    """Every node as (its path's tokens, its key, its pages), in a canonical order."""
    out, todo = [], [(tree.root, ())]
    while todo:
        node, above = todo.pop()
        out.append((above, node.key, list(node.pages or [])))
        todo += [(child, above + node.key) for child in node.children.values()]
    return sorted(out)


def grown(seed: int) -> tuple[RadixCache, list[list[int]]]:
    """A tree of sessions that share prefixes and branch mid-node, as turns of agents do."""
    rng, tree, seqs, page = random.Random(seed), RadixCache(P), [], 1
    for _ in range(6):
        base = rng.choice(seqs)[:rng.randrange(0, 40)] if seqs and rng.random() < 0.7 else []
        seq = base + [rng.randrange(3) for _ in range(rng.randrange(1, 48))]
        pages = list(range(page, page + len(seq) // P))
        page += len(pages)
        tree.insert(seq, pages)
        seqs.append(seq)
    return tree, seqs


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 10_000), st.data())
def test_one_walk_finds_what_a_walk_per_position_finds(seed, data):
    one, seqs = grown(seed)
    each, _ = grown(seed)
    tokens = data.draw(st.sampled_from(seqs)) + data.draw(st.lists(st.integers(0, 2), max_size=9))
    positions = sorted(set(data.draw(st.lists(st.integers(1, len(tokens) // P + 2), max_size=6))))
    positions = [p * P for p in positions]
    oracle, _ = grown(seed)
    cached = len(oracle.match(tokens).pages) * P  # the whole pages of tokens the tree holds
    found = one.nodes_ending_at(tokens, positions)
    wanted = [each.node_ending_at(tokens, pos) for pos in positions]
    assert [n is None for n in found] == [n is None for n in wanted] == [pos > cached for pos in positions]
    for pos, node, want in zip(positions, found, wanted):
        if node is not None:  # the node's path spells tokens[:pos] exactly
            assert node.key == want.key and sum((n.key for n in one.path(node)), ()) == tuple(tokens[:pos])
    assert shape(one) == shape(each)  # the same splits
    one.check()


def test_common_pages_counts_whole_pages_up_to_the_end():
    tree = RadixCache(P)
    key = tuple(range(12))
    tokens = [9, 9] + list(range(12)) + [7]
    assert tree._common_pages(key, tokens, 2) == 3
    assert tree._common_pages(key, tokens, 2, end=2 + 7) == 1  # 7 tokens: one whole page
    assert tree._common_pages(key, tokens, 2, end=2 + 8) == 2
    assert tree._common_pages(key, tokens[:2 + 6] + [0] * 8, 2) == 1  # differs inside the second page
    assert tree._common_pages(key, tokens, 0) == 0
    assert tree._common_pages(key, tokens, 13) == 0  # fewer than a page left


def test_host_benchmark_runs_a_short_session(capsys):
    bench_scheduler_host.main(["--turns", "3", "--context", "100", "--turn-tokens", "40"])
    out = capsys.readouterr().out
    assert "all turns: insert" in out and "page-table row of 11 pages" in out  # the last turn: (100 + 2 * 40) // 16
