"""The short depthwise causal conv of Gated DeltaNet layers, over the packed q/k/v channels, SiLU
applied, with a rolling window of the last K-1 inputs per state slot.

    x      [T, C]        tokens of B sequences back to back (cu_seqlens), model dtype
    weight [C, K]        HF's conv1d.weight [C, 1, K] squeezed
    state  [S, C, K-1]   state[slot] = the K-1 inputs before a sequence's first new token

Output t of a sequence is ``silu(sum_j weight[:, j] * input[t - (K-1) + j])``, where inputs before the
sequence's first new token come from its state (zeros for a fresh sequence: transformers' left
padding). Accumulated in float32 and cast to x's dtype once, after the SiLU. CUDA tensors run the
Triton kernels of ``conv_kernel.py``; other devices the eager twins here.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from moe_offload.kernels.triton_support import next_pow2, use_triton
from worker.linear_attention.varlen import check_varlen

BLOCK_T = 32  # tokens per program of the varlen conv
MAX_BLOCK_C = 128  # channels per program


def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor, slots: torch.Tensor,
                  cu_seqlens: torch.Tensor, cu_seqlens_host: list[int], *, backend: str | None = None) -> torch.Tensor:
    """Conv of B packed sequences (prefill chunks), each resuming from ``state[slots[b]]``; returns
    ``[T, C]`` and leaves in ``state[slots[b]]`` the last K-1 inputs of sequence b (old state and new
    tokens together, so a one-token chunk shifts the window by one). Slots must be distinct."""
    _check_conv(x, weight, state, slots)
    check_varlen(x.shape[0], slots, cu_seqlens, cu_seqlens_host)
    if not use_triton(x, backend):
        return causal_conv1d_eager(x, weight, state, slots, cu_seqlens_host)
    from worker.linear_attention.conv_kernel import state_update, varlen_conv

    T, C = x.shape
    B, K = slots.shape[0], weight.shape[1]
    out = torch.empty((T, C), dtype=x.dtype, device=x.device)
    longest = max(b - a for a, b in zip(cu_seqlens_host, cu_seqlens_host[1:]))
    block_c = min(next_pow2(C), MAX_BLOCK_C)
    blocks_c = -(-C // block_c)
    weight = weight.contiguous()
    varlen_conv[(B, -(-longest // BLOCK_T), blocks_c)](x, weight, state, slots, cu_seqlens, out, C, state.shape[0],
                                                        x.stride(0), out.stride(0), K=K, BT=BLOCK_T, BC=block_c)
    state_update[(B, blocks_c)](x, state, slots, cu_seqlens, C, state.shape[0], x.stride(0), K=K, BC=block_c)
    return out


def conv1d_step(x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor, slots: torch.Tensor, *,
                backend: str | None = None) -> torch.Tensor:
    """Decode: one token per sequence, ``x [B, C] -> [B, C]``, shifting ``state[slots[b]]`` by one.
    No host reads and fixed shapes, so a CUDA graph can capture it."""
    _check_conv(x, weight, state, slots)
    if slots.shape != (x.shape[0],):
        raise ValueError(f"slots {tuple(slots.shape)} for a step of {x.shape[0]} tokens")
    if not use_triton(x, backend):
        return conv1d_step_eager(x, weight, state, slots)
    from worker.linear_attention.conv_kernel import step

    B, C = x.shape
    out = torch.empty((B, C), dtype=x.dtype, device=x.device)
    block_c = min(next_pow2(C), MAX_BLOCK_C)
    step[(B, -(-C // block_c))](x, weight.contiguous(), state, slots, out, C, state.shape[0], x.stride(0),
                                out.stride(0), K=weight.shape[1], BC=block_c)
    return out


# ==== eager twins ====

def causal_conv1d_eager(x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor, slots: torch.Tensor,
                        cu_seqlens_host: list[int]) -> torch.Tensor:
    """Reference twin: each sequence's window (old state, then its tokens) unfolded into taps."""
    K = weight.shape[1]
    before = state.index_select(0, slots)  # [B, C, K-1]
    outs, after = [], []
    for b, (bos, eos) in enumerate(zip(cu_seqlens_host, cu_seqlens_host[1:])):
        window = torch.cat([before[b].t(), x[bos:eos]])  # [K-1+L, C]
        outs.append(_silu_conv(window.unfold(0, K, 1), weight).to(x.dtype))  # taps [L, C, K]
        after.append(window[window.shape[0] - (K - 1):].t())
    state.index_copy_(0, slots, torch.stack(after))
    return torch.cat(outs)


def conv1d_step_eager(x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """Reference twin of the step, itself fixed-shape and sync-free: gather, shift, scatter."""
    window = torch.cat([state.index_select(0, slots), x[:, :, None]], dim=2)  # [B, C, K]
    state.index_copy_(0, slots, window[:, :, 1:])
    return _silu_conv(window, weight).to(x.dtype)


def _silu_conv(taps: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``silu(sum_j taps[..., j] * weight[:, j])`` in float32; taps ``[..., C, K]``."""
    return F.silu((taps.float() * weight.float()).sum(-1))


# ==== host-side checks ====

def _check_conv(x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor, slots: torch.Tensor) -> None:
    if x.dim() != 2 or x.stride(1) != 1:
        raise ValueError(f"x must be [T, C] with unit channel stride, got {tuple(x.shape)} strides {x.stride()}")
    C = x.shape[1]
    if weight.dim() != 2 or weight.shape[0] != C or weight.shape[1] < 2:
        raise ValueError(f"weight must be [C={C}, K>=2], got {tuple(weight.shape)}")
    K = weight.shape[1]
    if state.dim() != 3 or state.shape[1:] != (C, K - 1) or not state.is_contiguous():
        raise ValueError(f"state must be a contiguous [S, {C}, {K - 1}], got {tuple(state.shape)}")
    if state.dtype != x.dtype:
        raise ValueError(f"the conv state holds inputs: dtype {state.dtype} differs from x's {x.dtype}")
    if slots.dim() != 1 or slots.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"slots must be a 1-D integer tensor, got {tuple(slots.shape)} {slots.dtype}")
    if len({t.device for t in (x, weight, state, slots)}) != 1:
        raise ValueError("x, weight, state and slots must be on one device")

