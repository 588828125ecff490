"""Paged decode attention in Triton (one new token per sequence), flash-decoding style.

Grid ``(B, kv_heads, splits)``: a program holds the query heads of one KV head (GQA) and walks its
split's tokens in blocks of BLOCK_N with an online softmax in float32; a second launch ``(B, heads,
column blocks)`` merges the splits, REDUCE_CHUNK a step; a row whose tokens fit one split (every row
of a short context) is written, normalised, by that split's program, and the merge skips it. The
grid comes from shapes only (the page table's width: ``splits`` is what its longest row may use),
and each row cuts its own length on the device (``row_splits``): into as many of the grid's splits
as it can without one going under ``min_split`` tokens, so a short row in a wide table (a decode
graph's spans its longest row) still spreads over many programs. One launch serves any lengths
and is capturable in a CUDA graph:

```
 tokens of row b | split 0: lo .. lo+S-1 | split 1 | ... | split a-1 |  (S = split_len, a = active,
                 |<------------ seq_len[b] - lo ---------->|             lo = 0 or the window's start)
 programs (b, *, split >= a) return at once
```

Device data is never trusted for addressing: ``seq_len`` is clamped to ``[0, max_pages * page]``
and page ids to ``[0, num_pages)``, so padded rows (``seq_len`` 0 or 1 on scratch page 0) give finite
output (zeros for ``seq_len`` 0) and never read outside the pool.
"""
from __future__ import annotations

import functools
import os

import torch

from moe_offload.kernels.triton_support import next_pow2, pdl_args, use_triton
from worker.attention.paged_checks import check_paged_inputs, check_sinks
from worker.models.rotary import RopeInputs

BLOCK_N = 64  # tokens per inner step; splits are multiples of it
SPLIT_MIN_TOKENS = 256  # a split shorter than this costs more to merge than it saves
# programs the split plan aims at where the table's rows fill it. Since each row cuts its own length
# on the device, fewer and longer splits measured faster in the served case too (graph tables 140k
# wide; scripts/bench_decode_attention.py --sweep --table-tokens 140000, H100, us a layer, 1024 ->
# 256 with 4 pipeline stages): batch 1 over 131k 118.0 -> 106.1, over 32k 36.8 -> 35.0, over 4k
# 16.0 -> 15.8; batch 8 over 32k 231.2 -> 205.9, over 4k 39.7 -> 36.8, over 131k 759.3 -> 791.9.
TARGET_PROGRAMS = 256
REDUCE_CHUNK = 128  # splits merged per step of the reduce loop: a 128k-token row takes 2-4 steps
REDUCE_COLUMNS = 64  # head-dim columns per reduce program (its tile: REDUCE_CHUNK x this, in float32)
# the partial kernel with RoPE inside: with 4, 246 registers a thread and a slower step (H200);
# SLUICE_ROPE_WARPS=N times another count in a whole step (bench_decode.py), unset in serving
ROPE_WARPS = int(os.environ.get("SLUICE_ROPE_WARPS", "8"))
PARTIAL_WARPS = 4  # the partial kernel without RoPE inside
# ... and with RoPE inside over a float8 pool, where 8 warps ran at a third of bf16's bandwidth: us a layer,
# 8 -> 4 warps, b1 over 131k 162.4 -> 115.9 (bf16 at 8: 106.8), b8 over 32k 307.0 -> 226.8 (bf16: 206.4)
# (H100, 2026-12-06, scripts/bench_decode_attention.py --kv-cache-dtype auto fp8 --sweep, and the same
# shapes' tiles set by hand)
FP8_ROPE_WARPS = 4
# The RoPE kernel's split that stores the new token reads it back from its slot in the loop every split runs
# (decode_rope_partial_kernel). Two other ways were measured and taken out: "select", the new key and value
# put into each block of the split's own loop from registers (175 registers a thread against 80, bf16 pool,
# 8 warps; scripts/attention_regs.py --arch 90, Triton 3.6), lost on every long row (H100, 2026-12-07,
# scripts/bench_decode_attention.py, us a layer, select -> read_back: b1 over 131k bf16 106.1 -> 98.1, fp8
# 70.3 -> 56.9; b8 over 64k fp8 251.0 -> 198.8; b1 over 4k fp8 12.3 -> 10.3) and tied over a 64-token prompt
# within the spread of processes (commit 5469b75 has it); "fold", the plain loop then the new token folded
# in from registers, tied (b1 over 131k fp8 59.0 against 58.6 us; commit 4372c84 has it).
# a float8 pool read as int16 words of two values, widened to float16 (decode_kernel._walk_split_words),
# where the head dim allows it and the queries are 16-bit; False: as float8 tiles widened to the query's
# dtype (scripts/bench_decode_attention.py --fp8-bytes times that too)
FP8_WORDS = True
# tokens per inner step of the word reading at head dims up to 128: b1 over 131k 82.5 us a layer at 64 ->
# 73.8 at 128 (H100, 2026-12-06, scripts/bench_decode_attention.py --kv-cache-dtype fp8 --sweep); a head
# of 256 keeps BLOCK_N (at 128 its RoPE kernel's stages take 128 KB of shared memory, past an sm89 SM's 100)
FP8_BLOCK_N = 128
PARTIAL_STAGES = 4  # software-pipeline stages of the partial kernels' loop (None: Triton's default)
_LOG2E = 1.4426950408889634


def split_plan(batch: int, kv_heads: int, max_tokens: int, num_splits: int | None = None) -> tuple[int, int]:
    """``(splits, min_split)`` from shapes: the grid's splits a row, enough for the grid to have
    about TARGET_PROGRAMS programs where the table's rows fill it, and the fewest tokens a split of
    a row takes (SPLIT_MIN_TOKENS). A forced ``num_splits`` (tests, tuning) splits down to BLOCK_N."""
    if num_splits is not None:
        return max(num_splits, 1), BLOCK_N
    splits = min(-(-max_tokens // SPLIT_MIN_TOKENS), -(-TARGET_PROGRAMS // max(batch * kv_heads, 1)))
    return max(splits, 1), SPLIT_MIN_TOKENS


def row_splits(seq_len: int, splits: int, min_split: int, window: int = 0) -> tuple[int, int, int]:
    """``(lo, split_len, active)``: how the kernels cut a row of ``seq_len`` tokens (its keys ``[lo,
    seq_len)``, the last ``window`` where one is set) into ``active`` splits of ``split_len`` tokens,
    a multiple of BLOCK_N (``decode_kernel._row_splits``; the host's copy, for tests and plans)."""
    lo = max(seq_len - window, 0) if window > 0 else 0
    span = seq_len - lo
    want = min(max(-(-span // min_split), 1), splits)
    split_len = max(-(-span // want), 1)
    split_len = -(-split_len // BLOCK_N) * BLOCK_N
    return lo, split_len, -(-span // split_len)


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, page_table: torch.Tensor,
                           seq_lens: torch.Tensor, scale: float, *, num_splits: int | None = None,
                           backend: str | None = None, sinks: torch.Tensor | None = None,
                           window: int = 0, rope: RopeInputs | None = None, k: torch.Tensor | None = None,
                           early_index: bool = False) -> torch.Tensor:
    """``q [B, heads, D]`` over ``k_cache, v_cache [num_pages, page, kv_heads, D]`` (one layer, in
    q's dtype or float8 e4m3, read as stored and widened to q's dtype before the MMAs):
    row b attends to its first ``seq_lens[b]`` tokens through ``page_table [B, max_pages]``.
    Returns ``[B, heads, D]`` in q's dtype. CUDA tensors run the kernel, others the eager twin
    (``backend`` forces one, see ``moe_offload.kernels.triton_support``). gpt-oss: ``sinks
    [heads]`` float32 logits join each head's denominator; ``window`` > 0 keeps the last ``window``
    tokens only (the row's splits cover those alone).

    With ``rope``, ``q`` and ``k [B, kv_heads, D]`` are the projection's, not yet rotated, and the
    row's new token (its last) is not yet in the caches: the kernel rotates them and stores the new
    key and ``rope.write``'s value at the token's slot, rounded to the pool's dtype, and attends to
    them as stored (``decode_rope_partial_kernel``; the twin runs ``rope.apply`` first). Where the
    head dim is not a power of two of at least 16, ``rope.apply`` runs first on the GPU too.
    ``early_index``: ``seq_lens`` and ``rope.positions`` were written before the launch just before
    this one (a model's step: its index buffer is in before its first layer), so that kernel reads
    them before its PDL wait."""
    _check(q, k_cache, v_cache, page_table, seq_lens)
    check_sinks(sinks, q)
    if rope is not None:
        _check_rope(rope, q, k, k_cache, v_cache)
        if not use_triton(q, backend) or q.shape[2] != max(16, next_pow2(q.shape[2])):
            q, _ = rope.apply(q, k, backend)
            rope = None
    if not use_triton(q, backend):
        return paged_decode_attention_eager(q, k_cache, v_cache, page_table, seq_lens, scale, sinks, window)
    return _launch(q, k_cache, v_cache, page_table, seq_lens, scale, num_splits, sinks, window, rope, k,
                   early_index)


def _launch(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, page_table: torch.Tensor,
            seq_lens: torch.Tensor, scale: float, num_splits: int | None, sinks: torch.Tensor | None, window: int,
            rope: RopeInputs | None, k: torch.Tensor | None, early_index: bool = False) -> torch.Tensor:
    """The partial kernel (with RoPE inside where ``rope`` is given) and the merge."""
    B, heads, D = q.shape
    num_pages, page, kv_heads, _ = k_cache.shape
    max_tokens = page_table.shape[1] * page
    splits, min_split = split_plan(B, kv_heads, max_tokens, num_splits)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if B == 0:
        return out
    words = _reads_words(q, k_cache)
    block_n = keys_a_step(words, D)
    block_d = max(16, next_pow2(D))  # tl.dot needs every dimension >= 16
    m = torch.empty(B, heads, splits, dtype=torch.float32, device=q.device)
    denom = torch.empty_like(m)
    acc = torch.empty(B, heads, splits, block_d, dtype=torch.float32, device=q.device)
    partial, reduce, rope_partial = _kernels()
    sink_ptr = sinks if sinks is not None else m  # unused without HAS_SINK
    args = (q, k_cache, v_cache, page_table, seq_lens, sink_ptr, m, denom, acc, out, out.stride(0), out.stride(1),
            q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), page_table.stride(0),
            num_pages, max_tokens, splits, min_split, scale * _LOG2E, window)
    consts = dict(HEADS=heads, GROUP=heads // kv_heads, HEAD_DIM=D, PAGE=page,
                  BLOCK_G=max(16, next_pow2(heads // kv_heads)), BLOCK_N=block_n, IEEE=q.dtype == torch.float32,
                  HAS_SINK=sinks is not None, WORDS=words, CVT=words and _has_fp8_cvt(q.device),
                  num_warps=_warps(rope, k_cache), **pdl_args(q))
    if PARTIAL_STAGES is not None:
        consts["num_stages"] = PARTIAL_STAGES
    if rope is None:
        partial[(B, kv_heads, splits)](*args, BLOCK_D=block_d, **consts)
    else:
        rope_partial[(B, kv_heads, splits)](*args, *_rope_args(rope, k), HAS_NORM=rope.q_norm is not None,
                                            EARLY=early_index, **consts)
    reduce[(B, heads, -(-block_d // REDUCE_COLUMNS))](
        m, denom, acc, seq_lens, sink_ptr, out, out.stride(0), out.stride(1), max_tokens, splits, min_split, window,
        HEADS=heads, HEAD_DIM=D, BLOCK_D=block_d, BLOCK_C=min(block_d, REDUCE_COLUMNS), CHUNK=REDUCE_CHUNK,
        BLOCK_N=block_n, HAS_SINK=sinks is not None, num_warps=8, **pdl_args(q))
    return out


def _reads_words(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """Whether the partial kernel reads the pool as words of two float8 values (``FP8_WORDS``): a
    float8 pool, 16-bit queries (float32 ones keep float32 sums) and a head dim that is a power of
    two of at least 32 (each half a dot of 16 or more)."""
    D = q.shape[-1]
    return FP8_WORDS and k_cache.element_size() == 1 and q.element_size() == 2 and D >= 32 and D == next_pow2(D)


def keys_a_step(words: bool, head_dim: int) -> int:
    """The partial kernel's tokens a step (the merge's too): FP8_BLOCK_N where it reads words, up to
    a head of 128; else BLOCK_N."""
    return FP8_BLOCK_N if words and head_dim <= 128 else BLOCK_N


@functools.cache
def _has_fp8_cvt(device: torch.device) -> bool:
    """Whether the word reading widens by PTX's ``cvt.rn.f16x2.e4m3x2`` (sm89 and later), not
    Triton's casts (older GPUs, and the interpreter, which runs no PTX)."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


def _warps(rope: RopeInputs | None, k_cache: torch.Tensor) -> int:
    """The partial kernel's warps: with RoPE inside over a float8 pool, 4 (``FP8_ROPE_WARPS``)."""
    if rope is None:
        return PARTIAL_WARPS
    return FP8_ROPE_WARPS if k_cache.element_size() == 1 else ROPE_WARPS


def _rope_args(rope: RopeInputs, k: torch.Tensor) -> tuple:
    """``decode_rope_partial_kernel``'s arguments after the plain kernel's."""
    v, loc = rope.write.v, rope.write.out_loc
    norms = (rope.q_norm, rope.k_norm) if rope.q_norm is not None else (k, k)  # unread without HAS_NORM
    return (k, v, k.stride(0), k.stride(1), v.stride(0), v.stride(1), loc, rope.positions, rope.rotary.cos,
            rope.rotary.sin, *norms, rope.rotary.cos.shape[0], rope.eps)


def _check_rope(rope: RopeInputs, q: torch.Tensor, k: torch.Tensor | None, k_cache: torch.Tensor,
                v_cache: torch.Tensor) -> None:
    """The kernel stores the new keys and values through the paged caches: ``rope.write``'s slot
    views must be these caches, one row a sequence."""
    if k is None:
        raise ValueError("a decode attention with rope needs the projection's k")
    rope.check(q, k)
    w = rope.write
    if w.k_cache.data_ptr() != k_cache.data_ptr() or w.v_cache.data_ptr() != v_cache.data_ptr():
        raise ValueError("rope.write must store into the caches this attention reads")
    if w.k_cache.numel() != k_cache.numel() or q.shape[0] != k.shape[0]:
        raise ValueError(f"rope.write's caches {tuple(w.k_cache.shape)} and k {tuple(k.shape)} must match "
                         f"the pool {tuple(k_cache.shape)} and q {tuple(q.shape)}")


def paged_decode_attention_eager(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                                 page_table: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                                 sinks: torch.Tensor | None = None, window: int = 0) -> torch.Tensor:
    """The twin: gather every row's pages (a float8 pool's widened, exactly), mask past ``seq_len``
    (and before its window), softmax in float32 with the kernel's clamps (``seq_len`` 0 gives
    zeros), a sink in each denominator."""
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

    return (decode_kernel.decode_partial_kernel, decode_kernel.decode_reduce_kernel,
            decode_kernel.decode_rope_partial_kernel)

