"""The paged decode attention's two Triton kernels (``worker.attention.triton_decode`` launches
them): each program's split of a row's keys, then the merge of the splits by their maxima.

May import: triton, and the decode kernels' shared pieces.
"""
import triton
import triton.language as tl

from moe_offload.kernels.decode_tiles import pdl_wait
from worker.models.rope_tiles import rope_rows, rope_tables, to_kv


@triton.jit
def _row_splits(seq_len, window, splits, min_split, BLOCK_N: tl.constexpr):
    """Row b's split plan from its own length (``triton_decode.row_splits`` is the host's copy): its
    keys ``[lo, seq_len)`` (the last ``window`` where one is set) cut into ``active`` splits of
    ``split_len`` tokens, as many as ``splits`` allows without going under ``min_split``, each a
    multiple of BLOCK_N; an empty row has none."""
    lo = 0
    if window > 0:
        lo = tl.maximum(seq_len - window, 0)
    span = seq_len - lo
    want = tl.minimum(tl.maximum((span + min_split - 1) // min_split, 1), splits)
    split_len = tl.maximum((span + want - 1) // want + BLOCK_N - 1, BLOCK_N) // BLOCK_N * BLOCK_N
    return lo, split_len, (span + split_len - 1) // split_len


@triton.jit
def _split_range(lens_ptr, max_tokens, splits, min_split, window, BLOCK_N: tl.constexpr):
    """Program (b, kv_head, split): those, row b's length (clamped to the table), how many splits the
    row has, and the tokens ``[start, end)`` of this one (``start`` past ``end`` for a split past
    the row's)."""
    b = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.minimum(tl.maximum(tl.load(lens_ptr + b), 0), max_tokens).to(tl.int32)
    lo, split_len, active = _row_splits(seq_len, window, splits, min_split, BLOCK_N)
    start = lo + split * split_len
    end = tl.minimum(start + split_len, seq_len)
    return b, kv_head, split, seq_len, active, start, end


@triton.jit
def _group(kv_head, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr):
    """The query heads of ``kv_head`` (GQA) as a program's rows, and the head dim as its columns,
    each with which are real."""
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    return g, kv_head * GROUP + g, g < GROUP, d, d < HEAD_DIM


@triton.jit
def _kv_rows(table_ptr, b, kv_head, t, end, table_stride_b, num_pages, stride_page, stride_tok, stride_head,
             PAGE: tl.constexpr):
    """The pool offsets of tokens ``t``'s rows of ``kv_head`` through row b's pages (page 0 for
    tokens from ``end`` on, whose loads are masked); page ids are clamped into the pool."""
    page = tl.load(table_ptr + b * table_stride_b + t // PAGE, mask=t < end, other=0).to(tl.int64)
    page = tl.minimum(tl.maximum(page, 0), num_pages - 1)
    return page * stride_page + (t % PAGE) * stride_tok + kv_head * stride_head


@triton.jit
def _load_rows(k_ptr, v_ptr, rows, live, cols, col_live):
    """Keys and values at ``rows [N]`` (offsets, in the pointers' elements) and ``cols``, zeros
    where not ``live`` or not ``col_live``."""
    mask = live[:, None] & col_live[None, :]
    k = tl.load(k_ptr + rows[:, None] + cols[None, :], mask=mask, other=0.0)
    v = tl.load(v_ptr + rows[:, None] + cols[None, :], mask=mask, other=0.0)
    return k, v


@triton.jit
def _softmax_step(s, live, m, l, qk_scale):
    """The online softmax over one block's scores ``s [G, N]`` (columns ``live``): the new maxima,
    the factor that rescales what came before, the block's probabilities and the new sums."""
    s = tl.where(live[None, :], s * qk_scale, float("-inf"))
    m_new = tl.maximum(m, tl.max(s, 1))
    alpha = tl.exp2(m - m_new)
    p = tl.exp2(s - m_new[:, None])
    return m_new, alpha, p, l * alpha + tl.sum(p, 1)


@triton.jit
def _attend(q, k, v, t, end, m, l, acc, qk_scale, IEEE: tl.constexpr):
    """One block of the online softmax: the running maxima ``m``, sums ``l`` and ``acc`` of the
    group's heads after keys ``k`` and values ``v`` of tokens ``t`` (those before ``end``)."""
    if IEEE:
        s = tl.dot(q, tl.trans(k), input_precision="ieee")
    else:
        s = tl.dot(q, tl.trans(k))
    m_new, alpha, p, l = _softmax_step(s, t < end, m, l, qk_scale)
    if IEEE:
        pv = tl.dot(p, v, input_precision="ieee")
    else:
        pv = tl.dot(p.to(v.dtype), v)
    return m_new, l, acc * alpha[:, None] + pv


@triton.jit
def _walk_split(q, k_ptr, v_ptr, table_ptr, b, kv_head, first, end, d, d_live, table_stride_b, num_pages,
                stride_page, stride_tok, stride_head, qk_scale, PAGE: tl.constexpr, BLOCK_G: tl.constexpr,
                BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr, WORDS: tl.constexpr,
                CVT: tl.constexpr):
    """The online softmax of the group's queries over tokens ``[first, end)``, BLOCK_N a step:
    ``(m, l, acc)``. WORDS: a float8 pool read as words of two values (``_walk_split_words``,
    BLOCK_D the head dim), widened by ``cvt`` where CVT; else as tiles."""
    if WORDS:
        m, l, acc = _walk_split_words(q, k_ptr, v_ptr, table_ptr, b, kv_head, first, end, table_stride_b, num_pages,
                                      stride_page, stride_tok, stride_head, qk_scale, PAGE, BLOCK_G, BLOCK_D, BLOCK_N,
                                      CVT)
    else:
        m, l, acc = _walk_split_tiles(q, k_ptr, v_ptr, table_ptr, b, kv_head, first, end, d, d_live, table_stride_b,
                                      num_pages, stride_page, stride_tok, stride_head, qk_scale, PAGE, BLOCK_G,
                                      BLOCK_D, BLOCK_N, IEEE)
    return m, l, acc


@triton.jit
def _walk_split_tiles(q, k_ptr, v_ptr, table_ptr, b, kv_head, first, end, d, d_live, table_stride_b, num_pages,
                      stride_page, stride_tok, stride_head, qk_scale, PAGE: tl.constexpr, BLOCK_G: tl.constexpr,
                      BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr):
    """``_walk_split`` over tiles of the pool's dtype, widened to the query's (exactly, from float8)."""
    # a finite floor instead of -inf: exp2(m - m_new) never sees inf - inf
    m = tl.full([BLOCK_G], -1e30, tl.float32)
    l = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    for t0 in range(first, end, BLOCK_N):
        t = t0 + tl.arange(0, BLOCK_N)
        rows = _kv_rows(table_ptr, b, kv_head, t, end, table_stride_b, num_pages, stride_page, stride_tok, stride_head,
                        PAGE)
        k, v = _load_rows(k_ptr, v_ptr, rows, t < end, d, d_live)
        k, v = k.to(q.dtype), v.to(q.dtype)
        m, l, acc = _attend(q, k, v, t, end, m, l, acc, qk_scale, IEEE)
    return m, l, acc


@triton.jit
def _e4m3_words(words, CVT: tl.constexpr):
    """int16 words, each two float8 e4m3 values (the even-indexed in the low byte), as the even and
    the odd values widened to float16, exactly. CVT (sm89 and later): one ``cvt.rn.f16x2.e4m3x2`` a
    word (Triton's casts take masks, shifts and repacks more: a step of ``decode_partial_kernel``'s
    loop, 128 keys, 1,100 instructions against 718 on sm90, ``scripts/attention_regs.py --arch 90``);
    otherwise, and interpreted, Triton's casts."""
    if CVT:
        return tl.inline_asm_elementwise("{ .reg .b32 t; cvt.rn.f16x2.e4m3x2 t, $2; mov.b32 {$0, $1}, t; }",
                                         "=h,=h,h", [words], dtype=(tl.float16, tl.float16), is_pure=True, pack=1)
    even = (words & 0xFF).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float16)
    odd = ((words >> 8) & 0xFF).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float16)
    return even, odd


@triton.jit
def _halves(x, ROWS: tl.constexpr, HALF: tl.constexpr):
    """``x [ROWS, 2 * HALF]``'s even and odd columns, in float16."""
    wide = tl.clamp(x.to(tl.float32), -65504.0, 65504.0)  # float16's largest: a bf16 query past it saturates
    return tl.split(tl.reshape(wide.to(tl.float16), (ROWS, HALF, 2)))


@triton.jit
def _walk_split_words(q, k_ptr, v_ptr, table_ptr, b, kv_head, first, end, table_stride_b, num_pages, stride_page,
                      stride_tok, stride_head, qk_scale, PAGE: tl.constexpr, BLOCK_G: tl.constexpr,
                      HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, CVT: tl.constexpr):
    """``_walk_split`` over a float8 pool read as int16 words of two values: the even and the odd
    dims widen apart (``_e4m3_words``), the scores sum the two halves' dots and the output keeps
    the two halves of its columns, all in float16 (q, p) with float32 sums. A float8 tile loaded as
    such reaches the MMAs by byte-wide shared-memory loads and a three-step widening to bf16 (sm90);
    as words it takes ldmatrix and one conversion a pair. ``q``: ``[BLOCK_G, HEAD_DIM]``."""
    HALF: tl.constexpr = HEAD_DIM // 2
    q0, q1 = _halves(q, BLOCK_G, HALF)
    j = tl.arange(0, HALF)
    k_words = k_ptr.to(tl.pointer_type(tl.int16))
    v_words = v_ptr.to(tl.pointer_type(tl.int16))
    m = tl.full([BLOCK_G], -1e30, tl.float32)
    l = tl.zeros([BLOCK_G], tl.float32)
    acc0 = tl.zeros([BLOCK_G, HALF], tl.float32)
    acc1 = tl.zeros([BLOCK_G, HALF], tl.float32)
    for t0 in range(first, end, BLOCK_N):
        t = t0 + tl.arange(0, BLOCK_N)
        rows = _kv_rows(table_ptr, b, kv_head, t, end, table_stride_b, num_pages, stride_page, stride_tok, stride_head,
                        PAGE)
        k, v = _load_rows(k_words, v_words, rows // 2, t < end, j, j < HALF)
        k0, k1 = _e4m3_words(k, CVT)
        v0, v1 = _e4m3_words(v, CVT)
        s = tl.dot(q1, tl.trans(k1), tl.dot(q0, tl.trans(k0)))
        m, alpha, p, l = _softmax_step(s, t < end, m, l, qk_scale)
        p = p.to(tl.float16)
        acc0 = acc0 * alpha[:, None] + tl.dot(p, v0)
        acc1 = acc1 * alpha[:, None] + tl.dot(p, v1)
    return m, l, tl.reshape(tl.join(acc0, acc1), (BLOCK_G, HEAD_DIM))


@triton.jit
def _store_split(m, l, acc, b, head, g, g_live, d, d_live, split, active, splits, sink_ptr,
                 m_ptr, l_ptr, acc_ptr, out_ptr, out_stride_b, out_stride_h, HEADS: tl.constexpr,
                 BLOCK_D: tl.constexpr, HAS_SINK: tl.constexpr):
    """A row of one split (every row of a short context) stores its output, normalised, and the
    merge skips it; otherwise the split stores its partial for the merge."""
    if active <= 1:
        if HAS_SINK:  # the sink's mass joins the denominator, rescaled to the larger maximum
            sink = tl.load(sink_ptr + head, mask=g_live, other=0.0) * 1.4426950408889634
            top = tl.maximum(m, sink)
            acc = acc * tl.exp2(m - top)[:, None]
            l = l * tl.exp2(m - top) + tl.exp2(sink - top)
        out = acc / tl.maximum(l, 1.0)[:, None]  # l >= 1 when the row has a token or a sink; 0 leaves zeros
        tl.store(out_ptr + b * out_stride_b + head[:, None] * out_stride_h + d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=(g_live & (split + 0 * g == 0))[:, None] & d_live[None, :])
    else:
        part = (b * HEADS + head) * splits + split
        keep = g_live & (split + 0 * g < active)  # a vector compare: the interpreter rejects a broadcast scalar mask
        tl.store(m_ptr + part, m, mask=keep)
        tl.store(l_ptr + part, l, mask=keep)
        tl.store(acc_ptr + part[:, None] * BLOCK_D + d[None, :], acc, mask=keep[:, None] & d_live[None, :])


@triton.jit
def _index_reads(lens_ptr, pos_ptr, cos_ptr, sin_ptr, max_tokens, splits, min_split, window, max_positions, d,
                 dtype: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr):
    """What the RoPE partial kernel reads of the step's index buffer: ``_split_range``'s program
    and split, and the row's ``rope_tables`` (its position's cos and sin)."""
    return (_split_range(lens_ptr, max_tokens, splits, min_split, window, BLOCK_N),
            rope_tables(cos_ptr, sin_ptr, pos_ptr, tl.program_id(0), max_positions, d, dtype, HEAD_DIM))


# what follows the batch (the page table's width, the split plan, pointers into the batch's packed
# index buffer) is not specialised: an eager step at a new width compiles nothing
@triton.jit(do_not_specialize=["table_stride_b", "max_tokens", "splits", "min_split"],
            do_not_specialize_on_alignment=["table_ptr", "lens_ptr"])
def decode_partial_kernel(q_ptr, k_ptr, v_ptr, table_ptr, lens_ptr, sink_ptr, m_ptr, l_ptr, acc_ptr,
                          out_ptr, out_stride_b, out_stride_h, q_stride_b, q_stride_h, stride_page, stride_tok,
                          stride_head, table_stride_b,
                          num_pages, max_tokens, splits, min_split, qk_scale, window,
                          HEADS: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE: tl.constexpr,
                          BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr,
                          BLOCK_N: tl.constexpr, IEEE: tl.constexpr, HAS_SINK: tl.constexpr, PDL: tl.constexpr,
                          WORDS: tl.constexpr, CVT: tl.constexpr):
    pdl_wait(PDL)  # see triton_support.pdl_args
    b, kv_head, split, seq_len, active, start, end = _split_range(lens_ptr, max_tokens, splits, min_split, window,
                                                                  BLOCK_N)
    if (split > 0) & (split >= active):  # past the row's splits (the grid is the longest row's): nothing to store
        return
    g, head, g_live, d, d_live = _group(kv_head, GROUP, HEAD_DIM, BLOCK_G, BLOCK_D)
    q = tl.load(q_ptr + b * q_stride_b + head[:, None] * q_stride_h + d[None, :],
                mask=g_live[:, None] & d_live[None, :], other=0.0)
    m, l, acc = _walk_split(q, k_ptr, v_ptr, table_ptr, b, kv_head, start, end, d, d_live, table_stride_b, num_pages,
                            stride_page, stride_tok, stride_head, qk_scale, PAGE, BLOCK_G, BLOCK_D, BLOCK_N, IEEE,
                            WORDS, CVT)
    _store_split(m, l, acc, b, head, g, g_live, d, d_live, split, active, splits, sink_ptr,
                 m_ptr, l_ptr, acc_ptr, out_ptr, out_stride_b, out_stride_h, HEADS, BLOCK_D, HAS_SINK)


# as decode_partial_kernel's, and the new token's slot and position (views into the packed index buffer)
@triton.jit(do_not_specialize=["table_stride_b", "max_tokens", "splits", "min_split"],
            do_not_specialize_on_alignment=["table_ptr", "lens_ptr", "loc_ptr", "pos_ptr"])
def decode_rope_partial_kernel(q_ptr, k_ptr, v_ptr, table_ptr, lens_ptr, sink_ptr, m_ptr, l_ptr, acc_ptr,
                               out_ptr, out_stride_b, out_stride_h, q_stride_b, q_stride_h, stride_page, stride_tok,
                               stride_head, table_stride_b,
                               num_pages, max_tokens, splits, min_split, qk_scale, window,
                               k_new_ptr, v_new_ptr, k_stride_b, k_stride_h, v_stride_b, v_stride_h, loc_ptr,
                               pos_ptr, cos_ptr, sin_ptr, qw_ptr, kw_ptr, max_positions, eps,
                               HEADS: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
                               PAGE: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr,
                               HAS_SINK: tl.constexpr, HAS_NORM: tl.constexpr, PDL: tl.constexpr,
                               WORDS: tl.constexpr, CVT: tl.constexpr, EARLY: tl.constexpr):
    """``decode_partial_kernel`` over the projection's q, k and v as they are: each program norms and
    rotates its group's queries (``qk_rope``'s arithmetic), and the split holding the row's last
    token (the new one, at ``seq_len - 1``) also the new key, which with the new value it stores at
    the token's slot, rounded as the pool holds them (``to_kv``), and reads them back from there
    after a barrier of its program, in the loop every split runs (``triton_decode`` says what the
    other ways measured); a row of length 0 stores nothing. So ``qk_rope``'s launch is gone from a
    decode step. Launched with 8 warps (``triton_decode.ROPE_WARPS``): with 4 the rotation's float32 tiles
    take it to 246 registers a thread (``scripts/attention_regs.py``) and the step ran 7 % slower
    than with two launches (H200, 2026-12-05, ``SLUICE_ROPE_WARPS=4``); over a float8 pool with 4
    (``triton_decode.FP8_ROPE_WARPS``), where 8 ran slower still.

    EARLY (the row lengths and positions were written two launches back or more: a model's step
    copies its index buffer in before its first layer): the split plan and the rotation's tables
    are read before the PDL wait, beside the projection's tail (``triton_support.pdl_args``); only
    the projection's q, k and v wait."""
    d = tl.arange(0, HEAD_DIM)
    if EARLY:
        early = _index_reads(lens_ptr, pos_ptr, cos_ptr, sin_ptr, max_tokens, splits, min_split, window,
                             max_positions, d, q_ptr.dtype.element_ty, HEAD_DIM, BLOCK_N)
    pdl_wait(PDL)  # see triton_support.pdl_args
    if not EARLY:
        early = _index_reads(lens_ptr, pos_ptr, cos_ptr, sin_ptr, max_tokens, splits, min_split, window,
                             max_positions, d, q_ptr.dtype.element_ty, HEAD_DIM, BLOCK_N)
    split_range, tables = early
    b, kv_head, split, seq_len, active, start, end = split_range
    cos, sin = tables
    if (split > 0) & (split >= active):  # past the row's splits (the grid is the longest row's): nothing to store
        return
    g, head, g_live, d, d_live = _group(kv_head, GROUP, HEAD_DIM, BLOCK_G, HEAD_DIM)
    q = rope_rows(q_ptr + b * q_stride_b, q_stride_h, head, g_live, d, qw_ptr, cos, sin, eps, HEAD_DIM, HAS_NORM)
    one = tl.arange(0, 1)
    k_new = rope_rows(k_new_ptr + b * k_stride_b, k_stride_h, kv_head + one, one == 0, d, kw_ptr, cos, sin, eps,
                       HEAD_DIM, HAS_NORM)
    v_new = tl.load(v_new_ptr + b * v_stride_b + kv_head * v_stride_h + d)[None, :]
    # as the pool stores them (a float8 pool rounds), and attended so: as the twin reads them back
    k_new = to_kv(k_new, k_ptr.dtype.element_ty)
    v_new = to_kv(v_new, v_ptr.dtype.element_ty)
    last = seq_len - 1
    mine = (seq_len > 0) & (last >= start) & (last < end)  # the new token is this split's
    if mine:  # into its slot
        slot = tl.minimum(tl.maximum(tl.load(loc_ptr + b).to(tl.int64), 0), num_pages * PAGE - 1)
        row = (slot // PAGE) * stride_page + (slot % PAGE) * stride_tok + kv_head * stride_head
        tl.store(k_ptr + row + d[None, :], k_new)
        tl.store(v_ptr + row + d[None, :], v_new)
    tl.debug_barrier()  # the stores above are in place before any warp of this program reads the pages
    m, l, acc = _walk_split(q, k_ptr, v_ptr, table_ptr, b, kv_head, start, end, d, d_live, table_stride_b, num_pages,
                            stride_page, stride_tok, stride_head, qk_scale, PAGE, BLOCK_G, HEAD_DIM, BLOCK_N, IEEE,
                            WORDS, CVT)
    _store_split(m, l, acc, b, head, g, g_live, d, d_live, split, active, splits, sink_ptr,
                 m_ptr, l_ptr, acc_ptr, out_ptr, out_stride_b, out_stride_h, HEADS, HEAD_DIM, HAS_SINK)


@triton.jit(do_not_specialize=["max_tokens", "splits", "min_split", "window"],
            do_not_specialize_on_alignment=["lens_ptr"])
def decode_reduce_kernel(m_ptr, l_ptr, acc_ptr, lens_ptr, sink_ptr, out_ptr, out_stride_b, out_stride_h,
                         max_tokens, splits, min_split, window, HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                         BLOCK_D: tl.constexpr, BLOCK_C: tl.constexpr, CHUNK: tl.constexpr, BLOCK_N: tl.constexpr,
                         HAS_SINK: tl.constexpr, PDL: tl.constexpr):
    """Program (b, h, c): columns [c * BLOCK_C, (c + 1) * BLOCK_C) of row b's head h, merged in one
    pass over CHUNK splits a step (an online softmax over the splits' maxima): a 128k-token row's
    hundreds of splits take a few steps, each a latency, where a step of 16 took dozens.

    The row's length is read before the PDL wait: the launch before this one is always the partial
    kernel, which does not write it (``triton_support.pdl_args``)."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    early = tl.load(lens_ptr + b)
    pdl_wait(PDL)  # see triton_support.pdl_args
    seq_len = tl.minimum(tl.maximum(early, 0), max_tokens).to(tl.int32)
    _, _, active = _row_splits(seq_len, window, splits, min_split, BLOCK_N)  # the splits that stored a partial
    if active <= 1:  # the one split wrote the output itself
        return
    base = (b * HEADS + h) * splits
    d = tl.program_id(2) * BLOCK_C + tl.arange(0, BLOCK_C)
    d_live = d < HEAD_DIM
    top = tl.full((), -1e30, tl.float32)
    total = tl.zeros((), tl.float32)
    acc = tl.zeros([BLOCK_C], tl.float32)
    for s0 in range(0, active, CHUNK):
        sc = s0 + tl.arange(0, CHUNK)
        live = sc < active
        m = tl.load(m_ptr + base + sc, mask=live, other=-1e30)
        l = tl.load(l_ptr + base + sc, mask=live, other=0.0)
        part = tl.load(acc_ptr + (base + sc)[:, None] * BLOCK_D + d[None, :], mask=live[:, None] & d_live[None, :],
                       other=0.0)
        new_top = tl.maximum(top, tl.max(m, 0))
        rescale = tl.exp2(top - new_top)
        w = tl.where(live, tl.exp2(m - new_top), 0.0)
        total = total * rescale + tl.sum(w * l, 0)
        acc = acc * rescale + tl.sum(w[:, None] * part, 0)
        top = new_top
    if HAS_SINK:  # the sink's mass joins the denominator, rescaled to the larger maximum
        sink = tl.load(sink_ptr + h) * 1.4426950408889634
        new_top = tl.maximum(top, sink)
        acc = acc * tl.exp2(top - new_top)
        total = total * tl.exp2(top - new_top) + tl.exp2(sink - new_top)
    # total >= 1 when the row has a token (its maximum contributes exp2(0)); 0 leaves zeros
    out = acc / tl.maximum(total, 1.0)
    tl.store(out_ptr + b * out_stride_b + h * out_stride_h + d, out.to(out_ptr.dtype.element_ty), mask=d_live)
