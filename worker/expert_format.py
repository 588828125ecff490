"""The format a checkpoint's experts are stored in: what ``--expert-dtype auto`` keeps."""
from __future__ import annotations

from pathlib import Path

import torch

from moe_offload.expert_names import CHECKPOINT_STYLES, detect_names
from moe_offload.formats import ExpertFormat, bank_specs
from moe_offload.formats.fp4_checkpoint import FP4Scheme
from moe_offload.fp8 import FP8_DTYPE
from moe_offload.safetensors_file import checkpoint_files, index_files
from worker.config import ModelConfig
from worker.errors import CheckpointError
from worker.loader import checkpoint_errors


def checkpoint_expert_format(model_dir: str | Path) -> ExpertFormat:
    """fp8 with its scale block, a 4-bit format, or the float dtype the experts are stored in
    (layer 0, expert 0 speaks for all: quantization tools treat every expert alike)."""
    from worker.geometry import GEOMETRIES

    if str(model_dir) in GEOMETRIES:  # no checkpoint: dummy weights, bf16
        return ExpertFormat(torch.bfloat16)
    cfg = ModelConfig.from_dir(model_dir)
    with checkpoint_errors():
        index = index_files(checkpoint_files(model_dir))
    try:
        probe = detect_names(index.keys(), 0, CHECKPOINT_STYLES).probe.format(layer=0, expert=0)
    except ValueError as err:
        raise CheckpointError(f"{model_dir}: {err}") from None
    if isinstance(cfg.quantization, FP4Scheme):
        fmt = cfg.quantization.stored_format(index, probe)
        if fmt is not None:
            return fmt
    if probe not in index:  # a packed name without a 4-bit quantization_config
        raise CheckpointError(f"{model_dir}: {probe} is stored packed (4-bit) but config.json declares no 4-bit "
                              "quantization_config")
    dtype = index[probe].tensor(probe).dtype
    if not dtype.is_floating_point:
        raise CheckpointError(f"{model_dir}: {probe} is {dtype} but config.json declares no 4-bit quantization")
    if dtype != FP8_DTYPE:
        return ExpertFormat(dtype)
    if cfg.quantization is None or isinstance(cfg.quantization, FP4Scheme):
        raise CheckpointError(f"{model_dir}: {probe} is float8_e4m3fn but config.json has no quantization_config for fp8")
    return ExpertFormat(FP8_DTYPE, cfg.quantization.runtime_block)


def check_fits(cfg: ModelConfig, fmt: ExpertFormat) -> None:
    """Refuse, in one line, experts whose shapes the format cannot hold (4-bit: K a multiple of its
    group, 16 or 32), before anything is allocated."""
    try:
        bank_specs(fmt, cfg.expert_intermediate_size, cfg.hidden_size)
    except ValueError as err:
        raise CheckpointError(f"--expert-dtype {fmt.name}: {err}") from None
