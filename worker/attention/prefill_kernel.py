"""The Triton kernels of ``worker.attention.triton_prefill`` (layout, twin and checks are there) and
of its split-KV merge (``worker.attention.split_kv``), and the merge of the cuDNN path's two parts
(``worker.attention.cudnn_prefill``). This module imports triton at the top; only the ops import it,
when a kernel launches.

Triton specialises an int argument on ``== 1`` and divisibility by 16, and a pointer on 16-byte
alignment, and compiles once per combination: the arguments that follow the batch (token and row
counts, splits, the page table's width) and the pointers into the batch's packed index buffer
(``worker.batch.to_device``: the page table and lengths start at offsets that follow the token
count) are left unspecialised, so a length the warm-up did not meet compiles nothing. Strides and
sizes fixed by the model stay specialised: they carry the alignment the vector loads use."""
import triton
import triton.language as tl


@triton.jit
def mma(a, b, acc, IEEE: tl.constexpr, UPCAST: tl.constexpr):
    """``acc + a @ b``. UPCAST: Triton's interpreter multiplies bf16 tiles as their raw uint16
    bits, so under it bf16 operands (already rounded) go to the dot as float32."""
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc)
    if IEEE:
        return tl.dot(a, b, acc, input_precision="ieee")
    return tl.dot(a, b, acc)


@triton.jit
def key_rows(table_row, num_pages, kv_off, stride_page, stride_tok, t, hi, PAGE: tl.constexpr):
    """Offsets of keys ``t`` of one KV head in the pool (K and V alike), page ids clamped into it."""
    page = tl.load(table_row + t // PAGE, mask=t < hi, other=0).to(tl.int64)
    page = tl.minimum(tl.maximum(page, 0), num_pages - 1)
    return page * stride_page + (t % PAGE) * stride_tok + kv_off


@triton.jit
def load_rows(ptr, row, d, d_live, EVEN_D: tl.constexpr, dtype: tl.constexpr):
    """``[N, D]`` at the offsets ``row``, in ``dtype`` (the query's: a float8 pool's keys and values
    are widened, exactly, before the MMAs; a pool of the query's dtype casts nothing)."""
    if EVEN_D:
        tile = tl.load(ptr + row[:, None] + d[None, :])
    else:
        tile = tl.load(ptr + row[:, None] + d[None, :], mask=d_live[None, :], other=0.0)
    return tile.to(dtype)


@triton.jit
def softmax_step(acc, l, m, s, v, qk_scale, IEEE: tl.constexpr, UPCAST: tl.constexpr):
    """One tile of the online softmax: scores ``s`` (unscaled), values ``v``; ``m`` in the scaled
    log2 domain."""
    m_new = tl.maximum(m, tl.max(s, 1) * qk_scale)
    p = tl.exp2(s * qk_scale - m_new[:, None])
    alpha = tl.exp2(m - m_new)
    l = l * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None]
    if IEEE:
        acc = mma(p, v, acc, IEEE, UPCAST)
    else:
        acc = mma(p.to(v.dtype), v, acc, IEEE, UPCAST)
    return acc, l, m_new


@triton.jit
def attend(acc, l, m, q, k_ptr, v_ptr, table_row, num_pages, kv_off, stride_page, stride_tok, d, d_live,
           pos, seq_len, lo, hi, qk_scale, window,
           PAGE: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr, EVEN_D: tl.constexpr,
           IEEE: tl.constexpr, UPCAST: tl.constexpr, WARP_SPECIALIZE: tl.constexpr, WINDOWED: tl.constexpr):
    """Online softmax over keys [lo, hi) in BLOCK_N tiles. MASKED: the causal (and seq_len) mask per
    query; without it every key of [lo, hi) is visible. WINDOWED: a query also sees only the
    ``window`` keys ending at its own position (gpt-oss's sliding layers)."""
    for t0 in tl.range(lo, hi, BLOCK_N, warp_specialize=WARP_SPECIALIZE):
        t = t0 + tl.arange(0, BLOCK_N)
        row = key_rows(table_row, num_pages, kv_off, stride_page, stride_tok, t, hi, PAGE)
        k = load_rows(k_ptr, row, d, d_live, EVEN_D, q.dtype)
        v = load_rows(v_ptr, row, d, d_live, EVEN_D, q.dtype)
        s = mma(q, tl.trans(k), tl.zeros([q.shape[0], BLOCK_N], tl.float32), IEEE, UPCAST)
        if MASKED:
            visible = (t[None, :] <= pos[:, None]) & (t < seq_len)[None, :]
            if WINDOWED:
                visible = visible & (t[None, :] > pos[:, None] - window)
            # -inf, not -1e30: with the scale fused into exp2's argument (an FMA on a GPU),
            # -1e30 * qk_scale - m_new leaves a rounding residual (about 1e21) for a query whose
            # every key here is masked, so exp2 gave inf (then NaN); exp2(-inf) is exactly 0, and m's
            # finite floor keeps m_new finite
            s = tl.where(visible, s, float("-inf"))
        acc, l, m = softmax_step(acc, l, m, s, v, qk_scale, IEEE, UPCAST)
    return acc, l, m


@triton.jit
def attend_ahead(acc, l, m, q, k_ptr, v_ptr, table_row, num_pages, kv_off, stride_page, stride_tok, d, d_live,
                 lo, hi, qk_scale,
                 PAGE: tl.constexpr, BLOCK_N: tl.constexpr, EVEN_D: tl.constexpr, IEEE: tl.constexpr,
                 UPCAST: tl.constexpr):
    """``attend`` over mask-free whole tiles [lo, hi), with the next tile's scores issued before this
    tile's softmax, so that the exponentials can overlap an asynchronous QK^T (FlashAttention-3's
    intra-warpgroup pipelining, by hand). The last step scores the last tile again, unused."""
    if lo < hi:
        r = tl.arange(0, BLOCK_N)
        row = key_rows(table_row, num_pages, kv_off, stride_page, stride_tok, lo + r, hi, PAGE)
        k = load_rows(k_ptr, row, d, d_live, EVEN_D, q.dtype)
        s = mma(q, tl.trans(k), tl.zeros([q.shape[0], BLOCK_N], tl.float32), IEEE, UPCAST)
        for t0 in tl.range(lo, hi, BLOCK_N):
            v = load_rows(v_ptr, row, d, d_live, EVEN_D, q.dtype)  # this tile's values
            row = key_rows(table_row, num_pages, kv_off, stride_page, stride_tok,
                           tl.minimum(t0 + BLOCK_N, hi - BLOCK_N) + r, hi, PAGE)
            k = load_rows(k_ptr, row, d, d_live, EVEN_D, q.dtype)
            s_next = mma(q, tl.trans(k), tl.zeros([q.shape[0], BLOCK_N], tl.float32), IEEE, UPCAST)
            acc, l, m = softmax_step(acc, l, m, s, v, qk_scale, IEEE, UPCAST)
            s = s_next
    return acc, l, m


@triton.jit(do_not_specialize=["table_stride_b", "max_tokens", "tokens", "splits"],
            do_not_specialize_on_alignment=["table_ptr", "lens_ptr", "sink_ptr"])
def prefill_kernel(q_ptr, k_ptr, v_ptr, o_ptr, part_o_ptr, part_lse_ptr, table_ptr, lens_ptr, blocks_ptr, sink_ptr,
                   q_stride_t, q_stride_h, o_stride_t, o_stride_h,
                   stride_page, stride_tok, stride_head, table_stride_b, num_pages, max_tokens, qk_scale,
                   tokens, heads, splits, window,
                   GROUP: tl.constexpr, BLOCK_G: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                   PAGE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr,
                   UPCAST: tl.constexpr, WARP_SPECIALIZE: tl.constexpr, QK_AHEAD: tl.constexpr,
                   SPLIT: tl.constexpr, WINDOWED: tl.constexpr, HAS_SINK: tl.constexpr):
    """Program (block, kv head, split): split s of ``splits`` takes its share of the block's
    mask-free key tiles; the last split also takes the diagonal. SPLIT: write the normalised partial
    output and its log2-sum-exp for the merge, else the output itself (``splits`` is then 1).
    WINDOWED (gpt-oss's sliding layers): no mask-free tiles; the last split walks the masked keys
    from the block's first query's window on. HAS_SINK: each head's sink logit joins the last
    split's denominator (so the merge counts it once)."""
    blk = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    b = tl.load(blocks_ptr + blk * 4)
    q_start = tl.load(blocks_ptr + blk * 4 + 1)
    q_len = tl.load(blocks_ptr + blk * 4 + 2)
    m0 = tl.load(blocks_ptr + blk * 4 + 3)
    seq_len = tl.minimum(tl.maximum(tl.load(lens_ptr + b), q_len), max_tokens).to(tl.int32)  # clamp, then narrow
    prefix = seq_len - q_len
    r = tl.arange(0, BLOCK_M * BLOCK_G)
    tok = m0 + r // BLOCK_G
    head = kv_head * GROUP + r % BLOCK_G
    row_live = (tok < q_len) & (r % BLOCK_G < GROUP)
    d = tl.arange(0, BLOCK_D)
    d_live = d < HEAD_DIM
    q_rows = (q_start + tok).to(tl.int64)
    q = tl.load(q_ptr + q_rows[:, None] * q_stride_t + head[:, None] * q_stride_h + d[None, :],
                mask=row_live[:, None] & d_live[None, :], other=0.0)
    pos = prefix + tok
    # a finite floor instead of -inf: exp2(m - m_new) never sees inf - inf
    m = tl.full([BLOCK_M * BLOCK_G], -1e30, tl.float32)
    l = tl.zeros([BLOCK_M * BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_M * BLOCK_G, BLOCK_D], tl.float32)
    table_row = table_ptr + b.to(tl.int64) * table_stride_b
    kv_off = kv_head * stride_head
    full = (prefix + m0 + 1) // BLOCK_N * BLOCK_N  # keys every query of the block sees
    hi = tl.minimum(prefix + m0 + BLOCK_M, seq_len)
    tiles = (full // BLOCK_N).to(tl.int64)  # split bounds in whole tiles, from device lengths
    if WINDOWED:  # no mask-free tiles; the masked walk starts at the block's first window
        full = tl.maximum(prefix + m0 - window + 1, 0) // BLOCK_N * BLOCK_N
        tiles = tiles * 0
    lo = (split * tiles // splits * BLOCK_N).to(tl.int32)
    mid = ((split + 1) * tiles // splits * BLOCK_N).to(tl.int32)
    diag = tl.where(split == splits - 1, full, hi)  # the other splits' diagonal loop is empty
    if QK_AHEAD:
        acc, l, m = attend_ahead(acc, l, m, q, k_ptr, v_ptr, table_row, num_pages, kv_off, stride_page, stride_tok,
                                 d, d_live, lo, mid, qk_scale, PAGE, BLOCK_N, BLOCK_D == HEAD_DIM, IEEE, UPCAST)
    else:
        acc, l, m = attend(acc, l, m, q, k_ptr, v_ptr, table_row, num_pages, kv_off, stride_page, stride_tok,
                           d, d_live, pos, seq_len, lo, mid, qk_scale, window, PAGE, BLOCK_N, False,
                           BLOCK_D == HEAD_DIM, IEEE, UPCAST, WARP_SPECIALIZE, False)
    acc, l, m = attend(acc, l, m, q, k_ptr, v_ptr, table_row, num_pages, kv_off, stride_page, stride_tok,
                       d, d_live, pos, seq_len, diag, hi, qk_scale, window, PAGE, BLOCK_N, True, BLOCK_D == HEAD_DIM,
                       IEEE, UPCAST, WARP_SPECIALIZE, WINDOWED)
    if HAS_SINK:  # the last split counts each head's sink once, rescaled to the larger maximum
        last = split == splits - 1
        sink = tl.load(sink_ptr + head, mask=row_live, other=0.0) * 1.4426950408889634
        top = tl.where(last, tl.maximum(m, sink), m)
        rescale = tl.exp2(m - top)
        acc = acc * rescale[:, None]
        l = l * rescale + tl.where(last, tl.exp2(tl.minimum(sink - top, 0.0)), 0.0)
        m = top
    live = row_live[:, None] & d_live[None, :]
    if SPLIT:  # a split without keys (l = 0) stores zeros and weight exp2(-1e30): nothing in the merge
        seen = l > 0
        l = tl.where(seen, l, 1.0)
        part = (split * tokens + q_rows) * heads + head
        tl.store(part_o_ptr + part[:, None] * HEAD_DIM + d[None, :], acc / l[:, None], mask=live)
        tl.store(part_lse_ptr + part, tl.where(seen, m + tl.log2(l), -1e30), mask=row_live)
    else:
        tl.store(o_ptr + q_rows[:, None] * o_stride_t + head[:, None] * o_stride_h + d[None, :],
                 (acc / l[:, None]).to(o_ptr.dtype.element_ty), mask=live)


@triton.jit(do_not_specialize=["rows", "splits"])
def merge_kernel(part_o_ptr, part_lse_ptr, o_ptr, rows, heads, splits, o_stride_t, o_stride_h,
                 HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_R: tl.constexpr):
    """Rows (token, head) of ``part_o [splits, rows, D]`` weighted by ``exp2(lse - max lse)``."""
    r = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    live = r < rows
    d = tl.arange(0, BLOCK_D)
    mask = live[:, None] & (d < HEAD_DIM)[None, :]
    top = tl.full([BLOCK_R], -1e30, tl.float32)
    for s in range(splits):
        top = tl.maximum(top, tl.load(part_lse_ptr + s * rows + r, mask=live, other=-1e30))
    acc = tl.zeros([BLOCK_R, BLOCK_D], tl.float32)
    weight = tl.zeros([BLOCK_R], tl.float32)  # >= 1 for a live row: its top split weighs exp2(0)
    for s in range(splits):
        w = tl.exp2(tl.load(part_lse_ptr + s * rows + r, mask=live, other=-1e30) - top)
        acc += w[:, None] * tl.load(part_o_ptr + (s * rows + r)[:, None] * HEAD_DIM + d[None, :], mask=mask, other=0.0)
        weight += w
    tl.store(o_ptr + (r // heads)[:, None] * o_stride_t + (r % heads)[:, None] * o_stride_h + d[None, :],
             (acc / weight[:, None]).to(o_ptr.dtype.element_ty), mask=mask)


# the log-sum-exps come from cuDNN as [1, heads, n, 1]: their head stride is the token count. The
# outputs' strides are multiples of the head dim whatever their layout, so they stay specialised.
@triton.jit(do_not_specialize=["rows", "l1_st", "l1_sh", "l2_st", "l2_sh"])
def merge_pair_kernel(o1_ptr, lse1_ptr, o2_ptr, lse2_ptr, out_ptr, rows, heads,
                      o1_st, o1_sh, l1_st, l1_sh, o2_st, o2_sh, l2_st, l2_sh, out_st, out_sh,
                      HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_R: tl.constexpr):
    """Rows r = (token, head) of two normalised partial outputs, weighted by ``exp(lse - max lse)``
    (natural-log lse); every operand by its own token and head strides."""
    r = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    live = r < rows
    t, h = r // heads, r % heads
    d = tl.arange(0, BLOCK_D)
    mask = live[:, None] & (d < HEAD_DIM)[None, :]
    a = tl.load(lse1_ptr + t * l1_st + h * l1_sh, mask=live, other=0.0)
    b = tl.load(lse2_ptr + t * l2_st + h * l2_sh, mask=live, other=0.0)
    top = tl.maximum(a, b)
    wa, wb = tl.exp(a - top), tl.exp(b - top)
    oa = tl.load(o1_ptr + (t * o1_st + h * o1_sh)[:, None] + d[None, :], mask=mask, other=0.0).to(tl.float32)
    ob = tl.load(o2_ptr + (t * o2_st + h * o2_sh)[:, None] + d[None, :], mask=mask, other=0.0).to(tl.float32)
    o = (oa * wa[:, None] + ob * wb[:, None]) / (wa + wb)[:, None]
    tl.store(out_ptr + (t * out_st + h * out_sh)[:, None] + d[None, :], o.to(out_ptr.dtype.element_ty), mask=mask)
