"""The 4-bit expert banks as the W4A16 grouped GEMM takes them: their layout (``moe_offload.fp4``),
the host-side checks every launch runs first, and the eager twin (dequantize, then float32 math),
which is the CPU path and the kernels' parity oracle.

```
 bank    packed uint8   scale                        channel_scale      bias (optional)
 w13     [S, 2I, H/2]   [S, 2I, H/G] e4m3 | e8m0     [S, 2I] f32 nvfp4  [E, 2I] gate | up
 w2      [S, H, I/2]    [S, H, I/G]                  [S, H]             [E, H]
```

Biases are rows of ``bias_ids [T, k]`` (default the slots: per-slot biases), so a cache of 4-bit
slots can index biases kept resident by expert id; an id outside ``[0, E)`` adds nothing. Pairs on
one slot must carry one bias id (a slot holds one expert): the grouped kernels read a slot's
bias row once, from one of its pairs.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from moe_offload import fp4

FORMATS = ("nvfp4", "mxfp4")
GROUP = {"nvfp4": fp4.NVFP4_GROUP, "mxfp4": fp4.MXFP4_GROUP}
SCALE_DTYPE = {"nvfp4": torch.float8_e4m3fn, "mxfp4": torch.uint8}
# "silu" is the plain SwiGLU's name in grouped.grouped_swiglu; "gpt_oss" is the clamped form.
ACTIVATIONS = ("swiglu", "silu", "gpt_oss")
GPT_OSS_LIMIT, GPT_OSS_ALPHA = 7.0, 1.702
_FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


class W4Bank(NamedTuple):
    """One weight ``[S, N, K]`` of every slot: ``packed [S, N, K/2]``, group ``scale [S, N, K/G]``,
    nvfp4's ``channel_scale [S, N]`` (None for mxfp4) and an optional ``bias [E, N]``."""

    packed: torch.Tensor
    scale: torch.Tensor
    channel_scale: torch.Tensor | None
    bias: torch.Tensor | None = None


def check_w4_args(hidden: torch.Tensor, weights: torch.Tensor, slots: torch.Tensor, w13: W4Bank, w2: W4Bank,
                  fmt: str, activation: str, out_dtype: torch.dtype | None, bias_ids: torch.Tensor | None) -> None:
    """Shapes, dtypes, strides and devices from metadata only (the kernels do raw pointer
    arithmetic); slot and bias ids are not read (that would sync): the kernels mask them."""
    if fmt not in FORMATS or activation not in ACTIVATIONS:
        raise ValueError(f"format {fmt!r} / activation {activation!r}: want one of {FORMATS} / {ACTIVATIONS}")
    if hidden.dim() != 2 or weights.dim() != 2 or slots.dim() != 2:
        raise ValueError("expected hidden [T, H], weights and slots [T, k]")
    num_tokens, dim = hidden.shape
    if slots.shape != weights.shape or slots.shape[0] != num_tokens or slots.shape[1] < 1:
        raise ValueError(f"slots {tuple(slots.shape)} and weights {tuple(weights.shape)} must both be "
                         f"[{num_tokens}, k>=1]")
    if hidden.dtype not in _FLOAT_DTYPES or (out_dtype is not None and out_dtype not in _FLOAT_DTYPES):
        raise ValueError(f"hidden and out_dtype must be one of {_FLOAT_DTYPES}; got {hidden.dtype}, {out_dtype}")
    if not weights.dtype.is_floating_point or slots.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"weights must be floating point and slots int32/int64; got {weights.dtype}, {slots.dtype}")
    if w13.packed.dim() != 3 or w2.packed.dim() != 3:
        raise ValueError("expected packed w13 [S, 2I, H/2] and w2 [S, H, I/2]")
    num_slots, inter = w2.packed.shape[0], w2.packed.shape[2] * 2
    if w13.packed.shape != (num_slots, 2 * inter, dim // 2) or w2.packed.shape[1] != dim or num_slots < 1:
        raise ValueError(f"packed w13 {tuple(w13.packed.shape)} / w2 {tuple(w2.packed.shape)} do not fit hidden {dim}")
    group = GROUP[fmt]
    if dim % group or inter % group:
        raise ValueError(f"{fmt} needs hidden {dim} and intermediate {inter} to be multiples of {group}")
    for name, bank, k in (("w13", w13, dim), ("w2", w2, inter)):
        _check_bank(name, bank, fmt, num_slots, k)
    ids = slots if bias_ids is None else bias_ids
    if ids.shape != slots.shape or ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"bias_ids {tuple(ids.shape)} {ids.dtype} must be int32/int64 like slots {tuple(slots.shape)}")
    if (w13.bias is None) != (w2.bias is None) or (w13.bias is not None and w13.bias.shape[0] != w2.bias.shape[0]):
        raise ValueError("give both biases, over the same experts, or neither")
    tensors = (hidden, weights, slots, ids, *w13, *w2)
    if len({t.device for t in tensors if t is not None}) != 1:
        raise ValueError("every argument must be on one device")


def _check_bank(name: str, bank: W4Bank, fmt: str, num_slots: int, k: int) -> None:
    packed, scale, channel, bias = bank
    rows = packed.shape[1]
    if packed.dtype != torch.uint8 or scale.dtype != SCALE_DTYPE[fmt]:
        raise ValueError(f"{name}: {fmt} banks are uint8 with {SCALE_DTYPE[fmt]} scales; "
                         f"got {packed.dtype}, {scale.dtype}")
    if tuple(scale.shape) != (num_slots, rows, k // GROUP[fmt]):
        raise ValueError(f"{name} scale {tuple(scale.shape)} does not fit [{num_slots}, {rows}, {k // GROUP[fmt]}]")
    if (channel is None) != (fmt == "mxfp4"):
        raise ValueError(f"{name}: nvfp4 needs a channel scale [S, N], mxfp4 has none")
    if channel is not None and (tuple(channel.shape) != (num_slots, rows) or channel.dtype != torch.float32):
        raise ValueError(f"{name} channel scale {tuple(channel.shape)} {channel.dtype}: "
                         f"want float32 [{num_slots}, {rows}]")
    if bias is not None and (bias.dim() != 2 or bias.shape[1] != rows or bias.dtype not in _FLOAT_DTYPES):
        raise ValueError(f"{name} bias {tuple(bias.shape)} {bias.dtype}: want [E, {rows}] float")
    if any(t is not None and t.stride(-1) != 1 for t in bank):
        raise ValueError(f"{name}: every bank needs a unit stride along its last dimension")
    align = 16 if fmt == "mxfp4" else 4  # mxfp4: whole groups, read 16 bytes at a time (MXFP4_ROW_ALIGN)
    if packed.data_ptr() % align or packed.stride(0) % align or packed.stride(1) % align:
        raise ValueError(f"{name}: packed rows must start on {align}-byte boundaries (the kernels read "
                         f"{'16-byte groups' if align == 16 else 'words'})")


# ==== launch plumbing ====

def kernel_consts(fmt: str, dtype: torch.dtype) -> dict:
    """The constexprs every 4-bit kernel takes for a format and the activations' dtype."""
    return dict(GROUP=GROUP[fmt], E8M0=fmt == "mxfp4", PRECISION="ieee" if dtype == torch.float32 else "tf32")


def activation_consts(activation: str) -> dict:
    return dict(GPT_OSS=activation == "gpt_oss", LIMIT=GPT_OSS_LIMIT, ALPHA=GPT_OSS_ALPHA)


def bank_args(bank: W4Bank) -> tuple[tuple, tuple, dict]:
    """A bank's pointers (packed codes as int32 words; the scales stand in for an absent channel
    scale or bias: never read), its strides over slots and rows (words for the codes), its bias
    rows, and its constexprs."""
    words = bank.packed.view(torch.int32)  # the kernels decode 8 codes a word
    channel = bank.scale if bank.channel_scale is None else bank.channel_scale
    bias = bank.scale[0] if bank.bias is None else bank.bias
    ptrs = (words, bank.scale, channel, bias)
    strides = (words.stride(0), words.stride(1), bank.scale.stride(0), bank.scale.stride(1), channel.stride(0),
               bias.shape[0], bias.stride(0))
    return ptrs, strides, dict(CHANNEL=bank.channel_scale is not None, BIAS=bank.bias is not None)



# ==== the eager twin ====

def grouped_swiglu_w4_eager(hidden: torch.Tensor, weights: torch.Tensor, slots: torch.Tensor, w13: W4Bank,
                            w2: W4Bank, *, fmt: str, out_dtype: torch.dtype | None = None,
                            bias_ids: torch.Tensor | None = None, activation: str = "swiglu",
                            config: object = None) -> torch.Tensor:
    """Reference: every slot the batch uses dequantized (``moe_offload.fp4``) and multiplied in
    float32; the intermediate activation rounded to hidden's dtype, as the kernels store it; a
    token's k outputs summed in float32. Slots outside ``[0, S)`` contribute zero.

    Reads the routing on the host (which slots occur), so it is the CPU path and the parity
    oracle, never the GPU hot path. ``config`` is accepted (and ignored) for the kernels' signature."""
    check_w4_args(hidden, weights, slots, w13, w2, fmt, activation, out_dtype, bias_ids)
    num_tokens, top_k = slots.shape
    flat, ids = slots.reshape(-1), (slots if bias_ids is None else bias_ids).reshape(-1)
    out = torch.zeros(num_tokens, hidden.shape[1], dtype=torch.float32, device=hidden.device)
    for slot in torch.unique(flat).tolist():
        if not 0 <= slot < w13.packed.shape[0]:
            continue
        rows = torch.nonzero(flat == slot).squeeze(-1)
        tokens = rows // top_k
        gate_up = hidden[tokens].float() @ _dequantize(w13, slot, fmt).T + _bias(w13.bias, ids[rows])
        gate, up = gate_up.chunk(2, dim=-1)
        act = _activate(gate, up, activation).to(hidden.dtype).float()
        down = act @ _dequantize(w2, slot, fmt).T + _bias(w2.bias, ids[rows])
        out.index_add_(0, tokens, down * weights.reshape(-1)[rows, None].float())
    return out.to(out_dtype or hidden.dtype)


def _dequantize(bank: W4Bank, slot: int, fmt: str) -> torch.Tensor:
    if fmt == "nvfp4":
        return fp4.dequantize_nvfp4(bank.packed[slot], bank.scale[slot], bank.channel_scale[slot])
    return fp4.dequantize_mxfp4(bank.packed[slot], bank.scale[slot])


def _bias(bias: torch.Tensor | None, ids: torch.Tensor) -> torch.Tensor | float:
    """Bias rows of ``ids``; ids outside ``[0, E)`` add zero, as in the kernels."""
    if bias is None:
        return 0.0
    ok = (ids >= 0) & (ids < bias.shape[0])
    return torch.where(ok[:, None], bias[ids.clamp(0, bias.shape[0] - 1)].float(), 0.0)


def _activate(gate: torch.Tensor, up: torch.Tensor, activation: str) -> torch.Tensor:
    if activation == "gpt_oss":
        gate, up = gate.clamp(max=GPT_OSS_LIMIT), up.clamp(-GPT_OSS_LIMIT, GPT_OSS_LIMIT)
        return gate * torch.sigmoid(GPT_OSS_ALPHA * gate) * (up + 1)
    return gate * torch.sigmoid(gate) * up
