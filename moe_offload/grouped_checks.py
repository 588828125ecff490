"""The grouped GEMM's argument checks, from metadata only (the kernels do raw pointer arithmetic):
every bank's shape and dtype is what the experts' format says (``formats.bank_specs``)."""
from __future__ import annotations

import torch

from moe_offload.expert_scales import ExpertScales
from moe_offload.formats import ExpertFormat, bank_specs

FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def check_args(hidden: torch.Tensor, weights: torch.Tensor, slots: torch.Tensor,
               w13: torch.Tensor, w2: torch.Tensor, scales: ExpertScales | None) -> None:
    """``hidden [T, H]``, ``weights`` and ``slots [T, k]``, and the banks of ``S`` slots in the
    format of ``scales`` (float in hidden's dtype without)."""
    if hidden.dim() != 2 or weights.dim() != 2 or w13.dim() != 3 or w2.dim() != 3:
        raise ValueError("expected hidden [T, H], weights and slots [T, k], w13 [N, 2I, H], w2 [N, H, I]")
    num_tokens, dim = hidden.shape
    if slots.shape != weights.shape or slots.shape[0] != num_tokens or slots.shape[1] < 1:
        raise ValueError(f"slots {tuple(slots.shape)} and weights {tuple(weights.shape)} must both be [{num_tokens}, k>=1]")
    if hidden.dtype not in FLOAT_DTYPES:
        raise ValueError(f"hidden must be one of {FLOAT_DTYPES}, not {hidden.dtype}")
    fmt = scales.format if scales is not None else ExpertFormat(hidden.dtype)
    specs = bank_specs(fmt, w13.shape[1] // 2, dim)
    _check_bank("w13", w13, specs["w13"], w2.shape[0], fmt)
    _check_bank("w2", w2, specs["w2"], w2.shape[0], fmt)
    if scales is not None:
        banks = dict(zip([n for n in specs if n not in ("w13", "w2")], scales.tensors()))
        if len(banks) != len(specs) - 2 or len(scales.tensors()) != len(banks):
            raise ValueError(f"{fmt.name} experts need the scale banks {list(specs)[2:]}")
        for name, bank in banks.items():
            _check_bank(name, bank, specs[name], w2.shape[0], fmt)
    if not weights.dtype.is_floating_point or slots.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"weights must be floating point and slots int32/int64; got {weights.dtype}, {slots.dtype}")
    banks = (hidden, weights, slots, w13, w2, *(scales.tensors() if scales is not None else ()))
    if len({t.device for t in banks}) != 1:
        raise ValueError("hidden, weights, slots, w13, w2 (and scales) must be on one device")


def _check_bank(name: str, bank: torch.Tensor, spec: tuple[tuple[int, int], torch.dtype], num_slots: int,
                fmt: ExpertFormat) -> None:
    shape, dtype = (num_slots, *spec[0]), spec[1]
    if num_slots < 1 or tuple(bank.shape) != shape or bank.dtype != dtype:
        raise ValueError(f"{name} {tuple(bank.shape)} {bank.dtype} does not fit {fmt.name} experts: "
                         f"want {shape} {dtype}")
