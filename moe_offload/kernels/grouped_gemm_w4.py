"""Triton grouped SwiGLU GEMM over 4-bit (e2m1) expert banks, W4A16, and the public op.

Hopper has no FP4 MMA: a weight tile is unpacked and scaled in registers inside the K loop and
multiplied on the 16-bit tensor cores (``grouped_gemm_w4_tiles``). Banks, checks and the eager
twin: ``grouped_gemm_w4_banks``. This file holds the prefill path, the bf16 kernel's plan
(``grouped_gemm.align_by_slot``, gate_up, down times the combine weight, ``sum_over_k``), and
``grouped_swiglu_w4``, which picks the decode path (``grouped_gemm_w4_decode``, up to
``DECODE_MAX_PAIRS`` pairs), this one, or the twin. Optional biases are added to the
accumulators, and ``activation="gpt_oss"`` clamps (``gate <= 7``, ``|up| <= 7``) and takes
``gate * sigmoid(1.702 gate) * (up + 1)``.

Decode batches fill a cache lookup's misses as they compute (``grouped_gemm_w4_decode``; the
``SlotFill`` rides the call, ``fills_in_gemm`` says when); larger batches have them gathered into
their slots first (``gather_missing``, one raw-byte launch for every bank, by the caller), in stream
order. With fp16 activations the dots take the decoded weights in fp16, which holds nvfp4's products and e8m0
scales within 2^-24..2^13 (beyond, bf16 or fp32 activations keep the range).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from moe_offload.kernels.grouped_gemm import (Alignment, BlockConfig, _pair_tile, align_by_slot, pick_config,
                                              sum_over_k, token_rows)
from moe_offload.kernels.grouped_gemm_w4_banks import (ACTIVATIONS, GROUP, W4Bank, activation_consts, bank_args,
                                                       check_w4_args, grouped_swiglu_w4_eager, kernel_consts)
from moe_offload.kernels.grouped_gemm_w4_decode import DECODE_MAX_PAIRS, decode_grouped_swiglu_w4
from moe_offload.kernels.grouped_gemm_w4_tiles import store_down_w4_rows, swiglu_w4_rows
from moe_offload.kernels.triton_support import use_triton
from moe_offload.slot_fill import SlotFill

__all__ = ["ACTIVATIONS", "DECODE_MAX_PAIRS", "GROUP", "BlockConfig", "W4Bank", "decode_grouped_swiglu_w4",
           "default_config", "fills_in_gemm", "fused_grouped_swiglu_w4", "grouped_swiglu_w4",
           "grouped_swiglu_w4_eager"]


def default_config(num_tokens: int, dtype: torch.dtype) -> BlockConfig:
    """W4A16 tiles: BLOCK_K 128 (eight nvfp4 or four mxfp4 groups a tile) while the weights' bytes
    dominate (first guesses, not swept); for large batches 128-row blocks, so each decoded weight
    tile serves 128 rows of MMA, at 4 warps (swept below)."""
    return pick_config(num_tokens, dtype, _W4_CONFIGS)


# Past 512 tokens, 4 warps where 8 were guessed: faster in every cell of the sweep (H100 80GB HBM3,
# 2026-12-07, ``scripts/bench_grouped_gemm_w4.py --tokens 2048,8192 --dtypes nvfp4,mxfp4 --sweep``,
# one layer, us, 8 -> 4 warps): qwen3-30b nvfp4 1,002.3 -> 958.8 at 2,048 tokens, 2,757.3 -> 2,634.5 at
# 8,192; mxfp4 1,086.8 -> 1,001.5, 3,029.8 -> 2,765.8; gpt-oss mxfp4 3,313.7 -> 3,103.8, 7,553.4 ->
# 7,236.5; nvfp4 at 8,192 10,525.7 -> 9,323.1. No other tile of the sweep won both sizes.
_W4_CONFIGS = ((128, BlockConfig(16, 128, 128, 16, 4, 3)), (512, BlockConfig(64, 128, 128, 16, 4, 3)),
               (None, BlockConfig(128, 128, 64, 8, 4, 3)))


def check_config(config: BlockConfig, fmt: str) -> None:
    if config.block_k % GROUP[fmt] or config.block_k < 32 or config.block_k & (config.block_k - 1):
        raise ValueError(f"BLOCK_K {config.block_k} must be a power of two, a multiple of {fmt}'s group "
                         f"{GROUP[fmt]} and >= 32 (each half-depth dot needs 16)")
    if min(config.block_m, config.block_n // 2) < 16:
        raise ValueError(f"tiles {config} are below tl.dot's 16 (block_n counts gate and up columns)")


# ==== prefill: rows grouped by slot (grouped_gemm's alignment) ====

# pair and block counts, and the routing's pointers, not specialised (see grouped_gemm._align_kernel)
@triton.jit(do_not_specialize=["num_pairs", "num_blocks"],
            do_not_specialize_on_alignment=["ids_ptr", "slots_ptr"])
def _gate_up_w4_kernel(x_ptr, q_ptr, s_ptr, c_ptr, b_ptr, ids_ptr, act_ptr, sorted_pairs_ptr, total_ptr, slots_ptr,
                       num_pairs, top_k, hidden, inter, num_blocks, stride_xt, stride_xh,
                       stride_qs, stride_qn, stride_ss, stride_sn, stride_cs, num_bias, stride_b,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                       GROUP: tl.constexpr, E8M0: tl.constexpr, CHANNEL: tl.constexpr, BIAS: tl.constexpr,
                       GPT_OSS: tl.constexpr, LIMIT: tl.constexpr, ALPHA: tl.constexpr, PRECISION: tl.constexpr,
                       EVEN_K: tl.constexpr):
    """act[row, n] = activation(x[token] . w13[slot, n] + b, x[token] . w13[slot, I + n] + b)."""
    rows, pairs, slot, cols, col_ok, done = _pair_tile(num_blocks, inter, total_ptr, sorted_pairs_ptr, slots_ptr,
                                                       BLOCK_M, BLOCK_N, GROUP_M)
    if done:
        return
    row_ok, tokens = token_rows(pairs, num_pairs, top_k)
    first = tl.load(sorted_pairs_ptr + tl.min(rows, 0))  # a live block's first row is a real pair
    act = swiglu_w4_rows(x_ptr + tokens * stride_xt, row_ok, first, q_ptr + slot * stride_qs, s_ptr + slot * stride_ss,
                         c_ptr + slot * stride_cs, b_ptr, ids_ptr, cols, col_ok, hidden, inter, num_bias, stride_xh,
                         stride_qn, stride_sn, stride_b, BLOCK_M, BLOCK_N, BLOCK_K, GROUP, E8M0, CHANNEL, BIAS,
                         GPT_OSS, LIMIT, ALPHA, PRECISION, EVEN_K)
    # Padding rows are stored too (zeros in, zeros out) so the down GEMM reads no uninitialised memory.
    tl.store(act_ptr + rows[:, None].to(tl.int64) * inter + cols[None, :], act.to(act_ptr.dtype.element_ty),
             mask=col_ok[None, :])


@triton.jit(do_not_specialize=["num_pairs", "num_blocks"],
            do_not_specialize_on_alignment=["ids_ptr", "slots_ptr", "weights_ptr"])
def _down_w4_kernel(act_ptr, q_ptr, s_ptr, c_ptr, b_ptr, ids_ptr, out_ptr, sorted_pairs_ptr, total_ptr, slots_ptr,
                    weights_ptr, num_pairs, hidden, inter, num_blocks, stride_qs, stride_qn, stride_ss, stride_sn,
                    stride_cs, num_bias, stride_b, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, GROUP: tl.constexpr, E8M0: tl.constexpr,
                    CHANNEL: tl.constexpr, BIAS: tl.constexpr, PRECISION: tl.constexpr, EVEN_K: tl.constexpr):
    """out[pair, h] = weight[pair] * (act[row] . w2[slot, h] + bias[pair's id, h]), one row a pair;
    ``sum_over_k`` adds up a token's k rows afterwards."""
    rows, pairs, slot, cols, col_ok, done = _pair_tile(num_blocks, hidden, total_ptr, sorted_pairs_ptr, slots_ptr,
                                                       BLOCK_M, BLOCK_N, GROUP_M)
    if done:
        return
    row_ok = pairs < num_pairs
    first = tl.load(sorted_pairs_ptr + tl.min(rows, 0))  # the block's pairs share its slot, so its bias id
    store_down_w4_rows(out_ptr, weights_ptr, pairs, act_ptr + rows.to(tl.int64) * inter, row_ok, first,
                       q_ptr + slot * stride_qs, s_ptr + slot * stride_ss, c_ptr + slot * stride_cs, b_ptr, ids_ptr,
                       cols, col_ok, hidden, inter, num_bias, stride_qn, stride_sn, stride_b, BLOCK_M, BLOCK_N,
                       BLOCK_K, GROUP, E8M0, CHANNEL, BIAS, PRECISION, EVEN_K)


def fused_grouped_swiglu_w4(hidden: torch.Tensor, weights: torch.Tensor, slots: torch.Tensor, w13: W4Bank,
                            w2: W4Bank, *, fmt: str, out_dtype: torch.dtype | None = None,
                            config: BlockConfig | None = None, bias_ids: torch.Tensor | None = None,
                            activation: str = "swiglu", groups: int | None = None) -> torch.Tensor:
    """The prefill path: ``[T, H]`` in ``out_dtype`` (default hidden's), four launches (align,
    gate_up, down, sum over k) over grids fixed by shapes and ``groups`` (``align_by_slot``); slots
    outside ``[0, S)`` contribute zero."""
    check_w4_args(hidden, weights, slots, w13, w2, fmt, activation, out_dtype, bias_ids)
    num_tokens, top_k = slots.shape
    cfg = config or default_config(num_tokens, hidden.dtype)
    check_config(cfg, fmt)
    out = torch.empty(num_tokens, hidden.shape[1], dtype=out_dtype or hidden.dtype, device=hidden.device)
    if num_tokens == 0:
        return out
    slots = slots.reshape(-1).contiguous()
    ids = slots if bias_ids is None else bias_ids.reshape(-1).contiguous()
    num_slots = w13.packed.shape[0]
    align = align_by_slot(slots, num_slots, cfg.block_m, groups=groups)
    consts = kernel_consts(fmt, hidden.dtype)
    act = _gate_up(hidden, slots, ids, w13, align, top_k, cfg, consts, activation)
    pair_out = torch.empty(slots.numel(), hidden.shape[1], dtype=hidden.dtype, device=hidden.device)
    _down(act, slots, ids, weights.reshape(-1).contiguous(), w2, align, pair_out, cfg, consts)
    sum_over_k(pair_out, slots, out, num_slots, top_k)
    return out


def _gate_up(hidden: torch.Tensor, slots: torch.Tensor, ids: torch.Tensor, bank: W4Bank, align: Alignment,
             top_k: int, cfg: BlockConfig, consts: dict, activation: str) -> torch.Tensor:
    dim, inter = hidden.shape[1], bank.packed.shape[1] // 2
    act = torch.empty(align.sorted_pairs.numel(), inter, dtype=hidden.dtype, device=hidden.device)
    (q, s, c, b), strides, bank_consts = bank_args(bank)
    n1 = cfg.block_n // 2
    _gate_up_w4_kernel[(align.num_blocks * triton.cdiv(inter, n1),)](
        hidden, q, s, c, b, ids, act, align.sorted_pairs, align.total, slots, slots.numel(), top_k, dim, inter,
        align.num_blocks, hidden.stride(0), hidden.stride(1), *strides,
        BLOCK_M=cfg.block_m, BLOCK_N=n1, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m, **consts, **bank_consts,
        **activation_consts(activation), EVEN_K=dim % cfg.block_k == 0, num_warps=cfg.num_warps,
        num_stages=cfg.num_stages)
    return act


def _down(act: torch.Tensor, slots: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, bank: W4Bank,
          align: Alignment, pair_out: torch.Tensor, cfg: BlockConfig, consts: dict) -> None:
    dim, inter = bank.packed.shape[1], act.shape[1]
    (q, s, c, b), strides, bank_consts = bank_args(bank)
    _down_w4_kernel[(align.num_blocks * triton.cdiv(dim, cfg.block_n),)](
        act, q, s, c, b, ids, pair_out, align.sorted_pairs, align.total, slots, weights, slots.numel(), dim, inter,
        align.num_blocks, *strides, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        GROUP_M=cfg.group_m, **consts, **bank_consts, EVEN_K=inter % cfg.block_k == 0, num_warps=cfg.num_warps,
        num_stages=cfg.num_stages)


# ==== the public op ====

def grouped_swiglu_w4(hidden: torch.Tensor, weights: torch.Tensor, slots: torch.Tensor, w13: W4Bank, w2: W4Bank,
                      *, fmt: str, out_dtype: torch.dtype | None = None, bias_ids: torch.Tensor | None = None,
                      activation: str = "swiglu", backend: str | None = None,
                      fill: SlotFill | None = None, groups: int | None = None) -> torch.Tensor:
    """``hidden [T, H]``, ``weights`` and ``slots [T, k]`` over 4-bit banks (``W4Bank``: packed
    codes, scales, biases) -> ``[T, H]``. CUDA tensors take the decode path up to
    ``DECODE_MAX_PAIRS`` (token, slot) pairs and the prefill path above (sized by ``groups``,
    ``align_by_slot``); anything else the eager twin (``backend`` or ``SLUICE_KERNELS`` forces one:
    ``triton_support.use_triton``). ``fill``: only where ``fills_in_gemm`` (else gather first)."""
    args = (hidden, weights, slots, w13, w2)
    kwargs = dict(fmt=fmt, out_dtype=out_dtype, bias_ids=bias_ids, activation=activation)
    if fill is not None and not fills_in_gemm(hidden, slots, backend):
        raise ValueError("this batch's path cannot fill as it computes: gather the fill first")
    if not use_triton(hidden, backend):
        return grouped_swiglu_w4_eager(*args, **kwargs)
    if slots.numel() <= DECODE_MAX_PAIRS:
        return decode_grouped_swiglu_w4(*args, **kwargs, fill=fill)
    return fused_grouped_swiglu_w4(*args, **kwargs, groups=groups)


def fills_in_gemm(hidden: torch.Tensor, slots: torch.Tensor, backend: str | None = None) -> bool:
    """Whether ``grouped_swiglu_w4`` copies a ``SlotFill`` in as it computes for this batch: a
    decode batch on the Triton path."""
    return use_triton(hidden, backend) and slots.numel() <= DECODE_MAX_PAIRS
