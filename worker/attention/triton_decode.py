"""Paged decode attention in Triton (one new token per sequence), flash-decoding style.

Grid ``(B, kv_heads, splits)``: a program holds the query heads of one KV head (GQA) and walks its
split's tokens in blocks of BLOCK_N with an online softmax in float32; a second launch ``(B, heads)``
merges the splits; a row whose tokens fit one split (every row of a short context) is written,
normalised, by that split's program, and the merge skips it. The grid comes from shapes only (the
page table's width), the loop bounds from ``seq_lens`` on the device, so one launch serves any
lengths and is capturable in a CUDA graph:

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
REDUCE_CHUNK = 16  # splits merged per step of the reduce loop
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
    reduce[(B, heads)](
        m, denom, acc, seq_lens, sink_ptr, out, out.stride(0), out.stride(1), max_tokens, split_tokens, splits,
        HEADS=heads, HEAD_DIM=D, BLOCK_D=block_d, CHUNK=REDUCE_CHUNK, HAS_SINK=sinks is not None, num_warps=4,
        **pdl_args(q))
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
    import triton
    import triton.language as tl

    # what follows the batch (the page table's width, the split plan, pointers into the batch's packed
    # index buffer) is not specialised: an eager step at a new width compiles nothing
    @triton.jit(do_not_specialize=["table_stride_b", "max_tokens", "split_tokens", "splits"],
                do_not_specialize_on_alignment=["table_ptr", "lens_ptr"])
    def decode_partial_kernel(q_ptr, k_ptr, v_ptr, table_ptr, lens_ptr, sink_ptr, m_ptr, l_ptr, acc_ptr,
                              out_ptr, out_stride_b, out_stride_h, q_stride_b, q_stride_h, stride_page, stride_tok,
                              stride_head, table_stride_b,
                              num_pages, max_tokens, split_tokens, splits, qk_scale, window,
                              HEADS: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE: tl.constexpr,
                              BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr,
                              BLOCK_N: tl.constexpr, IEEE: tl.constexpr, HAS_SINK: tl.constexpr, PDL: tl.constexpr):
        if PDL:  # see triton_support.pdl_args
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        b = tl.program_id(0)
        kv_head = tl.program_id(1)
        split = tl.program_id(2)
        g = tl.arange(0, BLOCK_G)
        d = tl.arange(0, BLOCK_D)
        head = kv_head * GROUP + g
        g_live = g < GROUP
        d_live = d < HEAD_DIM
        q = tl.load(q_ptr + b * q_stride_b + head[:, None] * q_stride_h + d[None, :],
                    mask=g_live[:, None] & d_live[None, :], other=0.0)
        seq_len = tl.minimum(tl.maximum(tl.load(lens_ptr + b), 0), max_tokens).to(tl.int32)
        start = split * split_tokens
        end = tl.minimum(start + split_tokens, seq_len)
        first = start
        if window > 0:  # keys before the window: a split wholly before it stores an empty partial
            first = tl.maximum(start, seq_len - window)
        # a finite floor instead of -inf: exp2(m - m_new) never sees inf - inf
        m = tl.full([BLOCK_G], -1e30, tl.float32)
        l = tl.zeros([BLOCK_G], tl.float32)
        acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
        for t0 in range(first, end, BLOCK_N):
            t = t0 + tl.arange(0, BLOCK_N)
            t_live = t < end
            page = tl.load(table_ptr + b * table_stride_b + t // PAGE, mask=t_live, other=0).to(tl.int64)
            page = tl.minimum(tl.maximum(page, 0), num_pages - 1)
            row = page * stride_page + (t % PAGE) * stride_tok + kv_head * stride_head
            kv_mask = t_live[:, None] & d_live[None, :]
            k = tl.load(k_ptr + row[:, None] + d[None, :], mask=kv_mask, other=0.0)
            v = tl.load(v_ptr + row[:, None] + d[None, :], mask=kv_mask, other=0.0)
            if IEEE:
                s = tl.dot(q, tl.trans(k), input_precision="ieee")
            else:
                s = tl.dot(q, tl.trans(k))
            s = tl.where(t_live[None, :], s * qk_scale, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, 1))
            alpha = tl.exp2(m - m_new)
            p = tl.exp2(s - m_new[:, None])
            l = l * alpha + tl.sum(p, 1)
            if IEEE:
                pv = tl.dot(p, v, input_precision="ieee")
            else:
                pv = tl.dot(p.to(v.dtype), v)
            acc = acc * alpha[:, None] + pv
            m = m_new
        if seq_len <= split_tokens:  # the row's one split: its output, normalised; the merge skips the row
            if HAS_SINK:  # the sink's mass joins the denominator, rescaled to the larger maximum
                sink = tl.load(sink_ptr + head, mask=g_live, other=0.0) * 1.4426950408889634
                top = tl.maximum(m, sink)
                acc = acc * tl.exp2(m - top)[:, None]
                l = l * tl.exp2(m - top) + tl.exp2(sink - top)
            out = acc / tl.maximum(l, 1.0)[:, None]  # l >= 1 when the row has a token or a sink; 0 leaves zeros
            tl.store(out_ptr + b * out_stride_b + head[:, None] * out_stride_h + d[None, :],
                     out.to(out_ptr.dtype.element_ty), mask=(g_live & (split + 0 * g == 0))[:, None] & d_live[None, :])
            return
        part = (b * HEADS + head) * splits + split
        keep = g_live & (start + 0 * g < seq_len)  # a vector compare: the interpreter rejects a broadcast scalar mask
        tl.store(m_ptr + part, m, mask=keep)
        tl.store(l_ptr + part, l, mask=keep)
        tl.store(acc_ptr + part[:, None] * BLOCK_D + d[None, :], acc, mask=keep[:, None] & d_live[None, :])

    @triton.jit(do_not_specialize=["max_tokens", "split_tokens", "splits"], do_not_specialize_on_alignment=["lens_ptr"])
    def decode_reduce_kernel(m_ptr, l_ptr, acc_ptr, lens_ptr, sink_ptr, out_ptr, out_stride_b, out_stride_h,
                             max_tokens, split_tokens, splits, HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                             BLOCK_D: tl.constexpr, CHUNK: tl.constexpr, HAS_SINK: tl.constexpr, PDL: tl.constexpr):
        if PDL:  # see triton_support.pdl_args
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        b = tl.program_id(0)
        h = tl.program_id(1)
        seq_len = tl.minimum(tl.maximum(tl.load(lens_ptr + b), 0), max_tokens).to(tl.int32)
        active = (seq_len + split_tokens - 1) // split_tokens  # the splits that stored a partial
        if active <= 1:  # the one split wrote the output itself
            return
        base = (b * HEADS + h) * splits
        top = tl.full((), -1e30, tl.float32)
        for s0 in range(0, active, CHUNK):  # the largest maximum first, CHUNK splits a step
            sc = s0 + tl.arange(0, CHUNK)
            top = tl.maximum(top, tl.max(tl.load(m_ptr + base + sc, mask=sc < active, other=-1e30), 0))
        d = tl.arange(0, BLOCK_D)
        acc = tl.zeros([BLOCK_D], tl.float32)
        total = tl.zeros((), tl.float32)
        if HAS_SINK:  # the sink's mass joins the denominator
            sink = tl.load(sink_ptr + h) * 1.4426950408889634
            top = tl.maximum(top, sink)
            total += tl.exp2(sink - top)
        for s0 in range(0, active, CHUNK):
            sc = s0 + tl.arange(0, CHUNK)
            live = sc < active
            w = tl.where(live, tl.exp2(tl.load(m_ptr + base + sc, mask=live, other=-1e30) - top), 0.0)
            total += tl.sum(w * tl.load(l_ptr + base + sc, mask=live, other=0.0), 0)
            part = tl.load(acc_ptr + (base + sc)[:, None] * BLOCK_D + d[None, :],
                           mask=live[:, None] & (d < HEAD_DIM)[None, :], other=0.0)
            acc += tl.sum(w[:, None] * part, 0)
        # total >= 1 when the row has a token (its maximum contributes exp2(0)); 0 leaves zeros
        out = acc / tl.maximum(total, 1.0)
        tl.store(out_ptr + b * out_stride_b + h * out_stride_h + d, out.to(out_ptr.dtype.element_ty),
                 mask=d < HEAD_DIM)

    return decode_partial_kernel, decode_reduce_kernel

