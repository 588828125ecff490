"""Sampling on the device with fixed shapes: greedy, temperature, top-k, top-p and per-request seeds.

Randomness is a counter-based hash of (seed, step, token id), not a generator's state, so a
request's draws depend only on its own seed and step: batching it with others, or replaying it,
gives the same tokens, and no generator state ever has to be read on the host. A grammar mask
(``worker.token_mask``), when the step has one, sets the logits of disallowed tokens to -inf first.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from moe_offload.kernels.triton_support import use_triton
from worker.gumbel import BLOCK, ROUND_SEED, gumbel_noise_eager
from worker.token_mask import TokenMask, apply_token_mask

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
    """Each field one contiguous ``[B]`` tensor (the kernel indexes them by row)."""

    temperature: torch.Tensor  # [B] float32
    top_k: torch.Tensor  # [B] int64, vocab size where off
    top_p: torch.Tensor  # [B] float32
    seed: torch.Tensor  # [B] int64
    step: torch.Tensor  # [B] int64, the index of the token being drawn
    all_greedy: bool
    mask: torch.Tensor | None = None  # [R, ceil(V/32)] int32 grammar mask words (None: no row is constrained)
    mask_rows: torch.Tensor | None = None  # [B] int64, each row's mask row, -1 where unconstrained

    @classmethod
    def build(cls, params: list[Sampling], steps: list[int], vocab: int, device: torch.device,
              mask: TokenMask | None = None) -> SamplingTensors:
        floats = torch.tensor([[p.temperature for p in params], [p.top_p for p in params]], dtype=torch.float32)
        rows = mask.rows if mask is not None else [-1] * len(params)
        ints = torch.tensor([[min(p.top_k or vocab, vocab) for p in params], [seed32(p) for p in params],
                             [s & _MASK32 for s in steps], rows], dtype=torch.int64)
        if device.type == "cuda":
            floats = floats.pin_memory().to(device, non_blocking=True)
            ints = ints.pin_memory().to(device, non_blocking=True)
        return cls(floats[0], ints[0], floats[1], ints[1], ints[2], all_greedy=all(p.temperature == 0 for p in params),
                   mask=mask.words if mask is not None else None, mask_rows=ints[3] if mask is not None else None)


def sample(logits: torch.Tensor, s: SamplingTensors, *, backend: str | None = None) -> torch.Tensor:
    """``logits [B, V]`` float32 -> next tokens ``[B]`` int64, never reading the device on the host
    (``worker.sample_kernel``); the twin runs elsewhere. Masked tokens go to -inf in ``logits``
    first (in place)."""
    if s.mask is not None:
        apply_token_mask(logits, s.mask, s.mask_rows, backend=backend)
    if s.all_greedy:
        return logits.argmax(dim=-1)
    if use_triton(logits, backend) and logits.shape[1] > 0:
        from worker.sample_kernel import launch

        return launch(logits.contiguous(), s.temperature, s.top_k, s.top_p, s.seed, s.step)
    return sample_eager(logits, s)


def sample_eager(logits: torch.Tensor, s: SamplingTensors, block: int = BLOCK) -> torch.Tensor:
    """The kernel's twin: the same rounds of rejection (see ``worker.sample_kernel``) row by row,
    reading each row's parameters and rounds on the host (the CPU path and the kernel's oracle)."""
    out = logits.argmax(dim=-1)
    for row in range(logits.shape[0]):
        t, k = float(s.temperature[row]), int(s.top_k[row])
        if t > 0 and k > 1:
            out[row] = _draw(logits[row].float() / s.temperature[row].clamp_min(1e-5), k, float(s.top_p[row]),
                             int(s.seed[row]), int(s.step[row]), block)
    return out


def _draw(scaled: torch.Tensor, top_k: int, top_p: float, seed: int, step: int, block: int) -> int:
    """One row's nucleus draw by rejection, as the kernel does it."""
    vocab = scaled.numel()
    blocks, device = -(-vocab // block), scaled.device
    weights = (scaled - scaled.max()).exp()
    block_ids = torch.arange(blocks, device=device) + vocab
    pivot, total, rnd, chosen = float("-inf"), 0.0, 0, -1
    while True:
        seed_r = torch.tensor((seed + rnd * ROUND_SEED) & _MASK32, device=device)
        above = scaled > pivot
        kept = torch.zeros(blocks * block, device=device)
        kept[:vocab] = torch.where(above, weights, 0.0)
        mass, count = kept.sum(), int(above.sum())
        keys = kept.view(blocks, block).sum(dim=1).log() + gumbel_noise_eager(seed_r, step, block_ids)
        if rnd == 0:
            total = mass
        elif count < top_k and (top_p >= 1.0 or mass <= top_p * total):
            return chosen
        b = int(keys.argmax())
        cols = torch.arange(b * block, min((b + 1) * block, vocab), device=device)
        noisy = torch.where(above[cols], scaled[cols] + gumbel_noise_eager(seed_r, step, cols), float("-inf"))
        chosen = b * block + int(noisy.argmax())
        pivot, rnd = float(scaled[chosen]), rnd + 1
