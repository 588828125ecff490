"""Tiny 4-bit checkpoints in the layouts Sluice reads, made from a random tiny model (quantized with
``moe_offload.fp4``), beside a float checkpoint of exactly the dequantized weights, which is what
transformers runs as the reference:

```
 layout          weights quantized                     names                                      config
 modelopt-nvfp4  every Linear but excluded ones        X.weight, X.weight_scale, X.weight_scale_2,   hf_quant_config.json
                 (lm_head, routers, layer 0's q_proj)  X.input_scale (not read)                      (exclude_modules)
 ct-nvfp4        every Linear but routers, lm_head     X.weight_packed, X.weight_scale,              compressed-tensors
                                                       X.weight_global_scale (reciprocal)            tensor_group 16
 ct-mxfp4        every Linear but routers, lm_head     X.weight_packed, X.weight_scale (e8m0)        compressed-tensors group 32
 gptoss-mxfp4    experts only, fused per layer         mlp.experts.gate_up_proj_blocks / _scales,    quant_method mxfp4
                 (Qwen3-MoE names)                     mlp.experts.down_proj_blocks / _scales
```
"""
from __future__ import annotations

import fnmatch
import json
import shutil
from pathlib import Path
from typing import NamedTuple

import torch
from safetensors.torch import load_file, save_file

from moe_offload import fp4
from tests.tiny_fp8 import is_quantized
from tests.tiny_models import write_tiny

MODELOPT_EXCLUDE = ["lm_head", "*.mlp.gate", "*.block_sparse_moe.gate", "model.layers.0.self_attn.q_proj"]


def _ct_config(weights: dict) -> dict:
    return {"quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized", "quantization_status": "compressed",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": None,
                                          "output_activations": None}},
            "ignore": ["lm_head", "re:.*mlp.gate$", "re:.*block_sparse_moe.gate$"], "kv_cache_scheme": None}


CONFIGS = {
    "ct-nvfp4": _ct_config({"num_bits": 4, "type": "float", "symmetric": True, "dynamic": False,
                            "strategy": "tensor_group", "group_size": 16}),
    "ct-mxfp4": _ct_config({"num_bits": 4, "type": "float", "symmetric": True, "dynamic": False,
                            "strategy": "group", "group_size": 32, "scale_dtype": "torch.uint8"}),
    "gptoss-mxfp4": {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn", "lm_head"]},
}
MODELOPT = {"producer": {"name": "modelopt", "version": "0.37.0"},
            "quantization": {"quant_algo": "NVFP4", "kv_cache_quant_algo": None, "group_size": 16,
                             "exclude_modules": MODELOPT_EXCLUDE}}


class TinyFP4(NamedTuple):
    fp4_dir: Path  # the quantized checkpoint
    float_dir: Path  # the same model dequantized, float32, no quantization config
    hf: torch.nn.Module  # transformers on float_dir


def _nvfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(packed, e4m3 scale, per-tensor global f32 [], w as the checkpoint means it)``."""
    packed, scale, channel = fp4.quantize_nvfp4(w)
    return packed, scale, channel[0].clone(), fp4.dequantize_nvfp4(packed, scale, channel)


def _quantize_module(name: str, w: torch.Tensor, layout: str, out: dict) -> torch.Tensor:
    """Write one Linear in ``layout`` into ``out``; returns its dequantized weight."""
    base = name.removesuffix("weight")
    if layout == "modelopt-nvfp4":
        out[name], out[base + "weight_scale"], g, back = _nvfp4(w)
        out[base + "weight_scale_2"], out[base + "input_scale"] = g, torch.tensor(1.0)
    elif layout == "ct-nvfp4":
        out[base + "weight_packed"], out[base + "weight_scale"], g, back = _nvfp4(w)
        out[base + "weight_global_scale"] = (1.0 / g).reshape(1)
        back = fp4.dequantize_nvfp4(out[base + "weight_packed"], out[base + "weight_scale"],
                                    (1.0 / out[base + "weight_global_scale"]).expand(w.shape[0]))
    else:
        out[base + "weight_packed"], out[base + "weight_scale"] = fp4.quantize_mxfp4(w)
        back = fp4.dequantize_mxfp4(out[base + "weight_packed"], out[base + "weight_scale"])
    return back


def _excluded(name: str) -> bool:
    module = name.removesuffix(".weight")
    return any(fnmatch.fnmatch(module, pattern) for pattern in MODELOPT_EXCLUDE)


def _per_module(src: dict, layout: str) -> tuple[dict, dict]:
    quantized, floats = {}, {}
    for name, w in src.items():
        if is_quantized(name, w) and not (layout == "modelopt-nvfp4" and _excluded(name)):
            floats[name] = _quantize_module(name, w, layout, quantized)
        else:
            quantized[name] = floats[name] = w
    return quantized, floats


def _gpt_oss_blocks(src: dict, layers: int, experts: int) -> tuple[dict, dict]:
    """Qwen3-MoE's experts fused per layer as gpt-oss stores MXFP4: ``NAME_blocks [E, N, K/32, 16]``."""
    quantized, floats = dict(src), dict(src)
    for layer in range(layers):
        expert = f"model.layers.{layer}.mlp.experts."
        names = {e: {p: f"{expert}{e}.{p}_proj.weight" for p in ("gate", "up", "down")} for e in range(experts)}
        for fused, parts in (("gate_up_proj", ("gate", "up")), ("down_proj", ("down",))):
            w = torch.stack([torch.cat([src[names[e][p]] for p in parts]) for e in range(experts)])
            packed, scale = fp4.quantize_mxfp4(w)
            back = fp4.dequantize_mxfp4(packed, scale)
            quantized[expert + fused + "_blocks"] = packed.reshape(*packed.shape[:-1], -1, 16)
            quantized[expert + fused + "_scales"] = scale
            rows = 0
            for p in parts:
                n = src[names[0][p]].shape[0]
                for e in range(experts):
                    floats[names[e][p]] = back[e, rows:rows + n]
                    quantized.pop(names[e][p])
                rows += n
    return quantized, floats


def write_tiny_fp4(root: Path, family: str, layout: str, **shape) -> TinyFP4:
    import transformers

    src_dir, fp4_dir, float_dir = root / "src", root / layout, root / "float"
    write_tiny(src_dir, family, **shape)
    src = load_file(src_dir / "model.safetensors")
    config = json.loads((src_dir / "config.json").read_text())
    if layout == "gptoss-mxfp4":
        quantized, floats = _gpt_oss_blocks(src, config["num_hidden_layers"], config["num_local_experts"])
    else:
        quantized, floats = _per_module(src, layout)
    fp4_config = config if layout == "modelopt-nvfp4" else {**config, "quantization_config": CONFIGS[layout]}
    for path, tensors, cfg in ((fp4_dir, quantized, fp4_config), (float_dir, floats, config)):
        path.mkdir()
        save_file({k: v.contiguous() for k, v in tensors.items()}, path / "model.safetensors", metadata={"format": "pt"})
        (path / "config.json").write_text(json.dumps(cfg))
        shutil.copy(src_dir / "generation_config.json", path)
    if layout == "modelopt-nvfp4":
        (fp4_dir / "hf_quant_config.json").write_text(json.dumps(MODELOPT))
    hf = transformers.AutoModelForCausalLM.from_pretrained(float_dir, dtype=torch.float32).eval()
    return TinyFP4(fp4_dir, float_dir, hf)
