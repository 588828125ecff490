"""Triton kernel of the decode step of the gated delta rule, updating ``state[slot]`` in place.

fla's recurrent kernel takes a dense state with no slot indices, which costs a gather and a
scatter of the whole state each step; this one reads and writes the pool where it lies. Grid
``(value blocks, B * Hv)``: a program holds ``state[slot, h, :, block]`` (float32, Dk x BLOCK_V) in
registers, normalises its q and k (recomputed per block: Dk elements), applies the update and
writes the output block and the state block back. Programs touch disjoint state blocks as long
as the slots are distinct; a slot outside ``[0, S)`` reads a zero state and writes nothing.

Imports triton: ``gated_delta.py`` imports this module on first use only.
"""
from __future__ import annotations

import triton
import triton.language as tl

MAX_BLOCK_V = 32  # value columns per program (H200, Dk=Dv=128: 32 with 2 warps beat 8, 16 and 64)


# the slots are a view into the batch's packed index buffer: not specialised on alignment
@triton.jit(do_not_specialize_on_alignment=["slots_ptr"])
def gated_delta_step_kernel(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, state_ptr, slots_ptr, o_ptr,
                            q_stride, k_stride, v_stride, S, scale, eps,
                            HK: tl.constexpr, HV: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
                            BK: tl.constexpr, BV: tl.constexpr):
    bh = tl.program_id(1).to(tl.int64)
    b, h = bh // HV, bh % HV
    hk = h // (HV // HK)
    dk = tl.arange(0, BK)
    dv = tl.program_id(0) * BV + tl.arange(0, BV)
    in_k, in_v = dk < DK, dv < DV
    q = tl.load(q_ptr + b * q_stride + hk * DK + dk, mask=in_k, other=0.0).to(tl.float32)
    k = tl.load(k_ptr + b * k_stride + hk * DK + dk, mask=in_k, other=0.0).to(tl.float32)
    q = q * (scale / tl.sqrt(tl.sum(q * q) + eps))
    k = k / tl.sqrt(tl.sum(k * k) + eps)
    v = tl.load(v_ptr + b * v_stride + h * DV + dv, mask=in_v, other=0.0).to(tl.float32)
    decay = tl.exp(tl.load(g_ptr + bh).to(tl.float32))
    beta = tl.load(beta_ptr + bh).to(tl.float32)
    slot = tl.load(slots_ptr + b).to(tl.int64)
    # one comparison for the slot's validity: the interpreter rejects a scalar condition in a mask
    ok = (dk < tl.where((slot >= 0) & (slot < S), DK, 0))[:, None] & in_v[None, :]
    at = state_ptr + ((slot * HV + h) * DK + dk[:, None]) * DV + dv[None, :]
    s = tl.load(at, mask=ok, other=0.0) * decay
    delta = (v - tl.sum(s * k[:, None], 0)) * beta
    s += k[:, None] * delta[None, :]
    tl.store(o_ptr + bh * DV + dv, tl.sum(s * q[:, None], 0).to(o_ptr.dtype.element_ty), mask=in_v)
    tl.store(at, s, mask=ok)
