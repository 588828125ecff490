"""Prefill over a long cached prefix through cuDNN's fused attention (torch's
``_scaled_dot_product_cudnn_attention``: FlashAttention-3's techniques, TMA and warp specialisation,
on sm90), which reads contiguous keys only; the pages are gathered first. cuDNN builds a plan per
shape (about 50 ms on an H100 or H200, 0.7-2.1 s for a process's first call), so every shape the
path launches comes from a small set that the warm-up plans (``warm_plans``). Per row b:

```
 prefix [0, P)      read where it lies when its pages are one ascending run of the pool (a single
                    session's are: the pool hands pages out lowest first), else gathered from the
                    pages (one index_select each for K and V)
   pieces           the binary digits of P // PREFIX_BLOCK blocks, largest first (100,003 keys:
                    65,536 + 32,768), each cuDNN unmasked with its log-sum-exp  -> o_j, lse_j
   remainder R      the last P mod PREFIX_BLOCK keys (1,699), ahead of the chunk's own keys
 causal part        queries [R zero rows, chunk, zero rows] over keys [remainder, chunk, zeros],
                    cuDNN top-left causal, both padded to one bucket (query_bucket(R + n))
                    -> the chunk's rows o_c, lse_c
 out                merge of the parts by log-sum-exp (one Triton launch)
```

Top-left causal: query R + i sees keys 0..R + i, the remainder and chunk keys 0..i, and never a
padded key; the zero query rows' results are dropped. A new prefix length so meets planned shapes
only: a piece's is (query bucket, PREFIX_BLOCK x 2^k), the causal part's its bucket, whatever P.
Padded keys could not shorten this (they change the softmax without a mask, and under an attention
bias cuDNN runs about half again as slow: ``docs/architecture.md``).

The gather costs one pass over the prefix's K/V at HBM speed (about 3% of the attention it feeds
for a 2k chunk over 128k keys); a prefix in one run of pages (``prefix_run``, from the host's page
table) skips it: the pool's pages, flattened, have the gathered keys' strides. The merge reads every
part once. Lengths and runs come from the host (a run is checked against the pool there), page
ids are clamped on the device before the gather, nothing is read back. cuDNN takes GQA natively
(query heads a multiple of KV heads). CPU tensors take the same path with an eager softmax in
place of cuDNN (the twin of the composition); the paged Triton kernel
(``worker.attention.triton_prefill``) stays the path for short prefixes, other dtypes and GPUs.
"""
from __future__ import annotations

import functools
from collections.abc import Collection, Iterator, Sequence

import torch
import torch.nn.functional as F

from worker import compile_watch
from moe_offload.kernels.triton_support import next_pow2, use_triton
from worker.attention.split_kv import merge_splits
from worker.kv.gpu_pool import check_caches

# Rows of a batch take this path when the batch's prefix work (sum of q_len x prefix) is at least
# this many query-key pairs (a 2k chunk over 32k keys): 2k over 32k saves about 1.2 ms a layer
# against the paged kernel, 1k over 32k 0.65 ms, 1k over 8k nothing (H200,
# scripts/bench_prefill_attention.py). torch's TORCH_CUDNN_SDPA_AVOID_RECOMPILE=1 (one
# variable-length plan) measured slower (2k over 128k: 0.749 of the ceiling against 0.855) and
# disagreed with the paged twin on a GQA-8 case.
MIN_PREFIX_WORK = 1 << 26
# A prefix's pieces are this many keys times a power of two. Smaller: a shorter remainder in the
# causal part, more piece lengths to plan. On an H100, a 2k chunk over 128k keys in 4k-key calls
# took 1.06x the time of one call, in 8k-key calls 1.03x; an 8k chunk 1.01x.
PREFIX_BLOCK = 4096
MERGE_ROWS = 32
HEAD_DIMS = (64, 128)
BUCKET_BITS = 3  # 2^3 query buckets an octave: padding costs at most 1/8 of a row's attention
MIN_BUCKET = 16
_LOG2E = 1.4426950408889634


def usable(q: torch.Tensor, q_lens: list[int], prefixes: list[int]) -> bool:
    """Whether this batch takes the cuDNN path: ``supported`` queries with enough prefix work."""
    return supported(q.device, q.dtype, q.shape[2]) and sum(n * p for n, p in zip(q_lens, prefixes)) >= MIN_PREFIX_WORK


def supported(device: torch.device, dtype: torch.dtype, head_dim: int) -> bool:
    """CUDA in bf16/fp16 with a head dim cuDNN fuses, on sm90 or newer (measured on sm90 only)."""
    if not (device.type == "cuda" and dtype in (torch.bfloat16, torch.float16) and head_dim in HEAD_DIMS):
        return False
    return torch.backends.cudnn.is_available() and torch.cuda.get_device_capability(device)[0] >= 9


def query_bucket(n: int) -> int:
    """The query length a row of ``n`` is padded to: a multiple of 2^(m-3) for ``n`` in [2^m, 2^(m+1)),
    at least ``MIN_BUCKET`` (so 2,064 -> 2,304, 2,048 -> 2,048, 4,000 -> 4,096)."""
    step = max(1 << max(n.bit_length() - 1 - BUCKET_BITS, 0), MIN_BUCKET)
    return -(-n // step) * step


def query_buckets(max_q: int, max_context: int) -> list[int]:
    """Every bucket a row of at most ``max_q`` queries can take on this path: a row needs
    ``q_len * prefix >= MIN_PREFIX_WORK`` with its prefix inside ``max_context``."""
    lo = query_bucket(max(1, -(-MIN_PREFIX_WORK // max(max_context, 1))))
    buckets, n = [], lo
    while n <= query_bucket(max_q):
        buckets.append(n)
        n = query_bucket(n + 1)
    return buckets


def prefix_pieces(prefix: int) -> list[tuple[int, int]]:
    """``(start, length)`` of the prefix's pieces that cuDNN takes unmasked: one a binary digit of
    ``prefix // PREFIX_BLOCK`` blocks, largest first; the rest of the prefix joins the causal part."""
    pieces, start, blocks = [], 0, prefix // PREFIX_BLOCK
    for bit in reversed(range(blocks.bit_length())):
        if blocks >> bit & 1:
            pieces.append((start, PREFIX_BLOCK << bit))
            start += PREFIX_BLOCK << bit
    return pieces


def prefix_run(pages: list[int], prefix: int, num_pages: int, page: int) -> int:
    """The first page of a row's ``prefix`` tokens when their pages (``pages``, the host's table row)
    are one ascending run inside the pool, past its scratch page 0: the keys can then be read where
    they lie. Else -1 (gather them)."""
    n = -(-prefix // page)
    first = pages[0] if n and len(pages) >= n else -1
    return first if 1 <= first <= num_pages - n and pages[:n] == list(range(first, first + n)) else -1


def piece_lengths(max_prefix: int) -> list[int]:
    """Every piece length a prefix of at most ``max_prefix`` keys can have."""
    return [PREFIX_BLOCK << i for i in range(max(max_prefix // PREFIX_BLOCK, 0).bit_length())]


def cached_prefix_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                            v_cache: torch.Tensor, page_table: torch.Tensor, q_lens: list[int],
                            prefixes: list[int], scale: float, skip: Collection[int] = (),
                            runs: Sequence[int] = ()) -> torch.Tensor:
    """``q [T, heads, D]`` packed by row (``q_lens``), the chunk's own ``k, v [T, kv_heads, D]``,
    row b's ``prefixes[b]`` cached tokens in ``k/v_cache [pages, page, kv_heads, D]`` through
    ``page_table [B, max_pages]``; query i of row b sees the prefix and chunk keys 0..i. The rows
    in ``skip`` are left unwritten (the caller's to fill). ``runs[b]`` (``prefix_run``; none: -1
    each) is the first page of row b's prefix where its pages are one run: read in place."""
    _check(q, k, v, (k_cache, v_cache), page_table, q_lens, prefixes, runs)
    out, start = torch.empty_like(q), 0
    for b, (n, prefix) in enumerate(zip(q_lens, prefixes)):
        rows = slice(start, start + n)
        if b in skip:
            start += n
            continue
        k_p, v_p = _prefix_kv(k_cache, v_cache, page_table[b], prefix, runs[b] if runs else -1, q.dtype)
        pieces = prefix_pieces(prefix)
        _merge(_row_parts(q[rows], k[rows], v[rows], k_p[:prefix], v_p[:prefix], pieces, scale), len(pieces) + 1,
               out[rows])
        start += n
    return out


def warm_plans(heads: int, k_cache: torch.Tensor, v_cache: torch.Tensor, max_q: int, max_context: int,
               scale: float, dtype: torch.dtype | None = None) -> int:
    """Plan every shape the path can launch before serving: each query bucket (``query_buckets``)
    over each piece length, and each causal bucket up to ``max_q`` rows after a remainder, over
    keys gathered from the pool's pages (read only), queries and keys in ``dtype`` (default: the
    pool's). Returns how many shapes it ran."""
    num_pages, page, kv_heads, D = k_cache.shape
    room = (num_pages - 1) * page  # page 0 is the scratch page
    top = min(max_context, room)
    lengths = piece_lengths(top)
    buckets = warm_buckets(k_cache, max_q, max_context)
    causal = [n for n in query_buckets(max_q + PREFIX_BLOCK - 1, top) if n <= room]
    # pages 1.., as a run (a float8 pool's cast as serving casts them)
    k_p, v_p = (x.to(dtype or k_cache.dtype) for x in _in_place(k_cache, v_cache, 1, max(lengths + causal, default=0)))
    for n in buckets:
        q_b = k_p.new_zeros(n, heads, D).transpose(0, 1)[None]
        for length in lengths:
            _piece(q_b, k_p, v_p, 0, length, n, scale)
    one = k_p.new_zeros(1, heads, D)
    for n in causal:  # one query after n - 1 remainder keys: the bucket of n
        part = _causal_part(one, k_p[:1], v_p[:1], k_p[:n - 1], v_p[:n - 1], scale)
    if causal:  # the merges' kernels, of two parts and of more
        _merge(iter([part] * 2), 2, one.clone())
        _merge(iter([part] * 3), 3, one.clone())
    return len(buckets) * len(lengths) + len(causal)


def warm_buckets(k_cache: torch.Tensor, max_q: int, max_context: int) -> list[int]:
    """The query buckets ``warm_plans`` plans over this pool: a row's own prefix work reaching the
    threshold takes one of them."""
    num_pages, page = k_cache.shape[:2]
    return query_buckets(max_q, min(max_context, (num_pages - 1) * page))


def _prefix_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, table_row: torch.Tensor, prefix: int, run: int,
               dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """A row's ``prefix`` keys and values in ``dtype``: where they lie when its pages are one run
    (``run`` > 0) of a pool of that dtype, else gathered; a float8 pool's are cast to ``dtype``, K
    then V (with the gather, a pass at HBM speed: its float8 copy of K is freed before V's is made)."""
    if run > 0:
        return tuple(c.to(dtype) for c in _in_place(k_cache, v_cache, run, prefix))  # .to: no copy in dtype
    return tuple(_gathered(c, table_row, prefix).to(dtype) for c in (k_cache, v_cache))


def _gathered(cache: torch.Tensor, table_row: torch.Tensor, prefix: int) -> torch.Tensor:
    """The first ``prefix`` tokens of a row in one cache (at least; whole pages) as ``[S, kv_heads,
    D]``, contiguous; its page ids clamped into the pool first. No prefix: no launch."""
    num_pages, page, kv_heads, D = cache.shape
    if prefix == 0:
        return cache.new_empty(0, kv_heads, D)
    pages = table_row[:-(-prefix // page)].clamp(0, num_pages - 1)
    return cache.index_select(0, pages).flatten(0, 1)


def _in_place(k_cache: torch.Tensor, v_cache: torch.Tensor, first: int,
              prefix: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``prefix`` keys and values from page ``first`` on, where they lie, as ``[prefix, kv_heads,
    D]`` views with the gathered tensors' strides (the caches are contiguous: ``_check``)."""
    start = first * k_cache.shape[1]
    return tuple(c.flatten(0, 1)[start:start + prefix] for c in (k_cache, v_cache))


def _piece(q_b: torch.Tensor, k_p: torch.Tensor, v_p: torch.Tensor, first: int, length: int, n: int,
           scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The bucketed queries ``q_b`` over gathered keys ``[first, first + length)``, unmasked: the
    first ``n`` rows' output ``[n, heads, D]`` and lse ``[n, heads]``. The keys' view has the same
    strides for every prefix (cuDNN keys its plans by strides too)."""
    kv_heads, D = k_p.shape[1:]
    size, strides = (1, kv_heads, length, D), (length * kv_heads * D, D, kv_heads * D, 1)
    keys, values = (x.as_strided(size, strides, x.storage_offset() + first * kv_heads * D) for x in (k_p, v_p))
    o, lse = dense_attention(q_b, keys, values, False, scale)
    return o[0, :, :n].transpose(0, 1), lse[0, :, :n, 0].t()


def _causal_part(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_rest: torch.Tensor, v_rest: torch.Tensor,
                 scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The chunk's queries ``q [n, heads, D]`` over the prefix's last keys ``k/v_rest [R, kv_heads,
    D]`` and its own ``k, v`` causally: one top-left causal call over ``query_bucket(R + n)`` rows
    and keys, the queries after R zero rows. The chunk's output ``[n, heads, D]`` and lse ``[n, heads]``."""
    R, n = k_rest.shape[0], q.shape[0]
    rows = query_bucket(R + n)
    q_pad = q.new_zeros(rows, *q.shape[1:])
    q_pad[R:R + n] = q
    kv = [torch.cat([rest, new, new.new_zeros(rows - R - n, *new.shape[1:])])
          for rest, new in ((k_rest, k), (v_rest, v))]
    o, lse = dense_attention(q_pad.transpose(0, 1)[None], *(x.transpose(0, 1)[None] for x in kv), True, scale)
    return o[0, :, R:R + n].transpose(0, 1), lse[0, :, R:R + n, 0].t()


def _row_parts(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_p: torch.Tensor, v_p: torch.Tensor,
               pieces: list[tuple[int, int]], scale: float) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """A row's parts, each computed when the merge asks for it: the causal part (the prefix's
    rest and the chunk), then one for each of the prefix's ``pieces``; ``k_p, v_p`` are the
    prefix's keys and values, gathered."""
    done = sum(length for _, length in pieces)
    yield _causal_part(q, k, v, k_p[done:], v_p[done:], scale)
    q_b = _padded_rows(q, query_bucket(q.shape[0])) if pieces else None
    for first, length in pieces:
        yield _piece(q_b, k_p, v_p, first, length, q.shape[0], scale)


def _merge(parts: Iterator[tuple[torch.Tensor, torch.Tensor]], count: int, out: torch.Tensor) -> None:
    """``out`` from ``count`` normalised parts ``(o [n, heads, D], natural-log lse [n, heads])``:
    one is copied, two merged by ``merge_pair``; more are stacked as ``parts`` yields them (a part's
    own output is freed before the next is computed) for ``split_kv.merge_splits`` (base-2 lse)."""
    if count == 1:
        out.copy_(next(parts)[0])
    elif count == 2:
        merge_pair(*next(parts), *next(parts), out)
    else:
        n, heads, D = out.shape
        part_o = out.new_empty(count, n, heads, D)
        part_lse = torch.empty(count, n, heads, dtype=torch.float32, device=out.device)
        for j in range(count):  # not enumerate: its reused result tuple would keep the last part alive
            o, lse = next(parts)
            part_o[j].copy_(o)
            torch.mul(lse, _LOG2E, out=part_lse[j])
            del o, lse
        merge_splits(part_o, part_lse, out)


def dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                    scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``q [1, heads, n, D]`` over ``k, v [1, kv_heads, S, D]`` (any strides, last one 1): the output
    ``[1, heads, n, D]`` and the natural-log log-sum-exp ``[1, heads, n, 1]`` (float32). Causal: top-left
    aligned. CUDA runs cuDNN's fused kernel; elsewhere the eager softmax (the twin)."""
    if q.is_cuda:
        compile_watch.WATCH.note_plan("cuDNN attention", (*q.shape[1:3], k.shape[2], causal))
        try:
            o, lse = torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, causal, False,
                                                                         scale=scale)[:2]
        except RuntimeError as e:  # raised on the host while cuDNN builds its plan, before any launch
            raise CudnnRefused(f"cuDNN attention refused {tuple(q.shape)} over {k.shape[2]} keys: "
                               f"{str(e).splitlines()[0][:120]}") from e
        return o, lse.view(*q.shape[:3], 1)
    group = q.shape[1] // k.shape[1]
    keys, values = (x.float().repeat_interleave(group, dim=1) for x in (k, v))
    scores = q.float() @ keys.transpose(-1, -2) * scale
    if causal:
        n, S = scores.shape[-2:]
        scores = scores.masked_fill(torch.ones(n, S, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
    lse = torch.logsumexp(scores, dim=-1, keepdim=True)
    return (torch.exp(scores - lse) @ values).to(q.dtype), lse


def _padded_rows(x: torch.Tensor, bucket: int) -> torch.Tensor:
    """``x [n, heads, D]`` as ``[1, heads, bucket, D]``, zero rows after its own (exact: see above)."""
    if bucket > x.shape[0]:
        x = F.pad(x, (0, 0, 0, 0, 0, bucket - x.shape[0]))
    return x.transpose(0, 1)[None]


class CudnnRefused(RuntimeError):
    """cuDNN would not build a plan for this call; the caller takes the paged kernel."""


def merge_pair(o1: torch.Tensor, lse1: torch.Tensor, o2: torch.Tensor, lse2: torch.Tensor, out: torch.Tensor, *,
               backend: str | None = None) -> torch.Tensor:
    """``out [n, heads, D] = (o1 e^lse1 + o2 e^lse2) / (e^lse1 + e^lse2)`` for two normalised
    partial outputs ``[n, heads, D]`` and their natural-log ``lse [n, heads]`` (any strides, the
    outputs' last one 1). CUDA tensors run the kernel, others the eager twin."""
    n, heads, D = out.shape
    if not (o1.shape == o2.shape == out.shape and lse1.shape == lse2.shape == (n, heads)):
        raise ValueError(f"parts {tuple(o1.shape)}, {tuple(o2.shape)} / lse {tuple(lse1.shape)}, "
                         f"{tuple(lse2.shape)} do not match out {tuple(out.shape)}")
    if o1.stride(2) != 1 or o2.stride(2) != 1 or out.stride(2) != 1:
        raise ValueError("the outputs must be contiguous in their last dimension")
    if not use_triton(out, backend):
        out.copy_(merge_pair_eager(o1, lse1, o2, lse2))
        return out
    rows = n * heads
    _merge_pair_kernel()[(-(-rows // MERGE_ROWS),)](
        o1, lse1, o2, lse2, out, rows, heads, o1.stride(0), o1.stride(1), lse1.stride(0), lse1.stride(1),
        o2.stride(0), o2.stride(1), lse2.stride(0), lse2.stride(1), out.stride(0), out.stride(1),
        HEAD_DIM=D, BLOCK_D=max(16, next_pow2(D)), BLOCK_R=MERGE_ROWS, num_warps=4)
    return out


def merge_pair_eager(o1: torch.Tensor, lse1: torch.Tensor, o2: torch.Tensor, lse2: torch.Tensor) -> torch.Tensor:
    """The twin, in float32: the two parts weighted by the softmax of their lse."""
    w = torch.softmax(torch.stack([lse1, lse2]).float(), dim=0)[..., None]
    return w[0] * o1.float() + w[1] * o2.float()


def _check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, caches: tuple[torch.Tensor, torch.Tensor],
           page_table: torch.Tensor, q_lens: list[int], prefixes: list[int], runs: Sequence[int] = ()) -> None:
    """Host lengths against shapes: the gather slices the page table by them, a run the pool."""
    T, heads, D = q.shape
    k_cache = caches[0]
    if any(x.dtype != q.dtype for x in (k, v)) or any(x.stride(-1) != 1 for x in (q, k, v, k_cache)):
        raise ValueError("q, k and v must share a dtype, and they and the caches be contiguous in their last dimension")
    check_caches(*caches, q.dtype)
    if q.is_cuda and q.dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"cuDNN's fused attention takes bf16 or fp16; got {q.dtype}")
    if k.shape != v.shape or k.shape[0] != T or k.shape[2] != D or heads % k.shape[1] or k_cache.shape[2] != k.shape[1]:
        raise ValueError(f"k {tuple(k.shape)} / v {tuple(v.shape)} / cache {tuple(k_cache.shape)} do not match "
                         f"q {tuple(q.shape)}")
    if len(q_lens) != len(prefixes) or len(q_lens) != page_table.shape[0] or sum(q_lens) != T:
        raise ValueError(f"{len(q_lens)} q_lens adding up to {sum(q_lens)} and {len(prefixes)} prefixes for "
                         f"{page_table.shape[0]} page-table rows and {T} tokens")
    max_tokens = page_table.shape[1] * k_cache.shape[1]
    if any(n < 1 or p < 0 or p + n > max_tokens for n, p in zip(q_lens, prefixes)):
        raise ValueError(f"every row needs 1 <= q_len and prefix + q_len <= {max_tokens}; got {q_lens}, {prefixes}")
    num_pages, page = k_cache.shape[:2]
    if runs and (len(runs) != len(prefixes) or not all(c.is_contiguous() for c in caches) or
                 any(r > 0 and r * page + p > num_pages * page for r, p in zip(runs, prefixes))):
        raise ValueError(f"runs {list(runs)} of prefixes {prefixes} must be one a row inside a contiguous pool "
                         f"of {num_pages} pages")


@functools.cache
def _merge_pair_kernel():
    import worker.attention.prefill_kernel as prefill_kernel  # imports triton: only when a kernel launches

    return prefill_kernel.merge_pair_kernel

