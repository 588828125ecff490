"""Tiny FP8 checkpoints in the two layouts Sluice reads, made from a random tiny model: every
Linear but the router and the LM head quantized (``fp8.quantize``), beside a float checkpoint of
exactly the dequantized weights, which is what transformers runs as the reference."""
from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import NamedTuple

import torch
from safetensors.torch import load_file, save_file

from moe_offload.fp8 import BLOCK_128, FP8_DTYPE, PER_CHANNEL, ScaleBlock, dequantize, quantize
from tests.tiny_models import write_tiny
from worker.expert_format import checkpoint_expert_format

_ACTIVATIONS = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": True, "strategy": "token"}


class Layout(NamedTuple):
    """How a layout writes one quantized weight and what its config.json says."""

    scale_suffix: str
    block: ScaleBlock | None  # None: one scale per matrix
    scale_dtype: torch.dtype
    quantization_config: dict


def _compressed_tensors(strategy: str, block: list[int] | None = None) -> dict:
    weights = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": False, "strategy": strategy,
               "block_structure": block, "group_size": None, "observer": "minmax"}
    return {"quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights,
                                          "input_activations": _ACTIVATIONS, "output_activations": None}},
            "ignore": ["lm_head", "re:.*mlp.gate$", "re:.*block_sparse_moe.gate$"], "kv_cache_scheme": None}


LAYOUTS = {
    "hf-block": Layout("_scale_inv", BLOCK_128, torch.float32,
                       {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128],
                        "modules_to_not_convert": ["lm_head"]}),
    # llm-compressor writes the scales of a bf16 model in bf16
    "ct-channel": Layout("_scale", PER_CHANNEL, torch.bfloat16, _compressed_tensors("channel")),
    "ct-tensor": Layout("_scale", None, torch.float32, _compressed_tensors("tensor")),
    "ct-block": Layout("_scale", BLOCK_128, torch.float32, _compressed_tensors("block", [128, 128])),
}

# the expert format (worker.expert_format) each layout's experts read as
EXPERT_FORMATS = {"hf-block": "fp8-b128x128", "ct-channel": "fp8-ch", "ct-tensor": "fp8-ch",
                  "ct-block": "fp8-b128x128"}


class TinyFP8(NamedTuple):
    fp8_dir: Path  # the quantized checkpoint
    float_dir: Path  # the same model dequantized, float32, no quantization_config
    hf: torch.nn.Module  # transformers on float_dir


def is_quantized(name: str, tensor: torch.Tensor, experts: bool = True) -> bool:
    """The Linears a quantization tool converts: not embeddings, norms, routers or the LM head."""
    if tensor.dim() != 2 or name in ("model.embed_tokens.weight", "lm_head.weight"):
        return False
    if name.endswith((".mlp.gate.weight", ".block_sparse_moe.gate.weight")):
        return False
    return experts or ".experts." not in name


def quantize_stored(w: torch.Tensor, layout: Layout) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(q, scale as written, w as the checkpoint means it)``."""
    block = layout.block or ScaleBlock(*w.shape)
    q, scale = quantize(w, block)
    scale = scale.to(layout.scale_dtype)
    back = dequantize(q, scale.float(), block)
    return q, (scale if layout.block else scale.reshape(1)), back


def write_tiny_fp8(root: Path, family: str, layout: str, quantize_experts: bool = True, **shape) -> TinyFP8:
    import transformers

    src, fp8_dir, float_dir = root / "src", root / f"fp8-{layout}", root / "float"
    write_tiny(src, family, **shape)
    spec = LAYOUTS[layout]
    quantized, floats = {}, {}
    for name, w in load_file(src / "model.safetensors").items():
        if is_quantized(name, w, quantize_experts):
            quantized[name], quantized[name + spec.scale_suffix], floats[name] = quantize_stored(w, spec)
        else:
            quantized[name] = floats[name] = w
    config = json.loads((src / "config.json").read_text())
    for path, tensors, cfg in ((fp8_dir, quantized, {**config, "quantization_config": spec.quantization_config}),
                               (float_dir, floats, config)):
        path.mkdir()
        save_file({k: v.contiguous() for k, v in tensors.items()}, path / "model.safetensors", metadata={"format": "pt"})
        (path / "config.json").write_text(json.dumps(cfg))
        shutil.copy(src / "generation_config.json", path)
    hf = transformers.AutoModelForCausalLM.from_pretrained(float_dir, dtype=torch.float32).eval()
    return TinyFP8(fp8_dir, float_dir, hf)


def assert_experts_stay_fp8(runner, model_dir: Path, layout: str) -> None:
    """Asserts the checkpoint at ``model_dir`` reads as ``layout``'s expert format and ``runner`` runs
    its experts as fp8, not dequantized at load."""
    assert checkpoint_expert_format(model_dir).name == EXPERT_FORMATS[layout]
    banks = runner.weights.experts
    assert banks.w13.dtype == FP8_DTYPE and banks.quantized
