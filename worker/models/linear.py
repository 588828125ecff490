"""``x @ w.T`` for one row of ``x``: the dense projections (qkv, o, the router) of a batch-1 decode
step, the qkv one with the residual add and RMSNorm before it folded in, and a shared expert's
down projection with its SwiGLU before it and its sigmoid gate and the MoE's sum after it.

At one row a projection is a matrix-vector product bound by reading ``w``; in a qwen3-30b decode
step on the H200 (``scripts/bench_decode.py --top-kernels``) cuBLAS's kernels for it reached about
0.45 (o: split-K plus a reduce launch) and 0.65 (qkv) of the HBM bandwidth. This
kernel gives each program ``BLOCK_N`` rows of ``w`` and unrolls the whole reduction at compile time
(``K`` is a constexpr), so every weight load of a program is issued before the first multiply-add
needs it; float32 products accumulate in a ``[BLOCK_K, BLOCK_N]`` tile summed once at the end:

```
 grid (N / BLOCK_N)    program p: out[p*BN : (p+1)*BN] = sum over K/BLOCK_K steps of x[ks] * w[rows, ks]
 with the norm         every program first reads the whole row (x + residual, from L2) for its
                       1/rms, then normalises each x[ks] slice as it goes; program 0 stores x + residual
```

Under programmatic dependent launch (``triton_support.pdl_args``), when ``K`` is a power of two,
a program loads its whole ``[K, BLOCK_N]`` tile in one go before it waits for the kernel before it:
the weights stream while that kernel finishes, and only the input row waits.

A bias (gpt-oss's q/k/v, o and router) is added to the float32 sum in the same launch, where it was
an elementwise launch of its own after each projection.

The norm's launch (about 2 us of a 60 us layer) is worth more than its arithmetic, which every
program repeats on a 2k-element row. The same goes for the shared expert's glue (Qwen3-Next,
Qwen3.5): ``silu(gate) * up`` before its down projection and ``moe + sigmoid(logit) * out`` after
were five launches a layer around it, and are now read and written by the down's own programs
(``swiglu_linear_gated_add``). Numerics follow ``worker.models.norm``: the sum rounded to the
input dtype, normalised in float32, rounded, times the weight, rounded again.

``linear`` and ``add_rms_norm_linear`` take the kernel for one row of a 16-bit dtype on CUDA whose
``K`` a power-of-two step of at least 16 divides; everything else takes the twins
(``torch.nn.functional.linear`` after ``worker.models.norm``'s ops).
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import torch.nn.functional as F

from moe_offload.kernels.triton_support import next_pow2, pdl_args, use_triton
from worker.models.norm import add_rms_norm, rms_norm

BLOCK_N = 8  # rows of w per program: 256 programs for a 2048-row projection
MAX_BLOCK_K = 1024
# Whether a program loads its whole weight tile at once (``K`` a power of two): None, under PDL
# (the loads go before the wait); the tests force either.
WHOLE_TILE: bool | None = None


def linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None, *,
           backend: str | None = None) -> torch.Tensor:
    """``F.linear(x, w, bias)`` for ``x [..., K]``, ``w [N, K]`` and ``bias [N]`` (the sum rounded
    once, as torch's); one row of bfloat16 or float16 runs the kernel on CUDA (or with
    ``backend="triton"``), anything else the twin."""
    if not _fits(x, w, bias) or not use_triton(x, backend):
        return F.linear(x, w, bias)
    return _launch(x, None, None, 0.0, w, bias)[0]


def add_rms_norm_linear(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
                        w: torch.Tensor, bias: torch.Tensor | None = None, *,
                        backend: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(linear(rms_norm(s) * norm_weight, w, bias), s)`` with ``s = x + residual`` (``x`` itself
    when ``residual`` is None): a pre-norm block's residual step and its first projection."""
    fused = (_fits(x, w, bias) and use_triton(x, backend) and norm_weight.shape == x.shape[-1:]
             and norm_weight.dtype == x.dtype and norm_weight.is_contiguous()
             and (residual is None or (residual.shape == x.shape and residual.dtype == x.dtype)))
    if not fused:
        if residual is None:
            normed, summed = rms_norm(x, norm_weight, eps, backend=backend), x
        else:
            normed, summed = add_rms_norm(x, residual, norm_weight, eps, backend=backend)
        return linear(normed, w, bias, backend=backend), summed
    return _launch(x, residual, norm_weight, eps, w, bias)


def swiglu_linear_gated_add(x: torch.Tensor, w: torch.Tensor, add: torch.Tensor, *,
                            backend: str | None = None) -> torch.Tensor:
    """``add + sigmoid(logit) * linear(silu(gate) * up, w)`` for ``x = [gate | up | logit]``
    ``[..., 2K + 1]``, ``w [N, K]`` and ``add [..., N]``: a shared expert's down projection with its
    activation, its gate and the routed experts' sum. One row of a 16-bit dtype takes the kernel
    (each rounding where the twin rounds), anything else the twin."""
    k = w.shape[1]
    gate, up, logit = x.split([k, k, 1], dim=-1)
    fused = (x.numel() == 2 * k + 1 and x.is_contiguous() and _fits(gate, w) and use_triton(x, backend)
             and add.shape == (*x.shape[:-1], w.shape[0]) and add.dtype == x.dtype)
    if not fused:
        return add + torch.sigmoid(logit) * F.linear(F.silu(gate) * up, w)
    return _launch(x, add.contiguous(), None, 0.0, w, gated=True)[0]


def block_k(k: int) -> int:
    """The largest power of two up to MAX_BLOCK_K that divides ``k`` (0: none of at least 16)."""
    step = MAX_BLOCK_K
    while step >= 16 and k % step:
        step //= 2
    return step if step >= 16 else 0


class GemvTiles(NamedTuple):
    """A launch's reduction step (a power of two of at least 16; a ``K`` it does not divide is read
    in masked steps) and warps."""

    block_k: int
    warps: int


# Forced tiles for every launch (``scripts/bench_linear.py`` sweeps them; the tests force a masked step)
TILES: GemvTiles | None = None


def gemv_tiles(k: int) -> GemvTiles:
    """The largest power-of-two step up to 1024 that divides ``k``; where that is under 256, steps of
    up to 1024 with a masked tail instead (``scripts/bench_linear.py --sweep``, H200: gpt-oss's qkv,
    K = 2880, 45 steps of 64 13.4 us, 3 of 1024 10.5 us; its router 3.1 -> 1.7 us)."""
    if TILES is not None:
        return TILES
    step = block_k(k)
    if step < 256:
        step = min(MAX_BLOCK_K, next_pow2(k))
    return GemvTiles(step, 16 if k >= 4096 else 4)


def _fits(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> bool:
    """One row, 16-bit floats of one dtype, ``w`` rows contiguous and not empty, ``K`` a multiple of
    16, a bias (if any) a contiguous ``[N]`` of that dtype."""
    return (x.numel() == x.shape[-1] and x.dtype in (torch.bfloat16, torch.float16) and w.dtype == x.dtype
            and w.dim() == 2 and w.shape[1] == x.shape[-1] and w.stride(1) == 1 and w.device == x.device
            and w.numel() > 0 and block_k(w.shape[1]) > 0
            and (bias is None or (bias.shape == w.shape[:1] and bias.dtype == x.dtype and bias.is_contiguous()
                                  and bias.device == x.device)))


def _launch(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor | None, eps: float,
            w: torch.Tensor, bias: torch.Tensor | None = None,
            gated: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``gated``: ``x`` is ``[gate | up | logit]`` and ``residual`` the sum added after the gate
    (no bias then)."""
    n, k = w.shape
    pdl = pdl_args(x)
    whole = k == next_pow2(k) and (pdl["PDL"] if WHOLE_TILE is None else WHOLE_TILE)
    x = x.contiguous()
    out = torch.empty(*x.shape[:-1], n, dtype=x.dtype, device=x.device)
    summed = torch.empty_like(x) if residual is not None and not gated else x
    tiles = gemv_tiles(k)
    _kernel()[(-(-n // BLOCK_N),)](
        x, residual.contiguous() if residual is not None else x, norm_weight if norm_weight is not None else x,
        summed, w, bias if bias is not None else w, out, n, w.stride(0), eps, K=k, BLOCK_N=BLOCK_N,
        BLOCK_K=tiles.block_k, BLOCK_ROW=next_pow2(k), EVEN_N=n % BLOCK_N == 0, EVEN_K=k % tiles.block_k == 0,
        NORM=norm_weight is not None,
        RESIDUAL=residual is not None and not gated, GATED=gated, BIAS=bias is not None, WHOLE=whole,
        num_warps=tiles.warps, **pdl)
    return out, summed


@functools.cache
def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def gemv_kernel(x_ptr, res_ptr, norm_ptr, sum_ptr, w_ptr, bias_ptr, out_ptr, n, stride_wn, eps,
                    K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_ROW: tl.constexpr,
                    EVEN_N: tl.constexpr, EVEN_K: tl.constexpr, NORM: tl.constexpr, RESIDUAL: tl.constexpr,
                    GATED: tl.constexpr, BIAS: tl.constexpr, WHOLE: tl.constexpr, PDL: tl.constexpr):
        rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        row_ok = rows < n
        w_rows = w_ptr + rows[None, :].to(tl.int64) * stride_wn
        if WHOLE:  # the program's whole weight tile, read before waiting for the previous kernel
            w_all = tl.load(w_rows + tl.arange(0, K)[:, None], mask=row_ok[None, :], other=0.0)
        if PDL:  # see triton_support.pdl_args
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        inv = 1.0
        if NORM:
            cols = tl.arange(0, BLOCK_ROW)
            live = cols < K
            whole = tl.load(x_ptr + cols, mask=live, other=0.0)
            if RESIDUAL:
                whole = (whole.to(tl.float32) + tl.load(res_ptr + cols, mask=live, other=0.0).to(tl.float32)
                         ).to(whole.dtype)
                if tl.program_id(0) == 0:
                    tl.store(sum_ptr + cols, whole, mask=live)
            sq = whole.to(tl.float32)
            inv = 1.0 / tl.sqrt(tl.sum(sq * sq, axis=0) / K + eps)
        if WHOLE:  # BLOCK_ROW == K: the row read for the norm is the input
            if NORM:
                normed = (whole.to(tl.float32) * inv).to(whole.dtype).to(tl.float32)
                xs = (normed * tl.load(norm_ptr + cols).to(tl.float32)).to(whole.dtype)
            else:
                ks = tl.arange(0, K)
                xs = tl.load(x_ptr + ks)
                if GATED:  # silu(gate) * up, each rounded to the dtype as the twin's two ops round
                    act = (xs.to(tl.float32) * tl.sigmoid(xs.to(tl.float32))).to(xs.dtype).to(tl.float32)
                    xs = (act * tl.load(x_ptr + K + ks).to(tl.float32)).to(xs.dtype)
            acc = xs.to(tl.float32)[:, None] * w_all.to(tl.float32)
        else:
            acc = tl.zeros((BLOCK_K, BLOCK_N), tl.float32)
            for step in tl.static_range((K + BLOCK_K - 1) // BLOCK_K):
                ks = step * BLOCK_K + tl.arange(0, BLOCK_K)
                k_ok = ks < K  # past K (a tail step) every input reads zero, so its products are zero
                if EVEN_N and EVEN_K:
                    w = tl.load(w_rows + ks[:, None])
                    xs = tl.load(x_ptr + ks)
                else:
                    w = tl.load(w_rows + ks[:, None], mask=k_ok[:, None] & row_ok[None, :], other=0.0)
                    xs = tl.load(x_ptr + ks, mask=k_ok, other=0.0)
                if GATED:
                    act = (xs.to(tl.float32) * tl.sigmoid(xs.to(tl.float32))).to(xs.dtype).to(tl.float32)
                    xs = (act * tl.load(x_ptr + K + ks, mask=k_ok, other=0.0).to(tl.float32)).to(xs.dtype)
                if NORM:
                    if RESIDUAL:
                        xs = (xs.to(tl.float32) + tl.load(res_ptr + ks, mask=k_ok, other=0.0).to(tl.float32)
                              ).to(xs.dtype)
                    normed = (xs.to(tl.float32) * inv).to(xs.dtype).to(tl.float32)
                    xs = (normed * tl.load(norm_ptr + ks, mask=k_ok, other=0.0).to(tl.float32)).to(xs.dtype)
                acc += xs.to(tl.float32)[:, None] * w.to(tl.float32)
        out = tl.sum(acc, 0)
        if BIAS:  # added to the float32 sum, rounded once (torch's F.linear with a bias)
            out += tl.load(bias_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)
        out = out.to(out_ptr.dtype.element_ty)
        if GATED:  # add + sigmoid(logit) * out, logit = x[2K], rounded after each op as the twin rounds
            gate = tl.sigmoid(tl.load(x_ptr + 2 * K).to(tl.float32)).to(out.dtype).to(tl.float32)
            out = (gate * out.to(tl.float32)).to(out.dtype)
            out = (tl.load(res_ptr + rows, mask=row_ok, other=0.0).to(tl.float32) + out.to(tl.float32)).to(out.dtype)
        tl.store(out_ptr + rows, out, mask=row_ok)

    return gemv_kernel
