"""The synthetic router (``moe_offload.synthetic_routing``) in one launch for all its layers at once.

Eagerly a route is 51 small launches on a GPU (nine hashes, the masks and shifts between them, two
``searchsorted``, two ``topk``, two ``scatter_reduce``, a gather, the weights' sum and division) and
a guess 18, as ``tests/launch_count.py`` counts them; in a captured decode step each is a gap between
the step's real kernels. Here a program routes ``BLOCK_T`` tokens of one layer in registers:

```
 grid (T / BLOCK_T, layers)   program (b, l): tokens b * BLOCK_T ... of layer l
 lanes    [BT, W]   phase, epoch and lane hash -> expert (bisection of the layer's integer CDF)
 picks    [BT, W]   (hash << 8 | lane) << 10 | expert; k rounds of max take the picked lanes best
                    first, each round also that rank's fresh draw, and raise both experts' scores
 scores   [BT, E]   k rounds of max over score | expert: the ids, best first
 weights  [BT, k]   integer raws, their exact float32 sum, a correctly rounded division
```

The hashes are uint32 arithmetic, which wraps where the twin's int64 masks cut; int64 keys enter
through their low 32 bits, which is all the twin's masks keep. A popularity draw bisects the CDF
row for the count of entries at or below it (``searchsorted(right=True)`` of a sorted row). Ids
equal the twin's bit for bit, and so do the weights: their raws are integers whose sum is exact in
float32 in any order, and both sides divide with IEEE rounding (``div_rn`` here).
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from moe_offload.kernels.triton_support import next_pow2

TILE = 1024  # at most this many elements in a program's widest tile, [BLOCK_T, BLOCK_E or BLOCK_W]; not tuned
EXPERT_BITS = 10  # an expert id fits in the low bits of a score (at most 1024 experts)


@triton.jit
def _mix32(x):
    """``moe_offload.synthetic_routing.mix32``'s hash of int64 or uint32 values, as uint32."""
    h = (x ^ (x >> 16)).to(tl.uint32)
    h = h * tl.full(h.shape, 0x7FEB352D, tl.uint32)
    h = h ^ (h >> 15)
    h = h * tl.full(h.shape, 0x68E31DA5, tl.uint32)
    return h ^ (h >> 16)


@triton.jit
def _token_hashes(seq_ptr, pos_ptr, tok_ptr, t, live, seed_h):
    """Each token's sequence hash and token hash (uint32) and its position (int64), ``[BT]``. The
    launch types ``seed_h`` i32 or i64 by its value; either way the xor holds the 32-bit value."""
    pos = tl.load(pos_ptr + t, mask=live, other=0).to(tl.int64)
    seq = _mix32(tl.load(seq_ptr + t, mask=live, other=0).to(tl.uint32) ^ seed_h)
    tok = _mix32(_mix32(seq ^ pos.to(tl.uint32)) ^ tl.load(tok_ptr + t, mask=live, other=0).to(tl.uint32))
    return seq, tok, pos


@triton.jit
def _draw(cdf_row, hashed, E: tl.constexpr, DRAW_MASK: tl.constexpr, STEPS: tl.constexpr):
    """Experts drawn by popularity from 32-bit hashes: how many of the row's ``E`` CDF entries are
    at or below each draw, at most ``E - 1`` (``2^STEPS > E``)."""
    draw = (hashed & DRAW_MASK).to(tl.int32)
    n = tl.zeros(draw.shape, tl.int32)
    for i in tl.static_range(STEPS):
        probe = n + (1 << (STEPS - 1 - i))
        inside = probe <= E
        entry = tl.load(cdf_row + probe - 1, mask=inside, other=0)
        n = tl.where(inside & (entry <= draw), probe, n)
    return tl.minimum(n, E - 1)


# the token count follows the batch, and the positions and token ids are views into the batch's
# packed index buffer at offsets that follow it: neither is specialised
@triton.jit(do_not_specialize=["tokens"], do_not_specialize_on_alignment=["seq_ptr", "pos_ptr", "tok_ptr"])
def _route_kernel(seq_ptr, pos_ptr, tok_ptr, cdf_ptr, phase_ptr, lane_ptr, pick_ptr, fresh_ptr, weight_ptr,
                  weights_ptr, ids_ptr, tokens, layer_start, layer_step, seed_h,
                  E: tl.constexpr, W: tl.constexpr, K: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr,
                  BLOCK_W: tl.constexpr, BLOCK_K: tl.constexpr, STEPS: tl.constexpr, DRAW_MASK: tl.constexpr,
                  PERIOD_SHIFT: tl.constexpr, WEIGHT_BITS: tl.constexpr, EXPERT_BITS: tl.constexpr):
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    live = t < tokens
    layer = layer_start + tl.program_id(1) * layer_step
    rows = (tl.program_id(1).to(tl.int64) * tokens + t) * K  # each token's first output
    seq, tok, pos = _token_hashes(seq_ptr, pos_ptr, tok_ptr, t, live, seed_h)
    cdf_row = cdf_ptr + layer * E

    # each lane's expert at each token, under its pick: the twin's (hash << 8 | lane), unique per lane
    # (the rounds have no ties), then the expert in the low bits, where a round reads it
    w = tl.arange(0, BLOCK_W)
    lane_ok = w < W
    phase_c = tl.load(phase_ptr + layer * W + w, mask=lane_ok, other=0).to(tl.uint32)
    lane_c = tl.load(lane_ptr + layer * W + w, mask=lane_ok, other=0).to(tl.uint32)
    pick_c = tl.load(pick_ptr + layer * W + w, mask=lane_ok, other=0).to(tl.uint32)
    phase = _mix32(seq[:, None] ^ phase_c[None, :]) & ((1 << PERIOD_SHIFT) - 1)
    epoch = (pos[:, None] + phase.to(tl.int64)) >> PERIOD_SHIFT  # floor division, as the twin's //
    lane_hash = _mix32(_mix32(seq[:, None] ^ lane_c[None, :]) ^ epoch.to(tl.uint32))
    lane_experts = _draw(cdf_row, lane_hash, E, DRAW_MASK, STEPS)
    pick = (((_mix32(tok[:, None] ^ pick_c[None, :]).to(tl.int64) << 8) | w[None, :]) << EXPERT_BITS) | lane_experts
    pick = tl.where(lane_ok[None, :], pick, -1)

    r = tl.arange(0, BLOCK_K)
    rank_ok = r < K
    fresh_c = tl.load(fresh_ptr + layer * K + r, mask=rank_ok, other=0).to(tl.uint32)
    fresh = _draw(cdf_row, _mix32(tok[:, None] ^ fresh_c[None, :]), E, DRAW_MASK, STEPS)

    # rank j scores its picked lane's expert (2 << 20) and its fresh draw (1 << 20), plus (k - j) << 10:
    # the twin's scatter amax
    e = tl.arange(0, BLOCK_E)
    score = tl.zeros([BLOCK_T, BLOCK_E], tl.int32)
    for j in range(K):
        best = tl.max(pick, axis=1)
        pick = tl.where(pick == best[:, None], -1, pick)
        chosen = (best & ((1 << EXPERT_BITS) - 1)).to(tl.int32)
        drawn = tl.max(tl.where(r[None, :] == j, fresh, -1), axis=1)
        order = (K - j) << EXPERT_BITS
        score = tl.maximum(score, tl.where(e[None, :] == chosen[:, None], (2 << 20) | order, 0))
        score = tl.maximum(score, tl.where(e[None, :] == drawn[:, None], (1 << 20) | order, 0))

    keyed = tl.where(e[None, :] < E, score | e[None, :], -1)  # unique per expert: no ties either
    for j in range(K):
        best = tl.max(keyed, axis=1)
        tl.store(ids_ptr + rows + j, (best & ((1 << EXPERT_BITS) - 1)).to(tl.int64), mask=live)
        keyed = tl.where(keyed == best[:, None], -1, keyed)

    weight_c = tl.load(weight_ptr + layer * K + r, mask=rank_ok, other=0).to(tl.uint32)
    raw = ((_mix32(tok[:, None] ^ weight_c[None, :]) >> (32 - WEIGHT_BITS)) | (1 << WEIGHT_BITS)).to(tl.float32)
    raw = tl.where(rank_ok[None, :], raw, 0.0)
    out = rows[:, None] + r[None, :]
    tl.store(weights_ptr + out, tl.math.div_rn(raw, tl.sum(raw, axis=1)[:, None]),
             mask=live[:, None] & rank_ok[None, :])


@triton.jit(do_not_specialize=["tokens"],
            do_not_specialize_on_alignment=["seq_ptr", "pos_ptr", "tok_ptr", "ids_ptr"])
def _guess_kernel(seq_ptr, pos_ptr, tok_ptr, cdf_ptr, guess_ptr, ids_ptr, out_ptr, tokens, layer_start, layer_step,
                  seed_h, E: tl.constexpr, K: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr,
                  STEPS: tl.constexpr, DRAW_MASK: tl.constexpr, KEEP_MASK: tl.constexpr, KEEP_BELOW: tl.constexpr):
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    live = t < tokens
    layer = layer_start + tl.program_id(1) * layer_step
    rows = (tl.program_id(1).to(tl.int64) * tokens + t) * K
    _, tok, _ = _token_hashes(seq_ptr, pos_ptr, tok_ptr, t, live, seed_h)
    r = tl.arange(0, BLOCK_K)
    rank_ok = r < K
    guess_c = tl.load(guess_ptr + layer * K + r, mask=rank_ok, other=0).to(tl.uint32)
    hashed = _mix32(tok[:, None] ^ guess_c[None, :])
    drawn = _draw(cdf_ptr + layer * E, _mix32(hashed), E, DRAW_MASK, STEPS)
    out = rows[:, None] + r[None, :]
    mask = live[:, None] & rank_ok[None, :]
    ids = tl.load(ids_ptr + out, mask=mask, other=0).to(tl.int64)
    tl.store(out_ptr + out, tl.where((hashed & KEEP_MASK) < KEEP_BELOW, ids, drawn.to(tl.int64)), mask=mask)


def route(keys: Sequence[torch.Tensor], layers: range, cdf: torch.Tensor, lane_consts: Sequence[torch.Tensor],
          rank_consts: Sequence[torch.Tensor], seed_h: int, *, period: int, draw_bits: int,
          weight_bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``SyntheticRouter.route_eager``'s float32 weights and int64 ids ``[len(layers), T, k]`` for
    ``keys`` (sequence, position, token ``[T]``), the CDF rows ``cdf [L, E]``, the lanes' phase,
    lane and pick constants ``[L, W]`` and the ranks' fresh and weight constants ``[L, k]``."""
    (phase, lane, pick), (fresh, weight) = lane_consts, rank_consts
    experts, lanes, top_k = cdf.shape[1], phase.shape[1], fresh.shape[1]
    if period & (period - 1) or experts > 1 << EXPERT_BITS or top_k > lanes:
        raise ValueError(f"the route kernel needs a power-of-two period, at most {1 << EXPERT_BITS} experts and "
                         f"top_k <= lanes (as the twin's topk does); got period {period}, {experts} experts, "
                         f"top {top_k} of {lanes} lanes")
    sequence, positions, tokens = (k.contiguous() for k in keys)
    weights = torch.empty(len(layers), sequence.numel(), top_k, dtype=torch.float32, device=sequence.device)
    ids = torch.empty(weights.shape, dtype=torch.int64, device=sequence.device)
    if weights.numel():
        block_e, block_w = next_pow2(experts), next_pow2(lanes)
        grid, block_t, warps = _geometry(sequence.numel(), len(layers), max(block_e, block_w))
        _route_kernel[grid](sequence, positions, tokens, cdf, phase, lane, pick, fresh, weight, weights, ids,
                            sequence.numel(), layers.start, layers.step, seed_h, E=experts, W=lanes, K=top_k,
                            BLOCK_T=block_t, BLOCK_E=block_e, BLOCK_W=block_w, BLOCK_K=next_pow2(top_k),
                            STEPS=experts.bit_length(), DRAW_MASK=(1 << draw_bits) - 1,
                            PERIOD_SHIFT=period.bit_length() - 1, WEIGHT_BITS=weight_bits,
                            EXPERT_BITS=EXPERT_BITS, num_warps=warps)
    return weights, ids


def guess(keys: Sequence[torch.Tensor], layers: range, cdf: torch.Tensor, guess_consts: torch.Tensor,
          ids: torch.Tensor, seed_h: int, *, draw_bits: int, keep_bits: int, keep_below: int) -> torch.Tensor:
    """``SyntheticRouter.guess_eager``'s guess ``[len(layers), T, k]`` int64 of ``ids``, from the
    ranks' guess constants ``guess_consts [L, k]``."""
    experts, top_k = cdf.shape[1], guess_consts.shape[1]
    sequence, positions, tokens = (k.contiguous() for k in keys)
    ids = ids.contiguous()
    out = torch.empty(len(layers), sequence.numel(), top_k, dtype=torch.int64, device=sequence.device)
    if out.numel():
        grid, block_t, warps = _geometry(sequence.numel(), len(layers), next_pow2(top_k))
        _guess_kernel[grid](sequence, positions, tokens, cdf, guess_consts, ids, out, sequence.numel(), layers.start,
                            layers.step, seed_h, E=experts, K=top_k, BLOCK_T=block_t, BLOCK_K=next_pow2(top_k),
                            STEPS=experts.bit_length(), DRAW_MASK=(1 << draw_bits) - 1,
                            KEEP_MASK=(1 << keep_bits) - 1, KEEP_BELOW=keep_below, num_warps=warps)
    return out


def _geometry(tokens: int, layers: int, width: int) -> tuple[tuple[int, int], int, int]:
    """Grid, tokens per program and warps: up to ``TILE`` elements of ``width``-wide rows a program,
    one warp per 256 of them (at most four)."""
    block_t = min(next_pow2(tokens), max(1, TILE // width))
    return (triton.cdiv(tokens, block_t), layers), block_t, max(1, min(4, block_t * width // 256))
