"""One forward step's inputs: the new tokens of every sequence and where their KV lives.

All index lists are built on the host from Python ints (the scheduler knows every length) and
sent to the device in one pinned, non-blocking copy, so building a batch never waits on the GPU.
"""
from __future__ import annotations

from array import array
from dataclasses import dataclass, field, replace
from typing import NamedTuple

import torch


class SequenceChunk(NamedTuple):
    """One sequence's share of a step."""

    token_ids: list[int]  # new tokens (for an overlapped decode step, placeholders)
    prefix_len: int  # tokens of this sequence already in the KV pool
    pages: list[int]  # page table covering prefix_len + len(token_ids) tokens
    buffer_slot: int = -1  # >= 0: the (single) new token is token_buffer[buffer_slot], on the device
    # hybrid models: the recurrent-state slot (worker.kv.state_pool); with prefix_len > 0 it holds the
    # state after the prefix, with prefix_len 0 the step clears it first
    state_slot: int = -1
    # gpt-oss with a window pool: the sliding layers' page table, position to page like ``pages``; pages
    # wholly before the window are 0 (freed). None: ``pages`` folded into the window pool (``window_lists``)
    window_pages: list[int] | None = None
    # hybrid models: (n, slot): the linear layers also leave their state after the first n new
    # tokens (0 < n < len(token_ids)) in state slot ``slot``, a prompt-end snapshot inside the chunk
    state_snapshot: tuple[int, int] | None = None


class Varlen(NamedTuple):
    """Sequences packed back to back for the linear layers: a state slot each ``[B]``, where each
    starts ``[B + 1]`` on the device, and the starts on the host."""

    slots: torch.Tensor
    cu_seqlens: torch.Tensor
    cu_seqlens_host: list[int]


class StateSplit(NamedTuple):
    """A prefill batch whose linear layers stop inside some sequences to snapshot their state
    (``SequenceChunk.state_snapshot``). The tokens are reordered so that every sequence's head
    (its tokens up to the snapshot, or all of them) comes before the tails; ``head`` runs the conv
    and the delta rule over the heads, the split sequences' slots ``copy_from`` are copied into
    their snapshot slots ``copy_to``, then ``tail`` runs over the tails, resuming from the heads'
    states. Everything else of the layer is per token and runs over the batch at once.

    ```
     tokens   a0 a1 a2 a3 a4 | b0 b1 b2        snapshot of a after a2
     order    a0 a1 a2 b0 b1 b2 | a3 a4        head: [a0..a2], [b0..b2]; tail: [a3 a4]
     ```
    """

    order: torch.Tensor | None  # [T] batch index of each reordered token (None: already in order)
    inverse: torch.Tensor | None  # [T] reordered index of each batch token
    head: Varlen
    tail: Varlen
    head_tokens: int
    copy_from: torch.Tensor
    copy_to: torch.Tensor


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    out_loc: torch.Tensor  # [T] flat KV slot (page * page_size + offset) of each new token
    last_index: torch.Tensor  # [B] index in T of each sequence's last new token
    page_table: torch.Tensor  # [B, max_pages] int64, padded with page 0
    seq_lens: torch.Tensor  # [B] tokens in KV after this step
    num_tokens: int
    is_decode: bool
    # whether the experts stream through the prefill pipeline: decided once, from the token count
    # (``Experts.pipeline_from``); the MoE layers read it
    pipelined: bool = False
    # host copies of the lengths for per-sequence prefill loops (no device reads); decode needs none
    q_lens: list[int] = field(default_factory=list)
    seq_lens_host: list[int] = field(default_factory=list)
    # the page table's rows on the host (a prefix in one run of pages is read in place: cudnn_prefill)
    page_table_host: list[list[int]] = field(default_factory=list)
    # hybrid models: each sequence's state slot [B], where each sequence's tokens start [B + 1], and
    # the slots that start from nothing (None: none)
    state_slots: torch.Tensor | None = None
    cu_seqlens: torch.Tensor | None = None
    fresh_slots: torch.Tensor | None = None
    # hybrid models whose chunks snapshot their state inside them: the linear layers' two passes
    state_split: StateSplit | None = None
    # gpt-oss with a window pool: this batch with the sliding layers' ``out_loc`` and ``page_table``
    window: ForwardBatch | None = None

    @property
    def cu_seqlens_host(self) -> list[int]:
        out = [0]
        for n in self.q_lens:
            out.append(out[-1] + n)
        return out


def build_batch(chunks: list[SequenceChunk], page_size: int, device: torch.device,
                token_buffer: torch.Tensor | None = None, pipeline_from: int | None = None,
                window_pool_pages: int = 0, window: int = 0) -> ForwardBatch:
    """Chunks with a ``buffer_slot`` take their token from ``token_buffer`` on the device: the
    token sampled by the previous step, which the host has not read yet (overlap scheduling). A
    batch of ``pipeline_from`` tokens or more is ``pipelined`` (None: none is). With
    ``window_pool_pages`` (the window pool's size) the batch carries the sliding layers' tables
    (``window``: their keys per query)."""
    ids, pos, loc, last, table, lens, src = _row_lists(chunks, page_size)
    T, max_pages = len(ids), len(table[0])
    states = _state_lists(chunks)
    split, split_host = _split_lists(chunks) if any(c.state_snapshot for c in chunks) else ([], None)
    windows = window_lists(chunks, page_size, max_pages, window_pool_pages, window) if window_pool_pages else []
    packed = to_device([ids, pos, loc, last, sum(table, []), lens, src, *windows, *states, *split], device)
    ids_t, pos_t, loc_t, last_t, table_t, lens_t, src_t = packed[:7]
    if token_buffer is not None:
        ids_t = torch.where(src_t >= 0, token_buffer[src_t.clamp(min=0)], ids_t)
    slots, cu, fresh = packed[7 + len(windows):10 + len(windows)] if states else (None, None, None)
    batch = ForwardBatch(ids_t, pos_t, loc_t, last_t, table_t.view(len(chunks), max_pages), lens_t,
                         T, is_decode=T == len(chunks), pipelined=pipeline_from is not None and T >= pipeline_from,
                         q_lens=[len(c.token_ids) for c in chunks], seq_lens_host=lens, page_table_host=table,
                         state_slots=slots,
                         cu_seqlens=cu, fresh_slots=fresh if fresh is not None and fresh.numel() else None,
                         state_split=_state_split(packed[len(packed) - len(split):], split_host) if split else None)
    if windows:  # the window pool's pages: not ``table``'s
        batch.window = replace(batch, out_loc=packed[7], page_table=packed[8].view(len(chunks), max_pages),
                               page_table_host=[])
    return batch


def _row_lists(chunks: list[SequenceChunk], page_size: int) -> tuple[list, ...]:
    """A batch's host lists: new tokens' ids, positions, KV slots; each row's last token; the page
    table (the pages that hold this step's tokens, padded with page 0); lengths; buffer slots."""
    ids, pos, loc, last, table, lens, src = [], [], [], [], [], [], []
    for b, c in enumerate(chunks):
        n, seq_len = len(c.token_ids), c.prefix_len + len(c.token_ids)
        if n == 0 or len(c.pages) * page_size < seq_len:
            raise ValueError(f"sequence {b}: {n} new tokens, {seq_len} in all, {len(c.pages)} pages")
        start = len(ids)
        ids += c.token_ids
        src += [c.buffer_slot] * n
        pos += range(c.prefix_len, seq_len)
        loc += [c.pages[p // page_size] * page_size + p % page_size for p in range(c.prefix_len, seq_len)]
        last.append(start + n - 1)
        table.append(c.pages[:-(-seq_len // page_size)])
        lens.append(seq_len)
    max_pages = max(len(row) for row in table)
    return ids, pos, loc, last, [row + [0] * (max_pages - len(row)) for row in table], lens, src


def window_lists(chunks: list[SequenceChunk], page_size: int, width: int, pool_pages: int,
                 window: int) -> list[list[int]]:
    """The sliding layers' slots of the new tokens and their page table ``[B * width]``, checked
    on the host against the window pool's ``pool_pages``. A chunk without ``window_pages`` (a
    direct caller of the runner: benchmarks, tests) has its ``pages`` folded into the pool, where
    the pages the step reads and writes must stay apart, in every such row."""
    loc, table, folded = [], [], []
    for b, c in enumerate(chunks):
        pages = c.window_pages if c.window_pages is not None else [1 + (p - 1) % (pool_pages - 1) for p in c.pages]
        seq_len = c.prefix_len + len(c.token_ids)
        row = pages[:-(-seq_len // page_size)]
        if len(row) * page_size < seq_len or not all(0 < p < pool_pages for p in row[c.prefix_len // page_size:]) \
                or max(row) >= pool_pages:
            raise ValueError(f"sequence {b}: window pages {row} do not hold its {seq_len} tokens in a pool of "
                             f"{pool_pages} pages")
        if c.window_pages is None:
            folded += row[max(c.prefix_len - window + 1, 0) // page_size:]
        loc += [row[p // page_size] * page_size + p % page_size for p in range(c.prefix_len, seq_len)]
        table += row + [0] * (width - len(row))
    if len(folded) != len(set(folded)):
        raise ValueError(f"pages folded into the window pool of {pool_pages} overlap; give the chunks window_pages")
    return [loc, table]


def _state_lists(chunks: list[SequenceChunk]) -> list[list[int]]:
    """State slots, sequence starts and the slots to clear; none when no chunk has a state slot."""
    slots = [c.state_slot for c in chunks]
    if max(slots) < 0:
        return []
    if min(slots) < 0 or len(set(slots)) != len(slots):
        raise ValueError(f"every sequence of a hybrid model needs its own state slot; got {slots}")
    cu = [0]
    for c in chunks:
        cu.append(cu[-1] + len(c.token_ids))
    return [slots, cu, [c.state_slot for c in chunks if c.prefix_len == 0]]


def _split_lists(chunks: list[SequenceChunk]) -> tuple[list[list[int]], tuple[int, list[int], list[int]]]:
    """``StateSplit``'s index lists (order, inverse, head slots and starts, tail slots and starts,
    copy_from, copy_to), and on the host the head's token count and both passes' starts."""
    heads, tails, copies, start = [], [], [], 0
    for b, c in enumerate(chunks):
        n = len(c.token_ids)
        cut = n
        if c.state_snapshot is not None:
            cut, slot = c.state_snapshot
            if not 0 < cut < n or c.state_slot < 0 or slot < 0 or slot in {x.state_slot for x in chunks}:
                raise ValueError(f"sequence {b}: a state snapshot after {cut} of its {n} new tokens into slot "
                                 f"{slot}: it must fall inside the chunk, from its own slot into one no sequence "
                                 f"runs in")
            tails.append((start + cut, n - cut, c.state_slot))
            copies.append((c.state_slot, slot))
        heads.append((start, cut, c.state_slot))
        start += n
    if len({slot for _, slot in copies}) != len(copies):
        raise ValueError(f"state snapshots {copies} share a slot")
    order = [t for s, n, _ in heads + tails for t in range(s, s + n)]
    inverse = [0] * start
    for i, t in enumerate(order):
        inverse[t] = i
    in_order = order == list(range(start))  # a split of the last sequence only (one sequence: always)
    head_cu, tail_cu = _starts([n for _, n, _ in heads]), _starts([n for _, n, _ in tails])
    lists = [[] if in_order else order, [] if in_order else inverse, [s for *_, s in heads], head_cu,
             [s for *_, s in tails], tail_cu, [a for a, _ in copies], [b for _, b in copies]]
    return lists, (head_cu[-1], head_cu, tail_cu)


def _starts(lengths: list[int]) -> list[int]:
    out = [0]
    for n in lengths:
        out.append(out[-1] + n)
    return out


def _state_split(t: list[torch.Tensor], host: tuple[int, list[int], list[int]]) -> StateSplit:
    order, inverse, head_slots, head_cu, tail_slots, tail_cu, copy_from, copy_to = t
    head_tokens, head_cu_host, tail_cu_host = host
    return StateSplit(order if order.numel() else None, inverse if inverse.numel() else None,
                      Varlen(head_slots, head_cu, head_cu_host), Varlen(tail_slots, tail_cu, tail_cu_host),
                      head_tokens, copy_from, copy_to)


def host_int64(values: list[int]) -> torch.Tensor:
    """``values`` as an int64 CPU tensor through an ``array``: about a third of ``torch.tensor``'s time
    on a list, for a decode step's page table over 128k tokens (``scripts/bench_scheduler_host.py``)."""
    return torch.frombuffer(array("q", values), dtype=torch.int64) if values else torch.empty(0, dtype=torch.int64)


def to_device(lists: list[list[int]], device: torch.device) -> list[torch.Tensor]:
    """One host buffer, one copy: pinned and non-blocking on CUDA, so no stream is drained."""
    sizes = [len(x) for x in lists]
    host = host_int64([v for x in lists for v in x])
    if device.type == "cuda":
        host = host.pin_memory().to(device, non_blocking=True)
    return list(host.split(sizes))
