"""Gumbel noise hashed from (seed, step, token): the randomness of ``worker.sampling``.

The hash is MurmurHash3's 32-bit finaliser applied twice, on int64 tensors holding 32-bit values
(masked after each product). The sampler's kernel (``worker.sample_kernel._gumbel``) computes the
same bits in uint32 arithmetic, which wraps exactly where the masks cut; the two agree bit for bit
up to the last ``log`` (a float32 ulp at most).
"""
from __future__ import annotations

import torch

_MASK32 = 0xFFFFFFFF
# the shape of a draw, shared by the sampler's kernel and its twin: a draw picks one of the row's
# BLOCK-wide blocks, then a token in it; a program's pass over a 152k row is latency-bound, so the
# more loads in flight the better (4096: 32 us a greedy row on an H200)
BLOCK = 16384
ROUND_SEED = 0x632BE5AB  # round r of a draw hashes with seed + r * ROUND_SEED


def gumbel_noise_eager(seed: torch.Tensor, step: int | torch.Tensor, token: torch.Tensor) -> torch.Tensor:
    """Float32 noise of ``token`` (int64, any shape) for 32-bit ``seed`` and ``step`` broadcast against it."""
    h = _fmix32((seed * 0x9E3779B1 + step) & _MASK32)
    h = _fmix32((h ^ (token * 0x85EBCA77)) & _MASK32)
    uniform = ((h >> 8).float() + 0.5) * (1.0 / (1 << 24))
    return -torch.log(-torch.log(uniform))


def _fmix32(h: torch.Tensor) -> torch.Tensor:
    """MurmurHash3's finaliser on int64 tensors holding 32-bit values (products keep the low bits)."""
    h = h ^ (h >> 16)
    h = (h * 0x85EBCA6B) & _MASK32
    h = h ^ (h >> 13)
    h = (h * 0xC2B2AE35) & _MASK32
    return h ^ (h >> 16)
