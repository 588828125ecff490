"""The Triton kernel of ``worker.attention.triton_prefill`` (its layout, twin and checks are there).
This module imports triton at the top; only the op imports it, when a kernel launches."""
import triton
import triton.language as tl


@triton.jit
def attend(acc, l, m, q, k_ptr, v_ptr, table_row, num_pages, kv_off, stride_page, stride_tok, d, d_live,
           pos, seq_len, lo, hi, qk_scale,
           PAGE: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr, EVEN_D: tl.constexpr,
           IEEE: tl.constexpr):
    """Online softmax over keys [lo, hi) in BLOCK_N tiles; ``m`` is kept in the log2 domain, scaled."""
    for t0 in range(lo, hi, BLOCK_N):
        t = t0 + tl.arange(0, BLOCK_N)
        page = tl.load(table_row + t // PAGE, mask=t < hi, other=0).to(tl.int64)
        page = tl.minimum(tl.maximum(page, 0), num_pages - 1)
        row = page * stride_page + (t % PAGE) * stride_tok + kv_off
        if EVEN_D:
            k = tl.load(k_ptr + row[:, None] + d[None, :])  # [N, D]
            v = tl.load(v_ptr + row[:, None] + d[None, :])
        else:
            k = tl.load(k_ptr + row[:, None] + d[None, :], mask=d_live[None, :], other=0.0)
            v = tl.load(v_ptr + row[:, None] + d[None, :], mask=d_live[None, :], other=0.0)
        if IEEE:
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        if MASKED:
            s = tl.where((t[None, :] <= pos[:, None]) & (t < seq_len)[None, :], s, -1e30)
        m_new = tl.maximum(m, tl.max(s, 1) * qk_scale)
        p = tl.exp2(s * qk_scale - m_new[:, None])
        alpha = tl.exp2(m - m_new)
        l = l * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        if IEEE:
            acc = tl.dot(p, v, acc, input_precision="ieee")
        else:
            acc = tl.dot(p.to(v.dtype), v, acc)
        m = m_new
    return acc, l, m


@triton.jit
def prefill_kernel(q_ptr, k_ptr, v_ptr, o_ptr, table_ptr, lens_ptr, blocks_ptr,
                   q_stride_t, q_stride_h, o_stride_t, o_stride_h,
                   stride_page, stride_tok, stride_head, table_stride_b, num_pages, max_tokens, qk_scale,
                   GROUP: tl.constexpr, BLOCK_G: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                   PAGE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr):
    blk = tl.program_id(0)
    kv_head = tl.program_id(1)
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
    acc, l, m = attend(acc, l, m, q, k_ptr, v_ptr, table_row, num_pages, kv_off, stride_page, stride_tok,
                       d, d_live, pos, seq_len, 0, full, qk_scale, PAGE, BLOCK_N, False, BLOCK_D == HEAD_DIM, IEEE)
    acc, l, m = attend(acc, l, m, q, k_ptr, v_ptr, table_row, num_pages, kv_off, stride_page, stride_tok,
                       d, d_live, pos, seq_len, full, hi, qk_scale, PAGE, BLOCK_N, True, BLOCK_D == HEAD_DIM, IEEE)
    out = acc / l[:, None]
    tl.store(o_ptr + q_rows[:, None] * o_stride_t + head[:, None] * o_stride_h + d[None, :],
             out.to(o_ptr.dtype.element_ty), mask=row_live[:, None] & d_live[None, :])

