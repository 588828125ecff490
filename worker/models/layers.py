"""The building blocks both families share: RMSNorm and rotary position embedding."""
from __future__ import annotations

import torch


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Normalise in float32 and scale in the input dtype, as the reference implementation does."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


class Rotary:
    """cos/sin tables for every position up to the context length (rotate-half convention)."""

    def __init__(self, head_dim: int, theta: float, max_positions: int, device: torch.device):
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos = emb.cos().to(device)
        self.sin = emb.sin().to(device)

    def __call__(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """``x [T, heads, D]`` rotated by each token's position ``[T]``."""
        cos = self.cos[positions].to(x.dtype)[:, None, :]
        sin = self.sin[positions].to(x.dtype)[:, None, :]
        half = x.shape[-1] // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return x * cos + rotated * sin
