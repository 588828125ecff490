"""Sampling on the device with fixed shapes: greedy, temperature, top-k, top-p and per-request seeds.

Randomness is a counter-based hash of (seed, step, token id), not a generator's state, so a
request's draws depend only on its own seed and step: batching it with others, or replaying it,
gives the same tokens, and no generator state ever has to be read on the host.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from worker.gumbel import gumbel_noise

_MASK32 = 0xFFFFFFFF
_INT64_MAX = 2**63 - 1


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # 0 = whole vocabulary
    top_p: float = 1.0
    seed: int = 0

    def validate(self) -> None:
        """What ``SamplingTensors.build`` can hold: finite floats, ints that fit int64."""
        if not 0 <= self.temperature < float("inf"):
            raise ValueError(f"temperature must be finite and >= 0, got {self.temperature}")
        if not 0 <= self.top_k <= _INT64_MAX:
            raise ValueError(f"top_k must be in [0, 2**63 - 1], got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")


@dataclass
class SamplingTensors:
    temperature: torch.Tensor  # [B] float32
    top_k: torch.Tensor  # [B] int64, vocab size where off
    top_p: torch.Tensor  # [B] float32
    seed: torch.Tensor  # [B] int64
    step: torch.Tensor  # [B] int64, the index of the token being drawn
    all_greedy: bool

    @classmethod
    def build(cls, params: list[SamplingParams], steps: list[int], vocab: int, device: torch.device) -> SamplingTensors:
        floats = torch.tensor([[p.temperature, p.top_p] for p in params], dtype=torch.float32)
        ints = torch.tensor([[min(p.top_k or vocab, vocab), p.seed & _MASK32, s & _MASK32] for p, s in zip(params, steps)],
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
    probs = sorted_logits.softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs
    drop = (rank >= s.top_k[:, None]) | (mass_before > s.top_p[:, None])
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    # Gumbel-max over the kept tokens, with noise hashed from (seed, step, token)
    noise = gumbel_noise(s.seed, s.step, order)
    sampled = order.gather(1, (sorted_logits + noise).argmax(dim=-1, keepdim=True)).squeeze(1)
    return torch.where(s.temperature == 0, greedy, sampled)

