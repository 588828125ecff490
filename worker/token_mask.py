"""Grammar masks on the device: logits of the tokens a constrained request may not emit -> -inf,
before sampling (greedy and sampled alike), so that top-k and top-p see only allowed tokens.

A mask is a fixed-shape bitmask ``words [R, ceil(V/32)]`` int32 (row r allows token t when bit
``t % 32`` of ``words[r, t // 32]`` is set; the scheduler fills a row per constrained request from
its grammar, on the host), and each batch row names its mask row (``rows [B]``, -1: unconstrained).
The op is one launch over a fixed grid (``worker.token_mask_kernel``) on CUDA tensors, never a
host read; ``apply_token_mask_eager`` is its twin, fixed-shape torch ops.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from moe_offload.kernels.triton_support import use_triton

WORD_BITS = 32


class TokenMask(NamedTuple):
    """A step's grammar mask: ``words`` on the device, ``rows`` one per sequence of the step (host
    ints, -1 for a sequence that is not constrained or does not sample)."""

    words: torch.Tensor  # [R, ceil(V/32)] int32
    rows: list[int]

    def check(self, sequences: int) -> None:
        """Bounds on the host, before anything launches (a kernel does not clamp)."""
        if len(self.rows) != sequences:
            raise ValueError(f"a token mask names {len(self.rows)} rows for {sequences} sequences")
        if max(self.rows, default=-1) >= self.words.shape[0]:
            raise ValueError(f"mask row {max(self.rows)} is past the mask's {self.words.shape[0]} rows")


def mask_words(vocab: int) -> int:
    return -(-vocab // WORD_BITS)


def apply_token_mask(logits: torch.Tensor, words: torch.Tensor, rows: torch.Tensor, *,
                     backend: str | None = None) -> torch.Tensor:
    """Set ``logits [B, V]`` (float32, in place; returned) to -inf where row ``rows[b]`` of
    ``words`` does not allow the token; rows with ``rows[b] < 0`` are left alone."""
    _check(logits, words, rows)
    if use_triton(logits, backend) and logits.numel() > 0:
        from worker.token_mask_kernel import launch

        launch(logits, words, rows)
        return logits
    return apply_token_mask_eager(logits, words, rows)


def apply_token_mask_eager(logits: torch.Tensor, words: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """The kernel's twin: unpack each batch row's mask words into bits, in fixed-shape torch ops."""
    vocab = logits.shape[1]
    shifts = torch.arange(WORD_BITS, dtype=torch.int32, device=logits.device)
    picked = words.index_select(0, rows.clamp(min=0))  # [B, W]
    bits = ((picked.unsqueeze(-1) >> shifts) & 1).flatten(1)[:, :vocab]
    allowed = (bits != 0) | (rows < 0).unsqueeze(1)
    return logits.masked_fill_(~allowed, float("-inf"))


def _check(logits: torch.Tensor, words: torch.Tensor, rows: torch.Tensor) -> None:
    if words.dtype != torch.int32 or rows.dtype != torch.int64:
        raise ValueError(f"a token mask is int32 words and int64 rows, got {words.dtype} and {rows.dtype}")
    if logits.dim() != 2 or rows.shape != (logits.shape[0],):
        raise ValueError(f"rows {tuple(rows.shape)} must name one mask row per logits row {tuple(logits.shape)}")
    if words.shape[1] * WORD_BITS < logits.shape[1]:
        raise ValueError(f"mask words {tuple(words.shape)} cover fewer than the {logits.shape[1]} tokens")
    if not (logits.is_contiguous() and words.is_contiguous()):
        raise ValueError("the token mask takes contiguous logits and words")
