"""Sampling on the device with fixed shapes: greedy, temperature, top-k, top-p and per-request seeds.

Randomness is a counter-based hash of (seed, step, token id), not a generator's state, so a
request's draws depend only on its own seed and step: batching it with others, or replaying it,
gives the same tokens, and no generator state ever has to be read on the host.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from worker.gumbel import gumbel_noise

_MASK32 = 0xFFFFFFFF


class Sampling(Protocol):
    """What the sampler reads of a request (``scheduler.messages.to_scheduler.SamplingParams``,
    which the worker may not import): the fields, with ``seed`` None read as 0."""

    temperature: float  # 0 = greedy
    top_k: int  # 0 = whole vocabulary
    top_p: float
    seed: int | None


def seed32(params: Sampling) -> int:
    """The seed's low 32 bits, the hash's input (None: 0)."""
    return (params.seed or 0) & _MASK32


@dataclass
class SamplingTensors:
    temperature: torch.Tensor  # [B] float32
    top_k: torch.Tensor  # [B] int64, vocab size where off
    top_p: torch.Tensor  # [B] float32
    seed: torch.Tensor  # [B] int64
    step: torch.Tensor  # [B] int64, the index of the token being drawn
    all_greedy: bool

    @classmethod
    def build(cls, params: list[Sampling], steps: list[int], vocab: int, device: torch.device) -> SamplingTensors:
        floats = torch.tensor([[p.temperature, p.top_p] for p in params], dtype=torch.float32)
        ints = torch.tensor([[min(p.top_k or vocab, vocab), seed32(p), s & _MASK32] for p, s in zip(params, steps)],
                            dtype=torch.int64)
        if device.type == "cuda":
            floats = floats.pin_memory().to(device, non_blocking=True)
            ints = ints.pin_memory().to(device, non_blocking=True)
        return cls(floats[:, 0], ints[:, 0], floats[:, 1], ints[:, 1], ints[:, 2],
                   all_greedy=all(p.temperature == 0 for p in params))


def sample(logits: torch.Tensor, s: SamplingTensors) -> torch.Tensor:
    """``logits [B, V]`` float32 -> next tokens ``[B]`` int64, never reading the device on the host."""
    greedy = logits.argmax(dim=-1)
    if s.all_greedy:
        return greedy
    B, V = logits.shape
    scaled = logits / s.temperature.clamp_min(1e-5)[:, None]
    sorted_logits, order = scaled.sort(dim=-1, descending=True)
    rank = torch.arange(V, device=logits.device)[None, :]
    # top-p on unnormalised weights: sorted descending, the first logit is the maximum and the
    # running sum's last entry the total (torch's softmax of one 150k row is one block, ~60 us on an H200)
    weights = (sorted_logits - sorted_logits[:, :1]).exp()
    running = weights.cumsum(dim=-1)
    drop = (rank >= s.top_k[:, None]) | (running - weights > s.top_p[:, None] * running[:, -1:])
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    # Gumbel-max over the kept tokens, with noise hashed from (seed, step, token)
    noise = gumbel_noise(s.seed, s.step, order)
    sampled = order.gather(1, (sorted_logits + noise).argmax(dim=-1, keepdim=True)).squeeze(1)
    return torch.where(s.temperature == 0, greedy, sampled)

