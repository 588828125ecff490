"""Gumbel noise hashed from (seed, step, token): the randomness of ``worker.sampling``.

The hash is MurmurHash3's 32-bit finaliser applied twice; eagerly it is about 27 elementwise
launches over ``[B, V]`` per decode step (int64 tensors holding 32-bit values, masked after each
product), in the kernel one launch in uint32 arithmetic, which wraps exactly where the masks cut.
The two agree bit for bit up to the last ``log`` (a float32 ulp at most).
"""
from __future__ import annotations

import functools

import torch

from moe_offload.kernels.triton_support import use_triton

_MASK32 = 0xFFFFFFFF
BLOCK = 1024


def gumbel_noise(seed: torch.Tensor, step: torch.Tensor, token: torch.Tensor, *,
                 backend: str | None = None) -> torch.Tensor:
    """``seed, step [B]`` int64 (32-bit values), ``token [B, V]`` int64 -> float32 noise ``[B, V]``."""
    if seed.shape != step.shape or token.dim() != 2 or seed.shape != token.shape[:1]:
        raise ValueError(f"expected seed, step [B] and token [B, V]; got {tuple(seed.shape)}, {tuple(step.shape)}, "
                         f"{tuple(token.shape)}")
    if not use_triton(token, backend) or token.numel() == 0:
        return gumbel_noise_eager(seed[:, None], step[:, None], token)
    token = token.contiguous()
    noise = torch.empty(token.shape, dtype=torch.float32, device=token.device)
    vocab = token.shape[1]
    _kernel()[(token.shape[0], -(-vocab // BLOCK))](seed, step, token, noise, vocab, BLOCK=BLOCK)
    return noise


def gumbel_noise_eager(seed: torch.Tensor, step: torch.Tensor, token: torch.Tensor) -> torch.Tensor:
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


@functools.cache
def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def gumbel_kernel(seed_ptr, step_ptr, token_ptr, noise_ptr, vocab, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        live = cols < vocab
        seed = tl.load(seed_ptr + row).to(tl.uint32)  # the low 32 bits, as the twin's masks keep
        step = tl.load(step_ptr + row).to(tl.uint32)
        token = tl.load(token_ptr + row * vocab + cols, mask=live, other=0).to(tl.uint32)
        h = seed * tl.full((BLOCK,), 0x9E3779B1, tl.uint32) + step
        for r in tl.static_range(2):  # MurmurHash3's finaliser, twice
            if r == 1:
                h = h ^ (token * tl.full((BLOCK,), 0x85EBCA77, tl.uint32))
            h = h ^ (h >> 16)
            h = h * tl.full((BLOCK,), 0x85EBCA6B, tl.uint32)
            h = h ^ (h >> 13)
            h = h * tl.full((BLOCK,), 0xC2B2AE35, tl.uint32)
            h = h ^ (h >> 16)
        uniform = ((h >> 8).to(tl.float32) + 0.5) * (1.0 / 16777216.0)
        tl.store(noise_ptr + row * vocab + cols, -tl.log(-tl.log(uniform)), mask=live)

    return gumbel_kernel
