"""Triton pieces shared by the 4-bit grouped GEMM's prefill and decode kernels: decoding packed
e2m1 tiles and their group scales in registers, the dot over a decoded tile, and the epilogue
(channel scale, bias rows, activation). The layout is ``grouped_gemm_w4_banks``'.

A tile is read as int32 words ``[R, BLOCK_K/G, G/8]`` (rows, groups, words: eight codes a word,
one 8- or 16-byte load a group) and decoded with masks and shifts, two codes an operation: a
code's sign and magnitude bits put under an fp16 exponent make the fp16 number
``e2m1 * 2^-14`` exactly (0.5 becomes the subnormal 2^-15), and each half of a word is one such
number, widened to fp32 exactly (``HADD2.F32`` selects the half). Joins put the eight values of a
word back in k order, in registers. The group's scale, times 2^14, multiplies once a group
(loaded once, broadcast along the group). ``e2m1 * scale`` is exact in bf16 (at most 6
significant bits; e8m0 is a power of two), so the 16-bit dot sees the checkpoint's weights;
nvfp4's channel scale multiplies the accumulator per output column. K need only be a multiple of
G: the tail is masked by whole groups. With ``SLUICE_W4_BF16_PAIRS=1`` an nvfp4 tile for a bf16 dot
is decoded under bf16's exponent instead and scaled a pair at a time (``pair_dequant_tile``).
"""
from __future__ import annotations

import os

import triton
import triton.language as tl

from moe_offload.kernels.decode_tiles import store_weighted


# The sign bits of both halves of a word (0x80008000 as an int32, so the word stays int32).
_HIGH_SIGNS = tl.constexpr(-0x7FFF8000)
# nvfp4 tiles for a bf16 dot decoded as bf16 pairs (``pair_dequant_tile``): one packed multiply a
# pair of weights where the fp32 path widens, scales and packs each (compiled for sm90: see
# docs/architecture.md). Off until a GPU has run it: SLUICE_W4_BF16_PAIRS=1 turns it on (read at
# import; it keys Triton's cache as a global the kernels read).
BF16_PAIRS = tl.constexpr(os.environ.get("SLUICE_W4_BF16_PAIRS", "0") == "1")
# A pair's multiplier is its group's e4m3 scale times 2^117 in bf16 (448 * 2^117 < 2^126: finite),
# the decoded value e2m1 * 2^-126, so the dot sums weights times 2^-9; the sum is then taken back
# by PAIR_UNSCALE (exact: powers of two).
PAIR_SCALE = tl.constexpr(2.0 ** 117)
PAIR_UNSCALE = tl.constexpr(2.0 ** 9)


@triton.jit
def e2m1_words(w, K_ORDER: tl.constexpr = False, BF16: tl.constexpr = False):
    """int32 words ``[R, NG, W]`` of packed codes (k = 8i + 0..7: byte j's low nibble is k = 2j)
    -> fp32 ``[R, NG, W, 8]`` in k order, each e2m1 value times 2^-14. Each mask-and-shift puts
    the codes of bytes 0 and 2 (or 1 and 3) under the fp16 exponents of a word's two halves at
    once: eleven integer operations for eight values. BF16: under bf16's exponent instead, three
    bits lower, and left in bf16: each value times 2^-126 (+-0.5 the subnormal 2^-127).

    A join's new dim is the fastest in a thread's registers. K_ORDER joins each word's halves
    first and neighbours last, so a thread's registers hold k in order and a float32 row that
    multiplies them loads 16 bytes at a time (the per-token down's weighted act rows: compiled for
    sm90, 192 four-byte loads a thread become 48 of 16); the other order joins the halves last,
    which one token's gate_up, multiplying a bf16 row, compiles to fewer instructions (mxfp4)
    or registers (nvfp4) with (``scripts/kernel_sass.py``)."""
    if BF16:
        k04 = ((w & 0x00070007) << 6) | ((w & 0x00080008) << 12)
        k15 = ((w & 0x00700070) << 2) | ((w & 0x00800080) << 8)
        k26 = ((w & 0x07000700) >> 2) | ((w & 0x08000800) << 4)
        k37 = ((w & 0x70007000) >> 6) | (w & _HIGH_SIGNS)
    else:
        k04 = ((w & 0x00070007) << 9) | ((w & 0x00080008) << 12)
        k15 = ((w & 0x00700070) << 5) | ((w & 0x00800080) << 8)
        k26 = ((w & 0x07000700) << 1) | ((w & 0x08000800) << 4)
        k37 = ((w & 0x70007000) >> 3) | (w & _HIGH_SIGNS)
    if K_ORDER:  # [..., h, b, a] holds k = 4h + 2b + a, a the fastest register
        values = tl.join(tl.join(_halves(k04, BF16), _halves(k26, BF16)),
                         tl.join(_halves(k15, BF16), _halves(k37, BF16)))
    else:  # [..., a, b] holds k = 2a + b in the low halves, 4 + 2a + b in the high ones
        values = tl.permute(_halves(tl.join(tl.join(k04, k26), tl.join(k15, k37)), BF16), (0, 1, 2, 5, 3, 4))
    return tl.reshape(values, (w.shape[0], w.shape[1], w.shape[2], 8))


@triton.jit
def _halves(k, BF16: tl.constexpr):
    """Words' two halves as ``[..., 2]`` (low, high): fp16 numbers widened to fp32, or BF16 bf16 ones."""
    if BF16:
        low = k.to(tl.int16).to(tl.bfloat16, bitcast=True)
        high = (k >> 16).to(tl.int16).to(tl.bfloat16, bitcast=True)
    else:
        low = k.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
        high = (k >> 16).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    return tl.join(low, high)


@triton.jit
def group_scale(s, E8M0: tl.constexpr):
    """Group scales as fp32 times 2^14 (undoing ``e2m1_words``' 2^-14): e8m0 byte e is 2^(e-127),
    so the product's exponent field is e + 14 (byte 0 included)."""
    if E8M0:
        return ((s.to(tl.int32) + 14) << 23).to(tl.float32, bitcast=True)
    return s.to(tl.float32) * 16384.0


# The words a packed row's start is known to be a multiple of, beyond what the compiler sees (for
# ``decode_tiles.aligned``), by format: an mxfp4 row is whole 16-byte groups (K a multiple of 32,
# checked on the host), 4 words, so gpt-oss' rows of 360 words load 16 bytes at a time, not 4;
# nvfp4's groups are 8 bytes, and a hint of 2 words would replace the 16 that qwen3's strides show.
MXFP4_ROW_ALIGN = tl.constexpr(4)


@triton.jit
def packed_tile(q_ptr, s_ptr, rows, row_ok, k0, k_len, stride_qn, stride_sn,
                BLOCK_K: tl.constexpr, GROUP: tl.constexpr, EVEN_K: tl.constexpr):
    """Packed words ``[R, BLOCK_K/G, G/8]`` (int32, ``q_ptr`` and ``stride_qn`` in words) and the
    group scales ``[R, BLOCK_K/G]`` of rows ``rows`` and k in ``[k0, k0 + BLOCK_K)`` of one slot's
    bank (the pointers at the slot); groups past ``k_len`` (a multiple of G) and rows not
    ``row_ok`` read as zero. A group's words are one load: mxfp4's 16 bytes. nvfp4's group is 8
    bytes, so with EVEN_K (``k_len`` a multiple of BLOCK_K: no mask along k) its row of BLOCK_K/8
    words loads as one run, 16 bytes at a time, and is split into groups after (compiled for sm90
    at qwen3-30b's shapes: the per-slot down's copies become 16-byte, its registers 215 -> 168)."""
    q = packed_words(q_ptr, rows, row_ok, k0, k_len, stride_qn, BLOCK_K, GROUP, EVEN_K)
    return q, group_scales(s_ptr, rows, row_ok, k0, k_len, stride_sn, BLOCK_K, GROUP, EVEN_K)


@triton.jit
def packed_words(q_ptr, rows, row_ok, k0, k_len, stride_qn, BLOCK_K: tl.constexpr, GROUP: tl.constexpr,
                 EVEN_K: tl.constexpr):
    """``packed_tile``'s words ``[R, BLOCK_K/G, G/8]``."""
    gs = k0 // GROUP + tl.arange(0, BLOCK_K // GROUP)
    row = rows.to(tl.int64) * stride_qn
    if GROUP == 32:  # (inline: a hint returned from a helper does not reach the loads)
        row = tl.multiple_of(row, MXFP4_ROW_ALIGN)
    if EVEN_K and GROUP < 32:
        ws = k0 // 8 + tl.arange(0, BLOCK_K // 8)
        q = tl.load(q_ptr + row[:, None] + ws[None, :], mask=row_ok[:, None], other=0)
        q = tl.reshape(q, (q.shape[0], BLOCK_K // GROUP, GROUP // 8))
    else:
        ok = row_ok[:, None] & (gs < k_len // GROUP)[None, :]
        words = (gs * (GROUP // 8))[None, :, None] + tl.arange(0, GROUP // 8)[None, None, :]
        q = tl.load(q_ptr + row[:, None, None] + words, mask=ok[:, :, None], other=0)
    return q


@triton.jit
def group_scales(s_ptr, rows, row_ok, k0, k_len, stride_sn, BLOCK_K: tl.constexpr, GROUP: tl.constexpr,
                 EVEN_K: tl.constexpr):
    """``packed_tile``'s group scales ``[R, BLOCK_K/G]``."""
    gs = k0 // GROUP + tl.arange(0, BLOCK_K // GROUP)
    if EVEN_K and GROUP < 32:
        ok = row_ok[:, None] & (gs >= 0)[None, :]
    else:
        ok = row_ok[:, None] & (gs < k_len // GROUP)[None, :]
    return tl.load(s_ptr + rows[:, None].to(tl.int64) * stride_sn + gs[None, :], mask=ok, other=0.0)


@triton.jit
def group_values(q, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, GROUP: tl.constexpr, K_ORDER: tl.constexpr = False):
    """``packed_tile``'s words as fp32 ``[R, BLOCK_K/G, G]`` in k order (times 2^-14, unscaled;
    K_ORDER as ``e2m1_words``)."""
    return tl.reshape(e2m1_words(q, K_ORDER), (BLOCK_R, BLOCK_K // GROUP, GROUP))


@triton.jit
def dequant_tile(q_ptr, s_ptr, rows, row_ok, k0, k_len, stride_qn, stride_sn, BLOCK_R: tl.constexpr,
                 BLOCK_K: tl.constexpr, GROUP: tl.constexpr, E8M0: tl.constexpr, EVEN_K: tl.constexpr):
    """The weights of ``packed_tile`` in fp32 (without the channel scale), transposed for a dot:
    ``[BLOCK_K, R]``."""
    q, s = packed_tile(q_ptr, s_ptr, rows, row_ok, k0, k_len, stride_qn, stride_sn, BLOCK_K, GROUP, EVEN_K)
    w = group_values(q, BLOCK_R, BLOCK_K, GROUP) * group_scale(s, E8M0)[:, :, None]
    return tl.trans(tl.reshape(w, (BLOCK_R, BLOCK_K)))


@triton.jit
def pair_dequant_tile(q_ptr, s_ptr, rows, row_ok, k0, k_len, stride_qn, stride_sn, BLOCK_R: tl.constexpr,
                      BLOCK_K: tl.constexpr, GROUP: tl.constexpr, EVEN_K: tl.constexpr):
    """``dequant_tile`` of nvfp4 in bf16, each weight times 2^-9 (``PAIR_SCALE``): exact, since
    ``e2m1 * scale`` has at most 6 significant bits and every product is a bf16 normal (2^-19 and
    up)."""
    q, s = packed_tile(q_ptr, s_ptr, rows, row_ok, k0, k_len, stride_qn, stride_sn, BLOCK_K, GROUP, EVEN_K)
    scale = (s.to(tl.float32) * PAIR_SCALE).to(tl.bfloat16)
    w = tl.reshape(e2m1_words(q, BF16=True), (BLOCK_R, BLOCK_K // GROUP, GROUP)) * scale[:, :, None]
    return tl.trans(tl.reshape(w, (BLOCK_R, BLOCK_K)))


@triton.jit
def w4_step(a, q_ptr, s_ptr, cols, col_ok, k0, k_len, stride_qn, stride_sn, acc, BLOCK_N: tl.constexpr,
            BLOCK_K: tl.constexpr, GROUP: tl.constexpr, E8M0: tl.constexpr, PRECISION: tl.constexpr,
            EVEN_K: tl.constexpr):
    """``acc + a . w[cols]^T`` for the K tile at k0 (``a`` the activations' tile, ``[M, BLOCK_K]``),
    the weight in the activations' dtype, as the dot takes it; on bf16 pairs (``w4_unscaled``) the
    sum of weights times 2^-9."""
    if BF16_PAIRS and not E8M0 and a.dtype == tl.bfloat16:
        w = pair_dequant_tile(q_ptr, s_ptr, cols, col_ok, k0, k_len, stride_qn, stride_sn, BLOCK_N, BLOCK_K, GROUP,
                              EVEN_K)
    else:
        w = dequant_tile(q_ptr, s_ptr, cols, col_ok, k0, k_len, stride_qn, stride_sn, BLOCK_N, BLOCK_K, GROUP, E8M0,
                         EVEN_K).to(a.dtype)
    return tl.dot(a, w, acc, input_precision=PRECISION)


@triton.jit
def w4_unscaled(acc, a_ptrs, E8M0: tl.constexpr):
    """``w4_step``'s sums over rows ``a_ptrs`` as the weights' own: times 2^9 where they ran on bf16 pairs."""
    if BF16_PAIRS and not E8M0 and a_ptrs.dtype.element_ty == tl.bfloat16:
        acc = acc * PAIR_UNSCALE
    return acc


@triton.jit
def a_tile(a_ptrs, row_ok, k0, k_len, stride_k, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr):
    """Activations ``[M, BLOCK_K]`` at k0 (``a_ptrs [M]`` the rows' starts; rows not ``row_ok``
    and k past ``k_len`` read as 0; EVEN_K: no k past it, no mask along k)."""
    ks = k0 + tl.arange(0, BLOCK_K)
    k_ok = (ks >= 0) if EVEN_K else (ks < k_len)
    return tl.load(a_ptrs[:, None] + ks[None, :] * stride_k, mask=row_ok[:, None] & k_ok[None, :], other=0.0)


@triton.jit
def w4_dot(a_ptrs, row_ok, q_ptr, s_ptr, cols, col_ok, k_len, stride_ak, stride_qn, stride_sn,
           BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP: tl.constexpr,
           E8M0: tl.constexpr, PRECISION: tl.constexpr, EVEN_K: tl.constexpr):
    """``a . w[cols]^T`` ``[M, N]`` in fp32 over all of K, rows ``a_ptrs [M]``, one slot's weight."""
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for k0 in range(0, k_len, BLOCK_K):
        a = a_tile(a_ptrs, row_ok, k0, k_len, stride_ak, BLOCK_K, EVEN_K)
        acc = w4_step(a, q_ptr, s_ptr, cols, col_ok, k0, k_len, stride_qn, stride_sn, acc, BLOCK_N, BLOCK_K, GROUP,
                      E8M0, PRECISION, EVEN_K)
    return w4_unscaled(acc, a_ptrs, E8M0)


@triton.jit
def channel_scaled(acc, c_ptr, cols, col_ok, CHANNEL: tl.constexpr):
    """``acc`` times the slot's channel scales (``c_ptr`` at the slot) of ``cols``, if it has them."""
    if CHANNEL:
        acc = acc * tl.load(c_ptr + cols, mask=col_ok, other=0.0)
    return acc


@triton.jit
def bias_rows(b_ptr, ids_ptr, pairs, pair_ok, cols, col_ok, num_bias, stride_b, BIAS: tl.constexpr):
    """fp32 ``bias[bias_ids[pair], cols]`` for ``pairs`` (one pair, or any shape broadcasting
    against ``cols``), zero without biases, for pairs not ``pair_ok`` and for ids outside
    ``[0, num_bias)``."""
    bias = 0.0
    if BIAS:
        ids = tl.load(ids_ptr + pairs, mask=pair_ok, other=-1).to(tl.int64)
        # broadcast before combining masks: the interpreter mistypes a 0-d bool & a block bool
        ids = tl.where(pair_ok, ids, -1) + tl.zeros_like(cols).to(tl.int64)
        ok = (ids >= 0) & (ids < num_bias) & col_ok
        bias = tl.load(b_ptr + ids * stride_b + cols, mask=ok, other=0.0).to(tl.float32)
    return bias


@triton.jit
def activate(gate, up, GPT_OSS: tl.constexpr, LIMIT: tl.constexpr, ALPHA: tl.constexpr):
    """``silu(gate) * up``, or gpt-oss's clamped ``min(gate, L) * sigmoid(A min(gate, L)) * (clamp(up) + 1)``."""
    if GPT_OSS:
        gate = tl.minimum(gate, LIMIT)
        up = tl.minimum(tl.maximum(up, -LIMIT), LIMIT)
        return gate * tl.sigmoid(ALPHA * gate) * (up + 1.0)
    return gate * tl.sigmoid(gate) * up


@triton.jit
def biased_activation(gate, up, b13_ptr, ids_ptr, pairs, pair_ok, cols, col_ok, num_bias, inter, BIAS: tl.constexpr,
                      GPT_OSS: tl.constexpr, LIMIT: tl.constexpr, ALPHA: tl.constexpr):
    """A float gate_up's epilogue: with BIAS, each dot plus its bias row at the pair's expert id
    (``b13 [E, 2I]``, the up half from column I), then ``activate``."""
    if BIAS:
        gate += bias_rows(b13_ptr, ids_ptr, pairs, pair_ok, cols, col_ok, num_bias, 2 * inter, BIAS)
        up += bias_rows(b13_ptr + inter, ids_ptr, pairs, pair_ok, cols, col_ok, num_bias, 2 * inter, BIAS)
    return activate(gate, up, GPT_OSS, LIMIT, ALPHA)


@triton.jit
def swiglu_w4_rows(a_ptrs, row_ok, bias_pair, q_ptr, s_ptr, c_ptr, b_ptr, ids_ptr, cols, col_ok, hidden, inter,
                   num_bias, stride_ak, stride_qn, stride_sn, stride_b, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_K: tl.constexpr, GROUP: tl.constexpr, E8M0: tl.constexpr, CHANNEL: tl.constexpr,
                   BIAS: tl.constexpr, GPT_OSS: tl.constexpr, LIMIT: tl.constexpr, ALPHA: tl.constexpr,
                   PRECISION: tl.constexpr, EVEN_K: tl.constexpr):
    """act ``[M, N]`` (fp32) of rows ``a_ptrs [M]`` and gate/up columns ``cols`` of one slot's w13
    (pointers at the slot; up row n is row ``I + n``, its scales likewise); the bias row is
    ``bias_pair``'s, one of the slot's pairs (a slot holds one expert: its pairs share a bias id)."""
    gate = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    up = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for k0 in range(0, hidden, BLOCK_K):  # one read of the activations for both halves
        a = a_tile(a_ptrs, row_ok, k0, hidden, stride_ak, BLOCK_K, EVEN_K)
        gate = w4_step(a, q_ptr, s_ptr, cols, col_ok, k0, hidden, stride_qn, stride_sn, gate, BLOCK_N, BLOCK_K,
                       GROUP, E8M0, PRECISION, EVEN_K)
        up = w4_step(a, q_ptr, s_ptr, inter + cols, col_ok, k0, hidden, stride_qn, stride_sn, up, BLOCK_N, BLOCK_K,
                     GROUP, E8M0, PRECISION, EVEN_K)
    gate = channel_scaled(w4_unscaled(gate, a_ptrs, E8M0), c_ptr, cols[None, :], col_ok[None, :], CHANNEL)
    up = channel_scaled(w4_unscaled(up, a_ptrs, E8M0), c_ptr, inter + cols[None, :], col_ok[None, :], CHANNEL)
    gate += bias_rows(b_ptr, ids_ptr, bias_pair, bias_pair >= 0, cols[None, :], col_ok[None, :], num_bias, stride_b,
                      BIAS)
    up += bias_rows(b_ptr, ids_ptr, bias_pair, bias_pair >= 0, inter + cols[None, :], col_ok[None, :], num_bias,
                    stride_b, BIAS)
    return activate(gate, up, GPT_OSS, LIMIT, ALPHA)


@triton.jit
def store_down_w4_rows(out_ptr, weights_ptr, pairs, a_ptrs, row_ok, bias_pair, q_ptr, s_ptr, c_ptr, b_ptr, ids_ptr,
                       cols, col_ok, hidden, inter, num_bias, stride_qn, stride_sn, stride_b, BLOCK_M: tl.constexpr,
                       BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP: tl.constexpr, E8M0: tl.constexpr,
                       CHANNEL: tl.constexpr, BIAS: tl.constexpr, PRECISION: tl.constexpr, EVEN_K: tl.constexpr):
    """``out[pairs, cols] = weight[pairs] * (act . w2[cols]^T + bias)`` for act rows ``a_ptrs [M]``
    (``row_ok`` the live ones) and one slot's w2 (pointers at the slot), its channel scales
    applied, the bias row ``bias_pair``'s (a slot holds one expert: its pairs share a bias id)."""
    acc = w4_dot(a_ptrs, row_ok, q_ptr, s_ptr, cols, col_ok, inter, 1, stride_qn, stride_sn, BLOCK_M, BLOCK_N,
                 BLOCK_K, GROUP, E8M0, PRECISION, EVEN_K)
    acc = channel_scaled(acc, c_ptr, cols[None, :], col_ok[None, :], CHANNEL)
    acc += bias_rows(b_ptr, ids_ptr, bias_pair, bias_pair >= 0, cols[None, :], col_ok[None, :], num_bias, stride_b,
                     BIAS)
    store_weighted(out_ptr, acc, weights_ptr, pairs, row_ok, cols, col_ok, hidden)
