"""Paged decode attention in Triton (one new token per sequence), flash-decoding style.

Grid ``(B, kv_heads, splits)``: a program holds the query heads of one KV head (GQA) and walks its
split's tokens in blocks of BLOCK_N with an online softmax in float32; a second launch ``(B, heads,
column blocks)`` merges the splits, REDUCE_CHUNK a step; a row whose tokens fit one split (every row
of a short context) is written, normalised, by that split's program, and the merge skips it. The
grid comes from shapes only (the page table's width), the loop bounds from ``seq_lens`` on the
device, so one launch serves any lengths and is capturable in a CUDA graph:

```
 tokens of row b | split 0: t0 .. t0+S-1 | split 1 | ... | split n-1 |   (S = split_tokens)
                 |<------------ seq_len[b] ------------>|  splits past seq_len store nothing
```

Device data is never trusted for addressing: ``seq_len`` is clamped to ``[0, max_pages * page]``
and page ids to ``[0, num_pages)``, so padded rows (``seq_len`` 0 or 1 on scratch page 0) give finite
output (zeros for ``seq_len`` 0) and never read outside the pool.
"""
from __future__ import annotations

import functools

import torch

from moe_offload.kernels.triton_support import next_pow2, pdl_args, use_triton
from worker.attention.paged_checks import check_paged_inputs, check_sinks

BLOCK_N = 64  # tokens per inner step; splits are multiples of it
SPLIT_MIN_TOKENS = 256  # a split shorter than this costs more to merge than it saves
TARGET_PROGRAMS = 1024  # enough programs to fill an H200's 132 SMs several times over
REDUCE_CHUNK = 128  # splits merged per step of the reduce loop: a 128k-token row takes 2-4 steps
REDUCE_COLUMNS = 64  # head-dim columns per reduce program (its tile: REDUCE_CHUNK x this, in float32)
_LOG2E = 1.4426950408889634


def split_plan(batch: int, kv_heads: int, max_tokens: int, num_splits: int | None = None) -> tuple[int, int]:
    """``(splits, split_tokens)`` from shapes: long page tables split until the grid has about
    TARGET_PROGRAMS programs, never into splits shorter than SPLIT_MIN_TOKENS."""
    if num_splits is None:
        num_splits = min(-(-max_tokens // SPLIT_MIN_TOKENS), -(-TARGET_PROGRAMS // max(batch * kv_heads, 1)))
    per_split = -(-max_tokens // max(num_splits, 1))
    split_tokens = -(-per_split // BLOCK_N) * BLOCK_N
    return -(-max_tokens // split_tokens), split_tokens


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, page_table: torch.Tensor,
                           seq_lens: torch.Tensor, scale: float, *, num_splits: int | None = None,
                           backend: str | None = None, sinks: torch.Tensor | None = None,
                           window: int = 0) -> torch.Tensor:
    """``q [B, heads, D]`` over ``k_cache, v_cache [num_pages, page, kv_heads, D]`` (one layer):
    row b attends to its first ``seq_lens[b]`` tokens through ``page_table [B, max_pages]``.
    Returns ``[B, heads, D]`` in q's dtype. CUDA tensors run the kernel, others the eager twin
    (``backend`` forces one, see ``moe_offload.kernels.triton_support``). gpt-oss: ``sinks
    [heads]`` float32 logits join each head's denominator; ``window`` > 0 keeps the last ``window``
    tokens only (the splits before them store an empty partial)."""
    _check(q, k_cache, v_cache, page_table, seq_lens)
    check_sinks(sinks, q)
    if not use_triton(q, backend):
        return paged_decode_attention_eager(q, k_cache, v_cache, page_table, seq_lens, scale, sinks, window)
    B, heads, D = q.shape
    num_pages, page, kv_heads, _ = k_cache.shape
    max_tokens = page_table.shape[1] * page
    splits, split_tokens = split_plan(B, kv_heads, max_tokens, num_splits)
    out = torch.empty_like(q)
    if B == 0:
        return out
    group = heads // kv_heads
    block_d = max(16, next_pow2(D))  # tl.dot needs every dimension >= 16
    m = torch.empty(B, heads, splits, dtype=torch.float32, device=q.device)
    denom = torch.empty_like(m)
    acc = torch.empty(B, heads, splits, block_d, dtype=torch.float32, device=q.device)
    partial, reduce = _kernels()
    sink_ptr = sinks if sinks is not None else m  # unused without HAS_SINK
    partial[(B, kv_heads, splits)](
        q, k_cache, v_cache, page_table, seq_lens, sink_ptr, m, denom, acc, out, out.stride(0), out.stride(1),
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), page_table.stride(0),
        num_pages, max_tokens, split_tokens, splits, scale * _LOG2E, window,
        HEADS=heads, GROUP=group, HEAD_DIM=D, PAGE=page, BLOCK_G=max(16, next_pow2(group)),
        BLOCK_D=block_d, BLOCK_N=BLOCK_N, IEEE=q.dtype == torch.float32, HAS_SINK=sinks is not None,
        num_warps=4, **pdl_args(q))
    reduce[(B, heads, -(-block_d // REDUCE_COLUMNS))](
        m, denom, acc, seq_lens, sink_ptr, out, out.stride(0), out.stride(1), max_tokens, split_tokens, splits,
        HEADS=heads, HEAD_DIM=D, BLOCK_D=block_d, BLOCK_C=min(block_d, REDUCE_COLUMNS), CHUNK=REDUCE_CHUNK,
        HAS_SINK=sinks is not None, num_warps=8, **pdl_args(q))
    return out


def paged_decode_attention_eager(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                                 page_table: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                                 sinks: torch.Tensor | None = None, window: int = 0) -> torch.Tensor:
    """The twin: gather every row's pages, mask past ``seq_len`` (and before its window), softmax in
    float32 with the kernel's clamps (``seq_len`` 0 gives zeros), a sink in each denominator."""
    B, heads, D = q.shape
    num_pages, page, kv_heads, _ = k_cache.shape
    max_tokens = page_table.shape[1] * page
    pages = page_table.long().clamp(0, num_pages - 1)
    keys = k_cache[pages].reshape(B, max_tokens, kv_heads, D).float()
    values = v_cache[pages].reshape(B, max_tokens, kv_heads, D).float()
    qf = q.float().view(B, kv_heads, heads // kv_heads, D)
    scores = torch.einsum("bkgd,bskd->bkgs", qf, keys) * scale
    lens = seq_lens.long().clamp(0, max_tokens)[:, None]
    t = torch.arange(max_tokens, device=q.device)[None, :]
    live = (t < lens) & (t >= lens - window) if window else t < lens
    scores = scores.masked_fill(~live[:, None, None, :], float("-inf"))
    top = scores.amax(-1, keepdim=True).clamp_min(-1e30)
    sink = None if sinks is None else sinks.float().view(1, kv_heads, -1, 1)
    if sink is not None:
        top = torch.maximum(top, sink)
    probs = torch.exp(scores - top)
    denom = probs.sum(-1, keepdim=True)
    # a row with tokens has a probability of exactly 1 at its maximum, so the clamp only zeroes empty rows
    denom = denom.clamp_min(1.0) if sink is None else denom + torch.exp(sink - top)
    out = torch.einsum("bkgs,bskd->bkgd", probs, values) / denom
    return out.reshape(B, heads, D).to(q.dtype)


def _check(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, page_table: torch.Tensor,
           seq_lens: torch.Tensor) -> None:
    check_paged_inputs(q, k_cache, v_cache, page_table, seq_lens)
    B = q.shape[0]
    if page_table.shape[0] != B or seq_lens.shape[0] != B:
        raise ValueError(f"page_table {tuple(page_table.shape)} and seq_lens {tuple(seq_lens.shape)} must have "
                         f"{B} rows")


@functools.cache
def _kernels():
    import worker.attention.decode_kernel as decode_kernel  # imports triton: only when a kernel launches

    return decode_kernel.decode_partial_kernel, decode_kernel.decode_reduce_kernel

