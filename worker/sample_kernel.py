"""The sampler (``worker.sampling``) in one launch: a program per row, no sort, no host reads.

Greedy rows read the row once for its argmax. Sampled rows draw from the nucleus by rejection:
draw a candidate from the tokens above a pivot (first: all of them), then count the tokens and sum
the mass above the candidate; if fewer than ``top_k`` tokens outrank it and their mass is at most
``top_p`` of the row's, it is in the nucleus and is the sample, else it becomes the pivot and the
draw repeats over what is left. The nucleus lies above every rejected candidate, so the accepted
one is distributed as the nucleus says; each pass over the row both judges the candidate and
weighs the blocks of the next draw:

```
 pass 0        argmax of the logits (greedy rows stop here); max of l / T
 scan(pivot)   over BLOCK-wide blocks: mass and count of tokens above the pivot, and the
               block of the next draw, argmax over blocks of log(block mass) + gumbel(block)
 draw          in that block: argmax of l / T + gumbel(token) over the tokens above the pivot
 scan, draw, scan, ...   until a scan accepts its candidate
```

A draw is a block by its mass, then a token in it by Gumbel-max: noise is hashed for one block's
tokens, not for the whole row. Randomness is ``worker.gumbel``'s hash of (seed + round, step,
token), blocks hashing as tokens ``V + b``. The twin (``worker.sampling.sample_eager``, which imports this file lazily) runs the
same rounds with torch ops; sums differ in the order of their additions, so a draw within a
rounding error of a block boundary or of the ``top_p`` cut may differ from it.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from moe_offload.kernels.triton_support import pdl_args
from worker.gumbel import BLOCK, ROUND_SEED


def launch(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
           seed: torch.Tensor, step: torch.Tensor, block: int = BLOCK) -> torch.Tensor:
    """Tokens ``[B]`` int64 for float32 ``logits [B, V]`` (rows contiguous) and ``[B]`` parameters."""
    rows, vocab = logits.shape
    if not all(p.is_contiguous() for p in (logits, temperature, top_k, top_p, seed, step)):
        raise ValueError("the sampler's kernel takes contiguous logits and parameters")
    out = torch.empty(rows, dtype=torch.int64, device=logits.device)
    _sample_kernel[(rows,)](logits, logits.stride(0), temperature, top_k, top_p, seed, step, out, vocab,
                            BLOCK=block, ROUND_SEED=ROUND_SEED, num_warps=16 if block >= 4096 else 4,
                            **pdl_args(logits))
    return out


@triton.jit
def _fmix32(h):
    """MurmurHash3's 32-bit finaliser (uint32 wraps where the twin masks)."""
    h = h ^ (h >> 16)
    h = h * tl.full(h.shape, 0x85EBCA6B, tl.uint32)
    h = h ^ (h >> 13)
    h = h * tl.full(h.shape, 0xC2B2AE35, tl.uint32)
    return h ^ (h >> 16)


@triton.jit
def _gumbel(key, token):
    """Gumbel noise of ``token`` (uint32) under a round's ``key`` (``worker.gumbel.gumbel_noise_eager``)."""
    h = _fmix32(key ^ (token * tl.full(token.shape, 0x85EBCA77, tl.uint32)))
    uniform = ((h >> 8).to(tl.float32) + 0.5) * (1.0 / 16777216.0)
    return -tl.log(-tl.log(uniform))


@triton.jit
def _round_key(seed, step, rnd, ROUND_SEED: tl.constexpr):
    """The hash's per-row prefix for round ``rnd``: ``fmix(seed_r * 0x9E3779B1 + step)``."""
    seed_r = seed + rnd.to(tl.uint32) * tl.full(seed.shape, ROUND_SEED, tl.uint32)
    return _fmix32(seed_r * tl.full(seed.shape, 0x9E3779B1, tl.uint32) + step)


# the parameters are rows of two packed [fields, B] buffers (``SamplingTensors.build``), at offsets
# that follow the batch size: not specialised on alignment (each program loads one of each)
@triton.jit(do_not_specialize_on_alignment=["temp_ptr", "topk_ptr", "topp_ptr", "seed_ptr", "step_ptr"])
def _sample_kernel(logits_ptr, stride_row, temp_ptr, topk_ptr, topp_ptr, seed_ptr, step_ptr, out_ptr, vocab,
                   BLOCK: tl.constexpr, ROUND_SEED: tl.constexpr, PDL: tl.constexpr):
    if PDL:  # see triton_support.pdl_args
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    row = tl.program_id(0)
    base = logits_ptr + row.to(tl.int64) * stride_row
    offs = tl.arange(0, BLOCK)
    best = tl.max(tl.full((BLOCK,), float("-inf"), tl.float32), 0)
    greedy = tl.min(tl.zeros((BLOCK,), tl.int64), 0)
    for start in range(0, vocab, BLOCK):  # pass 0: the argmax (the first of equal maxima)
        x = tl.load(base + start + offs, mask=start + offs < vocab, other=float("-inf"))
        m = tl.max(x, 0)
        take = m > best
        greedy = tl.where(take, start + tl.argmax(x, 0, tie_break_left=True), greedy)
        best = tl.where(take, m, best)
    temperature = tl.load(temp_ptr + row)
    top_k = tl.load(topk_ptr + row)
    if (temperature > 0) & (top_k > 1):
        top_p = tl.load(topp_ptr + row)
        seed = tl.load(seed_ptr + row).to(tl.uint32)
        step = tl.load(step_ptr + row).to(tl.uint32)
        t = tl.maximum(temperature, 1e-5)
        peak = tl.math.div_rn(best, t)  # the max of l / T (division rounded alike is monotonic)
        pivot = float("-inf")
        total = 0.0
        chosen = greedy
        rnd = 0
        done = False
        while not done:
            # scan: the mass and count above the pivot, and the next draw's block
            key = _round_key(seed, step, rnd, ROUND_SEED)
            mass = 0.0
            count = 0
            block_key = float("-inf")
            block = 0
            for start in range(0, vocab, BLOCK):
                cols = start + offs
                s = tl.math.div_rn(tl.load(base + cols, mask=cols < vocab, other=float("-inf")), t)
                above = s > pivot
                w = tl.where(above, tl.exp(s - peak), 0.0)
                here = tl.sum(w, 0)
                mass += here
                count += tl.sum(above.to(tl.int32), 0)
                b = start // BLOCK
                k = tl.log(here) + _gumbel(key, (vocab + b).to(tl.uint32))
                take = k > block_key
                block = tl.where(take, b, block)
                block_key = tl.where(take, k, block_key)
            if rnd == 0:
                total = mass
            else:
                done = (count < top_k) & ((top_p >= 1.0) | (mass <= top_p * total))
            if not done:
                # draw: Gumbel-max over the chosen block's tokens above the pivot
                cols = block * BLOCK + offs
                s = tl.math.div_rn(tl.load(base + cols, mask=cols < vocab, other=float("-inf")), t)
                y = tl.where(s > pivot, s + _gumbel(key, cols.to(tl.uint32)), float("-inf"))
                chosen = (block * BLOCK + tl.argmax(y, 0, tie_break_left=True)).to(tl.int64)
                pivot = tl.math.div_rn(tl.load(base + chosen), t)
                rnd += 1
        tl.store(out_ptr + row, chosen)
    else:
        tl.store(out_ptr + row, greedy.to(tl.int64))
