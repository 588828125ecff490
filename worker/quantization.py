"""A checkpoint's ``quantization_config`` (or ModelOpt's ``hf_quant_config.json``): the fp8 and
4-bit layouts Sluice runs, and one clear refusal for everything else.

```
 quant_method          what Sluice accepts                                         FP8Scheme
 fp8 (HF fine-grained) weight_block_size [128, 128] or null (one scale per matrix),  ("_scale_inv", BLOCK_128)
                       activation_scheme dynamic, float scales                      per tensor: PER_CHANNEL, repeated
 compressed-tensors    weights num_bits 8, type float, symmetric, static; strategy   ("_scale", PER_CHANNEL | BLOCK_128)
                       channel, tensor or block [128, 128]; input activations
                       dynamic or absent; no output or KV-cache quantization
 compressed-tensors    weights num_bits 4, type float: tensor_group of 16 (nvfp4)    FP4Scheme(NVFP4)
                       or group of 32 (mxfp4)                                        FP4Scheme(MXFP4)
 modelopt              quant_algo NVFP4, group_size 16, exclude_modules            FP4Scheme(NVFP4)
 mxfp4 (gpt-oss)       group of 32, e8m0 scales                                      FP4Scheme(MXFP4)
```

Sluice runs what the checkpoint's weights mean (dense ones dequantized at load, fp8 experts scaled
in the expert GEMM); a dynamic activation scheme is something a runtime may add per token, not
part of the weights, so it needs nothing from the checkpoint. Static activation scales would.
"""
from __future__ import annotations

import json
from pathlib import Path

from moe_offload.formats.fp4_checkpoint import FP4Scheme, compressed_tensors_fp4, modelopt_scheme, mxfp4_scheme
from moe_offload.fp8 import BLOCK_128, PER_CHANNEL
from moe_offload.fp8_checkpoint import FP8Scheme
from worker.errors import CheckpointError

SUPPORTED = ("Sluice runs fp8 e4m3 weights: quant_method 'fp8' with weight_block_size [128, 128] and dynamic "
             "activations, or 'compressed-tensors' float8 weights per channel, per tensor or in 128x128 blocks "
             "with dynamic or no activation quantization; or 4-bit float weights: NVFP4 (modelopt, or "
             "compressed-tensors tensor_group 16) and MXFP4 (gpt-oss's mxfp4, or compressed-tensors group 32)")


def parse_quantization(raw: dict, source: str = "config.json") -> FP8Scheme | FP4Scheme | None:
    """The scheme of ``config.json``'s ``quantization_config`` (None when there is none)."""
    qc = raw.get("quantization_config")
    if not qc:
        return None
    method = qc.get("quant_method")
    if method == "fp8":
        scheme, problem = _hf_fp8(qc)
    elif method == "compressed-tensors":
        scheme, problem = _compressed_tensors(qc)
    elif method == "modelopt":
        scheme, problem = modelopt_scheme(qc)
    elif method == "mxfp4":
        scheme, problem = mxfp4_scheme(qc)
    else:
        scheme, problem = None, _describe_other(qc)
    if problem:
        raise CheckpointError(f"{source}: unsupported quantization ({problem}); {SUPPORTED}")
    return scheme


def _hf_fp8(qc: dict) -> tuple[FP8Scheme | None, str | None]:
    block = qc.get("weight_block_size")
    activations = str(qc.get("activation_scheme", "dynamic")).lower()
    scale_fmt = qc.get("scale_fmt", "float")
    if activations != "dynamic":
        return None, f"fp8 with {activations} activation scales"
    if scale_fmt != "float":
        return None, f"fp8 with {scale_fmt} scales"
    if qc.get("expert_dtype", "fp8") != "fp8":
        return None, f"fp8 with {qc['expert_dtype']} experts"
    if block is None:
        return FP8Scheme("_scale_inv", PER_CHANNEL, per_tensor=True), None
    if list(block) != [BLOCK_128.rows, BLOCK_128.cols]:
        return None, f"fp8 with weight_block_size {list(block)}"
    return FP8Scheme("_scale_inv", BLOCK_128), None


def _compressed_tensors(qc: dict) -> tuple[FP8Scheme | None, str | None]:
    groups = list((qc.get("config_groups") or {}).values())
    if not groups:
        return None, "compressed-tensors without config_groups"
    if (qc.get("sparsity_config") or {}).get("format", "dense") != "dense":
        return None, f"compressed-tensors with {qc['sparsity_config']['format']} sparsity"
    if qc.get("kv_cache_scheme"):
        return None, "compressed-tensors with a quantized KV cache"
    schemes = set()
    for group in groups:
        scheme, problem = _ct_group(group)
        if problem:
            return None, f"compressed-tensors {problem}"
        schemes.add(scheme)
    if len(schemes) > 1:
        return None, f"compressed-tensors mixing weight strategies {sorted(s.block for s in schemes)}"
    return schemes.pop(), None


def _ct_group(group: dict) -> tuple[FP8Scheme | FP4Scheme | None, str | None]:
    weights = group.get("weights") or {}
    kind = f"{weights.get('type', '?')}{weights.get('num_bits', '?')}"
    if kind not in ("float8", "float4"):
        return None, f"{kind} weights"
    if not weights.get("symmetric", True) or weights.get("dynamic"):
        return None, "asymmetric or dynamic float8 weights"
    activations, outputs = group.get("input_activations"), group.get("output_activations")
    if outputs or (activations and not activations.get("dynamic")):
        return None, "float8 with static activation scales" if activations else "quantized output activations"
    if kind == "float4":
        return compressed_tensors_fp4(weights)
    strategy = weights.get("strategy")
    if strategy == "channel":
        return FP8Scheme("_scale", PER_CHANNEL), None
    if strategy == "tensor":
        return FP8Scheme("_scale", PER_CHANNEL, per_tensor=True), None
    if strategy == "block" and list(weights.get("block_structure") or []) == [BLOCK_128.rows, BLOCK_128.cols]:
        return FP8Scheme("_scale", BLOCK_128), None
    return None, f"float8 weights with strategy {strategy!r} {weights.get('block_structure') or ''}".rstrip()


def _describe_other(qc: dict) -> str:
    """What a foreign config says about itself: its method and bit width."""
    method = qc.get("quant_method") or qc.get("quantization_method") or "unknown method"
    bits = qc.get("bits") or qc.get("w_bit") or qc.get("num_bits")
    if qc.get("load_in_4bit") or qc.get("load_in_8bit"):
        bits = 4 if qc.get("load_in_4bit") else 8
    return f"{method}, {bits}-bit" if bits else str(method)


def with_modelopt_config(model_dir: Path, raw: dict) -> dict:
    """``config.json``'s contents, given ModelOpt's ``hf_quant_config.json`` as its
    ``quantization_config`` when it has none of its own."""
    path = model_dir / "hf_quant_config.json"
    if raw.get("quantization_config") or not path.is_file():
        return raw
    quantization = json.loads(path.read_text()).get("quantization") or {}
    return {**raw, "quantization_config": {"quant_method": "modelopt", **quantization}}
