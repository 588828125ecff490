"""The gated delta rule of Qwen3-Next / Qwen3.5 Gated DeltaNet layers, over a pool of float32
recurrent states indexed by slot (the math is in ``delta_rule_eager.py``).

    q, k   [T, Hk, Dk]       not yet l2-normalised; value head h reads key head h // (Hv // Hk)
    v      [T, Hv, Dv]
    g      [T, Hv] float32   log decay (<= 0);  beta [T, Hv] in (0, 1)
    state  [S, Hv, Dk, Dv]   float32; state[slot] is a sequence's initial state, updated in place

``gated_delta_chunk`` (prefill, packed sequences) runs fla's chunked Triton kernels on CUDA
tensors, ``gated_delta_step`` (decode) our in-place kernel of ``delta_step_kernel.py``; other
devices run the eager twins. fla is imported on first CUDA use only (it warns on CPU machines).

fla's sync traps, and how the chunk path avoids them: with ``cu_seqlens`` alone it derives its
chunk table on the device with a data-dependent ``repeat_interleave`` (a sync), so the table is
built here from the host lengths and sent with a non-blocking copy; its helpers memoise results
by the identity of the ``cu_seqlens`` tensor, so a caller's persistent buffer refilled in place
would get a stale table: each call passes a fresh view. Its initial state is dense, so the slots
are gathered before and scattered after (fixed shapes). Its kernels autotune on the first call
for each head shape and dtype (key without T), and autotuning synchronises: warm up once per
layer shape before serving. Where the repository keeps this GPU's tuned configs
(``fla_tuning``), fla reads those instead of autotuning the shapes they hold.
Measured on an H200: about 1.2 ms of host time a call (Triton's
launches of its seven kernels), against 0.4 ms of GPU time at T=4096 (Hv=32, Dk=Dv=128).
"""
from __future__ import annotations

import functools

import torch

from moe_offload.kernels.triton_support import next_pow2, use_triton
from worker.linear_attention.delta_rule_eager import (CHUNK, L2_EPS, gated_delta_chunked, gated_delta_step_eager)
from worker.linear_attention.varlen import check_varlen, to_device

MAX_HEAD_DIM_FLA = 256  # fla's chunked kernels hold a Dk of at most this


def gated_delta_chunk(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                      state: torch.Tensor, slots: torch.Tensor, cu_seqlens: torch.Tensor,
                      cu_seqlens_host: list[int], *, backend: str | None = None) -> torch.Tensor:
    """Prefill of B packed sequences, sequence b resuming from ``state[slots[b]]``; returns
    ``o [T, Hv, Dv]`` in v's dtype and leaves each sequence's final state in its slot."""
    _check(q, k, v, g, beta, state, slots)
    check_varlen(q.shape[0], slots, cu_seqlens, cu_seqlens_host)
    if not use_triton(q, backend):
        return gated_delta_chunked(q, k, v, g, beta, state, slots, cu_seqlens_host)
    if not q.is_cuda or q.shape[-1] > MAX_HEAD_DIM_FLA:
        raise ValueError(f"fla's chunked kernels need CUDA tensors and Dk <= {MAX_HEAD_DIM_FLA}")
    _prepare_fla(q.device.index)
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    o, final = chunk_gated_delta_rule(
        q[None], k[None], v[None], g[None], beta[None], scale=q.shape[-1] ** -0.5,
        initial_state=state.index_select(0, slots), output_final_state=True, use_qk_l2norm_in_kernel=True,
        cu_seqlens=cu_seqlens[:], chunk_indices=chunk_indices(cu_seqlens_host, cu_seqlens))
    state.index_copy_(0, slots, final)
    return o[0].to(v.dtype)


@functools.cache
def _prepare_fla(device: int | None) -> bool:
    """Once, before fla's first use on a GPU: its kept configs, read by every tuner (``fla_tuning``)."""
    from worker.linear_attention.fla_tuning import prepare

    return prepare(torch.cuda.get_device_name(device))


def gated_delta_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                     state: torch.Tensor, slots: torch.Tensor, *, backend: str | None = None) -> torch.Tensor:
    """Decode, one token per sequence (``q, k [B, Hk, Dk]``, ``v [B, Hv, Dv]``, ``g, beta [B, Hv]``):
    returns ``o [B, Hv, Dv]`` and updates ``state[slots]`` in place. No host reads, fixed shapes:
    a CUDA graph can capture it."""
    _check(q, k, v, g, beta, state, slots)
    B, Hv, Dv = v.shape
    if slots.shape != (B,):
        raise ValueError(f"slots {tuple(slots.shape)} for a step of {B} tokens")
    if not use_triton(q, backend):
        return gated_delta_step_eager(q, k, v, g, beta, state, slots)
    from worker.linear_attention.delta_step_kernel import MAX_BLOCK_V, gated_delta_step_kernel

    Hk, Dk = q.shape[1:]
    block_k, block_v = next_pow2(Dk), min(next_pow2(Dv), MAX_BLOCK_V)
    q, k, v = (_heads_packed(x) for x in (q, k, v))
    o = torch.empty((B, Hv, Dv), dtype=v.dtype, device=v.device)
    gated_delta_step_kernel[(-(-Dv // block_v), B * Hv)](
        q, k, v, g.contiguous(), beta.contiguous(), state, slots, o, q.stride(0), k.stride(0), v.stride(0),
        state.shape[0], Dk ** -0.5, L2_EPS, HK=Hk, HV=Hv, DK=Dk, DV=Dv, BK=block_k, BV=block_v,
        num_warps=max(1, min(4, block_k * block_v // 2048)))
    return o


def _heads_packed(x: torch.Tensor) -> torch.Tensor:
    """``x`` if each token's heads lie packed (a view split from the conv output does), else a copy."""
    return x if x.stride(2) == 1 and x.stride(1) == x.shape[2] else x.contiguous()


def chunk_indices(cu_seqlens_host: list[int], cu_seqlens: torch.Tensor, chunk: int = CHUNK) -> torch.Tensor:
    """fla's chunk table, ``[(sequence, chunk within it)]`` for every chunk, from the host lengths."""
    table = [[b, i] for b, (bos, eos) in enumerate(zip(cu_seqlens_host, cu_seqlens_host[1:]))
             for i in range(-(-(eos - bos) // chunk))]
    return to_device(table, cu_seqlens.dtype, cu_seqlens.device)


def _check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
           state: torch.Tensor, slots: torch.Tensor) -> None:
    """Shapes, dtypes and devices, on the host (ValueError)."""
    if q.dim() != 3 or k.shape != q.shape or v.dim() != 3 or v.shape[0] != q.shape[0]:
        raise ValueError(f"q, k must be [T, Hk, Dk] and v [T, Hv, Dv]: {tuple(q.shape)} {tuple(k.shape)} "
                         f"{tuple(v.shape)}")
    T, Hk, Dk = q.shape
    Hv, Dv = v.shape[1:]
    if Hk == 0 or Hv % Hk:
        raise ValueError(f"{Hv} value heads are not a multiple of {Hk} key heads")
    if g.shape != (T, Hv) or beta.shape != (T, Hv):
        raise ValueError(f"g {tuple(g.shape)} and beta {tuple(beta.shape)} must be [{T}, {Hv}]")
    if state.dim() != 4 or state.shape[1:] != (Hv, Dk, Dv) or state.dtype != torch.float32 \
            or not state.is_contiguous():
        raise ValueError(f"state must be a contiguous float32 [S, {Hv}, {Dk}, {Dv}], got "
                         f"{tuple(state.shape)} {state.dtype}")
    if slots.dim() != 1 or slots.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"slots must be a 1-D integer tensor, got {tuple(slots.shape)} {slots.dtype}")
    if len({t.device for t in (q, k, v, g, beta, state, slots)}) != 1:
        raise ValueError("q, k, v, g, beta, state and slots must be on one device")
