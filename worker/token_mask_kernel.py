"""``worker.token_mask``'s kernel: a program per (batch row, BLOCK of tokens); a row whose mask row
is -1 returns at once, else each token reads its mask word and a disallowed one is set to -inf."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from moe_offload.kernels.triton_support import pdl_args

BLOCK = 4096


def launch(logits: torch.Tensor, words: torch.Tensor, rows: torch.Tensor) -> None:
    batch, vocab = logits.shape
    grid = (batch, triton.cdiv(vocab, BLOCK))
    _mask_kernel[grid](logits, logits.stride(0), words, words.stride(0), rows, vocab, BLOCK=BLOCK, num_warps=4,
                       **pdl_args(logits))


# the rows are a row of the sampling parameters' packed buffer, at an offset that follows the batch
# size: not specialised on alignment
@triton.jit(do_not_specialize_on_alignment=["rows_ptr"])
def _mask_kernel(logits_ptr, logits_stride, words_ptr, words_stride, rows_ptr, vocab,
                 BLOCK: tl.constexpr, PDL: tl.constexpr):
    if PDL:  # see triton_support.pdl_args
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    b = tl.program_id(0)
    row = tl.load(rows_ptr + b)
    if row >= 0:
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        inside = cols < vocab
        word = tl.load(words_ptr + row * words_stride + cols // 32, mask=inside, other=0)
        allowed = ((word >> (cols % 32)) & 1) != 0
        tl.store(logits_ptr + b.to(tl.int64) * logits_stride + cols, float("-inf"), mask=inside & ~allowed)
