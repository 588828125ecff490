"""Triton kernels of the depthwise causal conv (``conv.py`` holds the public ops and eager twins).

Three launches, each over a grid fixed by shapes and host ints, reading lengths and slots on the
device:

```
 varlen conv   grid (B, token blocks of the longest sequence, channel blocks)
               tap j of token t reads input t-(K-1)+j: from x when >= 0, else from state[slot]
 state update  grid (B, channel blocks), after the conv on the same stream (the conv reads the old
               state): state[slot][:, i] = input L-(K-1)+i, from x or from the old state
 step          grid (B, channel blocks): one token, its output and the shifted state in one launch
```

Both state writers go column by column in increasing order: new column i takes old column i+n
(n >= 1 new tokens), which no earlier column has overwritten, and every column is a vector over
the same channels in the same layout, so one thread reads and later writes each element.
A slot outside ``[0, S)`` reads zeros and writes nothing (raw pointers do not clamp).

Imports triton: ``conv.py`` imports this module on first use only.
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _tap(x_ptr, state, bos, p, c, ok, ok_state, x_stride, K: tl.constexpr):
    """Input position ``p`` of a sequence: x[bos + p] when p >= 0, else state column K-1+p."""
    xv = tl.load(x_ptr + (bos + p) * x_stride + c, mask=ok & (p >= 0), other=0.0)
    sv = tl.load(state + c * (K - 1) + (K - 1 + p), mask=ok_state & (p < 0), other=0.0)
    return xv.to(tl.float32) + sv.to(tl.float32)


@triton.jit
def _in_state(c, C, slot, S):
    """Channels of a valid slot's state (as one comparison: the interpreter rejects masks that
    combine a scalar condition with a vector)."""
    return c < tl.where((slot >= 0) & (slot < S), C, 0)


# slots and sequence starts are views into the batch's packed index buffer, at offsets that follow
# the token count: not specialised on alignment
@triton.jit(do_not_specialize_on_alignment=["slots_ptr", "cu_ptr"])
def varlen_conv(x_ptr, w_ptr, state_ptr, slots_ptr, cu_ptr, out_ptr, C, S, x_stride, out_stride,
                K: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr):
    b = tl.program_id(0)
    bos = tl.load(cu_ptr + b).to(tl.int64)
    length = tl.load(cu_ptr + b + 1).to(tl.int64) - bos
    t = tl.program_id(1) * BT + tl.arange(0, BT)
    c = tl.program_id(2) * BC + tl.arange(0, BC)
    in_t, in_c = t < length, c < C
    slot = tl.load(slots_ptr + b).to(tl.int64)
    state = state_ptr + slot * C * (K - 1)
    ok = in_t[:, None] & in_c[None, :]
    ok_state = in_t[:, None] & _in_state(c, C, slot, S)[None, :]
    acc = tl.zeros([BT, BC], dtype=tl.float32)
    for j in tl.static_range(K):
        p = t - (K - 1) + j  # input position of tap j, negative inside the state
        col = _tap(x_ptr, state, bos, p[:, None], c[None, :], ok, ok_state, x_stride, K)
        w = tl.load(w_ptr + c * K + j, mask=in_c, other=0.0).to(tl.float32)
        acc += col * w[None, :]
    y = acc * tl.sigmoid(acc)
    tl.store(out_ptr + (bos + t)[:, None] * out_stride + c[None, :], y.to(out_ptr.dtype.element_ty),
             mask=in_t[:, None] & in_c[None, :])


@triton.jit(do_not_specialize_on_alignment=["slots_ptr", "cu_ptr"])
def state_update(x_ptr, state_ptr, slots_ptr, cu_ptr, C, S, x_stride, K: tl.constexpr, BC: tl.constexpr):
    b = tl.program_id(0)
    bos = tl.load(cu_ptr + b).to(tl.int64)
    length = tl.load(cu_ptr + b + 1).to(tl.int64) - bos
    c = tl.program_id(1) * BC + tl.arange(0, BC)
    in_c = c < C
    slot = tl.load(slots_ptr + b).to(tl.int64)
    ok = _in_state(c, C, slot, S)
    state = state_ptr + slot * C * (K - 1)
    for i in tl.static_range(K - 1):
        p = tl.zeros_like(c) + (length - (K - 1) + i)  # the input that becomes column i, as a vector for the masks
        v = _tap(x_ptr, state, bos, p, c, in_c, ok, x_stride, K)
        tl.store(state + c * (K - 1) + i, v.to(state_ptr.dtype.element_ty), mask=ok)


@triton.jit(do_not_specialize_on_alignment=["slots_ptr"])
def step(x_ptr, w_ptr, state_ptr, slots_ptr, out_ptr, C, S, x_stride, out_stride,
         K: tl.constexpr, BC: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BC + tl.arange(0, BC)
    in_c = c < C
    slot = tl.load(slots_ptr + b).to(tl.int64)
    ok = _in_state(c, C, slot, S)
    state = state_ptr + slot * C * (K - 1) + c * (K - 1)
    x = tl.load(x_ptr + b * x_stride + c, mask=in_c, other=0.0)
    acc = x.to(tl.float32) * tl.load(w_ptr + c * K + K - 1, mask=in_c, other=0.0).to(tl.float32)
    for j in tl.static_range(K - 1):
        s = tl.load(state + j, mask=ok, other=0.0).to(tl.float32)
        acc += s * tl.load(w_ptr + c * K + j, mask=in_c, other=0.0).to(tl.float32)
    tl.store(out_ptr + b * out_stride + c, (acc * tl.sigmoid(acc)).to(out_ptr.dtype.element_ty), mask=in_c)
    for i in tl.static_range(K - 2):
        tl.store(state + i, tl.load(state + i + 1, mask=ok), mask=ok)
    tl.store(state + K - 2, x.to(state_ptr.dtype.element_ty), mask=ok)
