"""The step rank 0 sends every other rank: what ``ModelRunner.forward`` was called with, as two
int64 host tensors (a fixed-size header, then a payload whose length the header gives). No
pickled objects: a rank decodes plain integers into the same chunks and sampling parameters.

```
 header   [op, chunks B, payload length, token buffer length (0: none)]
 payload  per chunk: tokens n, prefix_len, pages p, buffer_slot, window pages w (-1: none)  (5B)
          per chunk: temperature, top_k, top_p, seed (floats as f64 bits) (4B)
          steps                                                           (B)
          token ids of every chunk, then pages of every chunk, then window pages of every chunk
```
"""
from __future__ import annotations

import struct
from enum import IntEnum
from typing import NamedTuple

import torch

from worker.batch import SequenceChunk
from worker.sampling import Sampling, seed32

HEADER_LEN = 4


class Op(IntEnum):
    STEP = 1  # run ModelRunner.forward on the payload
    CAPTURE_GRAPHS = 2  # capture every decode graph bucket (the warm-up's DecodeGraphs.capture_all)
    STOP = 3  # leave the loop: the run ends in order
    STATS = 4  # answer with the experts' counters (rank_stats; payload length = how many)
    RESET_STATS = 5  # zero them (after the warm-up)


class RankSampling(NamedTuple):
    """A request's sampling as a rank receives it: the fields the sampler reads (``Sampling``; the
    scheduler's ``SamplingParams`` is a message, which the worker may not import)."""

    temperature: float
    top_k: int
    top_p: float
    seed: int


class Step(NamedTuple):
    chunks: list[SequenceChunk]
    sampling: list[Sampling]
    steps: list[int]
    buffer_len: int  # rows of the token buffer the step reads (0: it has none)


def header(op: Op, num_chunks: int = 0, payload_len: int = 0, buffer_len: int = 0) -> torch.Tensor:
    return torch.tensor([int(op), num_chunks, payload_len, buffer_len], dtype=torch.int64)


def encode(step: Step) -> tuple[torch.Tensor, torch.Tensor]:
    """``(header, payload)`` of a STEP."""
    chunks = step.chunks
    flat = [v for c in chunks for v in (len(c.token_ids), c.prefix_len, len(c.pages), c.buffer_slot,
                                        -1 if c.window_pages is None else len(c.window_pages))]
    flat += [v for p in step.sampling for v in (_bits(p.temperature), p.top_k, _bits(p.top_p), seed32(p))]  # the sampler reads a seed's low 32 bits
    flat += step.steps
    for c in chunks:
        flat += c.token_ids
    for c in chunks:
        flat += c.pages
    for c in chunks:
        flat += c.window_pages or []
    payload = torch.tensor(flat, dtype=torch.int64)
    return header(Op.STEP, len(chunks), payload.numel(), step.buffer_len), payload


def decode(head: list[int], payload: torch.Tensor) -> Step:
    """The STEP that ``encode`` packed; ``head`` is the header as Python ints."""
    _, num, _, buffer_len = head
    flat = payload.tolist()
    shapes = [flat[5 * b:5 * b + 5] for b in range(num)]
    params = [flat[5 * num + 4 * b:5 * num + 4 * b + 4] for b in range(num)]
    sampling = [RankSampling(_float(t), k, _float(p), s) for t, k, p, s in params]
    steps = flat[9 * num:10 * num]
    at, tokens, tables = 10 * num, [], []
    for n, *_ in shapes:
        tokens.append(flat[at:at + n])
        at += n
    for _, _, pages, _, _ in shapes:
        tables.append(flat[at:at + pages])
        at += pages
    chunks = []
    for (_, prefix, _, slot, window), ids, table in zip(shapes, tokens, tables):
        windows = None if window < 0 else flat[at:at + window]
        chunks.append(SequenceChunk(ids, prefix, table, slot, window_pages=windows))
        at += max(window, 0)
    return Step(chunks, sampling, steps, buffer_len)


def _bits(x: float) -> int:
    return struct.unpack("<q", struct.pack("<d", x))[0]


def _float(bits: int) -> float:
    return struct.unpack("<d", struct.pack("<q", bits))[0]
