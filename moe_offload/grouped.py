"""Grouped SwiGLU expert GEMM: every token runs through its k routed experts and the outputs are
combined with the routing weights.

Weight banks are indexed by "slot": for resident experts a slot is the expert id, under offload it
is a slot of the expert cache. ``w13[s]`` is ``[2I, H]`` (gate rows then up rows), ``w2[s]`` is
``[H, I]``.

Paths: CUDA tensors take the sync-free Triton path (``kernels.grouped_gemm``; decode batches of
float banks ``grouped_gemm_decode``, of fp8 banks ``grouped_gemm_decode_fp8`` (past
``RESIDENT_MAX_PAIRS`` pairs only when they fill); larger fp8 batches ``grouped_gemm_fp8``; 4-bit
banks their room's W4A16 GEMM), anything else the eager twin;
``grouped_swiglu``'s ``backend`` (or ``SLUICE_KERNELS``) forces one (``kernels.triton_support``).
Slot ids are not checked on the host (that would read the device): the Triton path treats ids
outside ``[0, N)`` as contributing zero; the eager twin skips negative ids alike (expert parallelism
masks other ranks' experts to -1) and requires the rest in range.

Fills: experts an expert-cache lookup admitted into ``slots`` and still to copy in from the host
(a ``SlotFill``). The decode paths of float, fp8 and 4-bit banks (``grouped_gemm_decode``,
``grouped_gemm_decode_fp8``, ``grouped_gemm_w4_decode``) copy them in their gate_up launch (so the
hits compute while the misses cross PCIe); every other path gathers them first
(``gather_missing``), in stream order before the GEMM.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from moe_offload.expert_scales import ExpertScales
from moe_offload.formats import dequantize_w13, room_of
from moe_offload.formats.fp4_gemm import grouped_swiglu_w4
from moe_offload.fp8 import ACTIVATION_BLOCK, dequantize, quantize
from moe_offload.grouped_checks import check_args as _check_args
from moe_offload.kernels.triton_support import use_triton
from moe_offload.slot_fill import SlotFill

__all__ = ["ExpertScales", "SlotFill", "grouped_swiglu", "grouped_swiglu_eager", "fp8_activations_for"]


def grouped_swiglu(hidden: torch.Tensor, weights: torch.Tensor, slots: torch.Tensor, w13: torch.Tensor,
                   w2: torch.Tensor, *, scales: ExpertScales | None = None, fp8_activations: bool | None = None,
                   backend: str | None = None, out_dtype: torch.dtype | None = None,
                   fill: SlotFill | None = None, w13_bias: torch.Tensor | None = None,
                   w2_bias: torch.Tensor | None = None, bias_ids: torch.Tensor | None = None,
                   activation: str = "silu", groups: int | None = None) -> torch.Tensor:
    """``hidden [T, H]``, ``weights [T, k]``, ``slots [T, k]`` -> ``[T, H]`` in ``out_dtype``
    (default hidden's). A token's k outputs are summed in float32 and rounded once (expert
    parallelism asks for float32, so that the ranks' partials, added by an all_reduce, round once).

    FP8 banks (``float8_e4m3fn``) need ``scales``: per slot, the scale grids of ``moe_offload.fp8``
    (``w13``'s is the gate's grid stacked on the up's). The activations stay in hidden's dtype
    (weight-only), or with ``fp8_activations`` each GEMM's input is quantized per token and 128
    columns (``fp8.ACTIVATION_BLOCK``) and the GEMMs multiply fp8 by fp8; ``None`` picks by
    ``fp8_activations_for`` (fp8 x fp8 for 16-bit batches of prefill size: on the H200 weight-only
    was 2.5x slower at 2k tokens).

    ``backend`` forces a path and ``fill`` carries the experts still to copy in: the module's
    docstring says which path runs and when each copies its fill.

    gpt-oss's experts: ``w13_bias [E, 2I]`` (gate | up) and ``w2_bias [E, H]`` are indexed by
    ``bias_ids [T, k]`` (the routed expert ids; default ``slots``, as for resident experts), so the
    cache and the pipeline move no bias bytes; ``activation`` is ``"silu"`` or ``"gpt_oss"``
    (``swiglu``). ``groups``: at most this many distinct slots in ``slots`` (a layer's experts, one
    slot each), which sizes the prefill-sized paths' rows and grids where the banks hold more.
    """
    _check_args(hidden, weights, slots, w13, w2, scales)
    extras = _expert_extras(slots, w13, w2, w13_bias, w2_bias, bias_ids, activation)
    fp8_activations = _fp8_activations(hidden, scales, fp8_activations)
    if scales is not None and scales.kind and use_triton(hidden, backend):  # 4-bit: the room's W4A16 GEMM
        return grouped_swiglu_w4(hidden, weights, slots, w13, w2, scales, out_dtype, backend, fill=fill,
                                 groups=groups, **extras)
    if not use_triton(hidden, backend):
        _gather_first(fill, w13, w2, scales, backend)
        return grouped_swiglu_eager(hidden, weights, slots, w13, w2, scales, fp8_activations, out_dtype, **extras)
    if scales is not None:
        return _fp8_path(hidden, weights, slots, w13, w2, scales, fp8_activations, out_dtype, fill, backend, extras,
                         groups)
    return _float_path(hidden, weights, slots, w13, w2, out_dtype, fill, backend, extras, groups)


def _fp8_activations(hidden: torch.Tensor, scales: ExpertScales | None, asked: bool | None) -> bool:
    """``fp8_activations`` as asked, or as ``fp8_activations_for`` picks it (``None``): only fp8
    experts quantize their activations."""
    chosen = fp8_activations_for(hidden, scales) if asked is None else asked
    if chosen and (scales is None or scales.kind):
        raise ValueError("fp8_activations needs fp8 experts (scales)")
    return chosen


def _fp8_path(hidden: torch.Tensor, weights: torch.Tensor, slots: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
              scales: ExpertScales, fp8_activations: bool, out_dtype: torch.dtype | None, fill: SlotFill | None,
              backend: str | None, extras: dict, groups: int | None) -> torch.Tensor:
    """fp8 banks on the Triton path: decode batches fill in their GEMM, larger ones gather first."""
    if extras:
        raise ValueError("fp8 experts with biases or the gpt_oss activation are not supported (bf16 only)")
    from moe_offload.kernels import grouped_gemm_decode_fp8 as decode_fp8
    from moe_offload.kernels.grouped_gemm_fp8 import fused_grouped_swiglu_fp8

    if decode_fp8.supports(hidden, slots, scales, fp8_activations, filling=fill is not None):
        return decode_fp8.decode_grouped_swiglu_fp8(hidden, weights, slots, w13, w2, scales, out_dtype=out_dtype,
                                                    fill=fill)
    _gather_first(fill, w13, w2, scales, backend)
    return fused_grouped_swiglu_fp8(hidden, weights, slots, w13, w2, scales, fp8_activations=fp8_activations,
                                    out_dtype=out_dtype, groups=groups)


def _float_path(hidden: torch.Tensor, weights: torch.Tensor, slots: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                out_dtype: torch.dtype | None, fill: SlotFill | None, backend: str | None, extras: dict,
                groups: int | None) -> torch.Tensor:
    """Float banks on the Triton path: decode batches fill in their GEMM, larger ones gather first."""
    from moe_offload.kernels import grouped_gemm_decode

    if slots.numel() <= grouped_gemm_decode.DECODE_MAX_PAIRS:
        return grouped_gemm_decode.decode_grouped_swiglu(hidden, weights, slots, w13, w2, out_dtype=out_dtype,
                                                         fill=fill, **extras)
    from moe_offload.kernels.grouped_gemm import fused_grouped_swiglu

    _gather_first(fill, w13, w2, None, backend)
    return fused_grouped_swiglu(hidden, weights, slots, w13, w2, out_dtype=out_dtype, groups=groups, **extras)


class ExpertBias(NamedTuple):
    """One layer's expert biases (gpt-oss), on the device beside the dense weights and indexed by
    expert id: ``w13 [E, 2I]`` (gate | up), ``w2 [E, H]``."""

    w13: torch.Tensor
    w2: torch.Tensor


def bias_args(bias: ExpertBias | None, ids: torch.Tensor) -> dict:
    """``grouped_swiglu``'s bias arguments for experts routed to ``ids`` (none without biases)."""
    return {} if bias is None else {"w13_bias": bias.w13, "w2_bias": bias.w2, "bias_ids": ids}


ACTIVATIONS = ("silu", "gpt_oss")
SWIGLU_LIMIT, SWIGLU_ALPHA = 7.0, 1.702  # gpt-oss's clamp and sigmoid gain


def swiglu(gate: torch.Tensor, up: torch.Tensor, activation: str = "silu") -> torch.Tensor:
    """``silu(gate) * up``, or gpt-oss's clamped form: ``gate = min(gate, 7)``, ``up = clamp(up,
    -7, 7)``, ``gate * sigmoid(1.702 gate) * (up + 1)``."""
    if activation == "silu":
        return F.silu(gate) * up
    gate, up = gate.clamp(max=SWIGLU_LIMIT), up.clamp(-SWIGLU_LIMIT, SWIGLU_LIMIT)
    return (up + 1) * (gate * torch.sigmoid(gate * SWIGLU_ALPHA))


def _expert_extras(slots: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, w13_bias: torch.Tensor | None,
                   w2_bias: torch.Tensor | None, bias_ids: torch.Tensor | None, activation: str) -> dict:
    """The optional gpt-oss arguments, checked from metadata, as keyword arguments for a path
    (none when absent, so the paths without them keep their signatures)."""
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation {activation!r}; one of {ACTIVATIONS}")
    if (w13_bias is None) != (w2_bias is None):
        raise ValueError("give both expert biases or neither")
    extras = {} if activation == "silu" else {"activation": activation}
    if w13_bias is None:
        return extras
    ids = slots if bias_ids is None else bias_ids
    E, two_i, H = w13_bias.shape[0], w13.shape[1], w2.shape[1]
    if w13_bias.shape != (E, two_i) or w2_bias.shape != (E, H) or ids.shape != slots.shape:
        raise ValueError(f"biases w13 {tuple(w13_bias.shape)} / w2 {tuple(w2_bias.shape)} / ids {tuple(ids.shape)} "
                         f"do not fit [E, {two_i}] / [E, {H}] / {tuple(slots.shape)}")
    if {w13_bias.device, w2_bias.device, ids.device} != {w13.device} or ids.dtype not in (torch.int32, torch.int64):
        raise ValueError("biases and bias ids (int32/int64) must be on the experts' device")
    return {**extras, "w13_bias": w13_bias, "w2_bias": w2_bias, "bias_ids": ids}


def _gather_first(fill: SlotFill | None, w13: torch.Tensor, w2: torch.Tensor, scales: ExpertScales | None,
                  backend: str | None) -> None:
    """A path that cannot fill as it computes copies ``fill``'s experts in before it starts."""
    if fill is not None:
        fill.gather(w13, w2, scales, backend)


# From this batch size on fp8 experts multiply fp8 activations: on the H200 (bench_grouped_gemm.py,
# qwen3-30b geometry) fp8 x fp8 took 189 us against weight-only 238 us at 64 tokens, 278 vs 639 at
# 256 and 651 vs 1630 at 2048; at 1 token they tie (46 us), and weight-only is the more precise.
FP8_ACTIVATION_TOKENS = 64


def fp8_activations_for(hidden: torch.Tensor, scales: ExpertScales | None) -> bool:
    """Whether a batch over fp8 experts quantizes its activations too: 16-bit activations (fp32 is
    the reference and test precision: it stays weight-only), at least ``FP8_ACTIVATION_TOKENS``
    tokens (small decode batches keep weight-only's extra precision), and weight scale blocks whose
    columns are whole 128-column activation groups, so one pair of scales covers every K tile."""
    if scales is None or scales.kind or hidden.dtype == torch.float32 or hidden.shape[0] < FP8_ACTIVATION_TOKENS:
        return False
    return scales.block.cols == 0 or scales.block.cols % ACTIVATION_BLOCK.cols == 0


def grouped_swiglu_eager(hidden: torch.Tensor, weights: torch.Tensor, slots: torch.Tensor, w13: torch.Tensor,
                         w2: torch.Tensor, scales: ExpertScales | None = None, fp8_activations: bool = False,
                         out_dtype: torch.dtype | None = None, *, w13_bias: torch.Tensor | None = None,
                         w2_bias: torch.Tensor | None = None, bias_ids: torch.Tensor | None = None,
                         activation: str = "silu") -> torch.Tensor:
    """Reference: one dense GEMM pair per expert used in the batch (fp8 experts dequantized to
    hidden's dtype first; with ``fp8_activations`` each GEMM's input is quantized and dequantized).

    Reads the routing on the host (which experts occur), so it is the CPU path and the parity
    oracle, never the GPU hot path.
    """
    num_tokens, top_k = slots.shape
    inter = w13.shape[-2] // 2  # rows: 4-bit banks are packed along K
    out = torch.zeros(num_tokens, hidden.shape[-1], dtype=torch.float32, device=hidden.device)
    flat_slots = slots.reshape(-1)
    # fp8 x fp8 as the kernel does it: exact fp8 products summed in fp32, the intermediate
    # activation stored in hidden's dtype and quantized from there
    compute = torch.float32 if fp8_activations else hidden.dtype
    round_trip = _fp8_round_trip if fp8_activations else (lambda x: x)
    hidden_in = round_trip(hidden)
    for slot in torch.unique(flat_slots).tolist():
        if slot < 0:  # another rank's expert, or an empty route: contributes zero as in the kernel
            continue
        rows = torch.nonzero(flat_slots == slot).squeeze(-1)
        tokens = rows // top_k
        up_w, down_w = _expert_weights(w13, w2, scales, slot, compute)
        ids = None if w13_bias is None else (slots if bias_ids is None else bias_ids).reshape(-1)[rows]
        gate_up = _biased(F.linear(hidden_in[tokens], up_w), w13_bias, ids)
        act = round_trip(swiglu(gate_up[:, :inter], gate_up[:, inter:], activation).to(hidden.dtype))
        expert_out = _biased(F.linear(act, down_w), w2_bias, ids)
        out.index_add_(0, tokens, expert_out.float() * weights.reshape(-1)[rows, None])
    return out.to(out_dtype or hidden.dtype)


def _biased(x: torch.Tensor, bias: torch.Tensor | None, ids: torch.Tensor | None) -> torch.Tensor:
    return x if bias is None else x + bias[ids].to(x.dtype)


def _fp8_round_trip(x: torch.Tensor) -> torch.Tensor:
    """``x`` quantized per token-group and widened to float32 (each e4m3 value times its scale)."""
    return dequantize(*quantize(x, ACTIVATION_BLOCK), ACTIVATION_BLOCK, torch.float32)


def _expert_weights(w13: torch.Tensor, w2: torch.Tensor, scales: ExpertScales | None, slot: int,
                    dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    if scales is None:
        return w13[slot], w2[slot]
    fmt, parts = scales.format, [t[slot] for t in scales.tensors()]
    w13_parts, w2_parts = (w13[slot], *parts[0::2]), (w2[slot], *parts[1::2])
    return dequantize_w13(fmt, w13_parts, dtype), room_of(fmt).dequantize(fmt, w2_parts, dtype)
