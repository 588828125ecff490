"""Qwen3.5/3.6-MoE and Qwen3-Next: hybrid decoders whose layers are Gated DeltaNet (linear
attention with a recurrent state) or gated GQA (an output gate, per-head q/k RMSNorm, partial
rotary), each followed by a routed MoE plus a sigmoid-gated shared expert; RMSNorms scale by
(1 + weight).

```
 family        architectures                                  text weights under       linear projections
 qwen3_5_moe   Qwen3_5MoeForConditionalGeneration (vision     model.language_model.    in_proj_qkv, in_proj_z,
               tower skipped), Qwen3_5MoeForCausalLM          / model.                 in_proj_b, in_proj_a
 qwen3_next    Qwen3NextForCausalLM                           model.                   in_proj_qkvz, in_proj_ba
                                                                                       (grouped per key head)
```

Both load into one layout (``worker.models.hybrid_weights``) and run in one decoder
(``worker.models.moe_transformer``); only names, the Qwen3-Next projections' grouping and the
config's spelling differ.
"""
from __future__ import annotations

import logging

from worker.models.family_config import Family, FULL_ATTENTION, LINEAR_ATTENTION, LinearAttention, refuse, rope_type

log = logging.getLogger("sluice.worker")
VLM = "Qwen3_5MoeForConditionalGeneration"


def _text_config(raw: dict) -> dict:
    """A multimodal checkpoint nests its text model's config under ``text_config``."""
    return raw.get("text_config") or raw


def _layer_types(text: dict, problems: list[str]) -> tuple[str, ...]:
    n = text["num_hidden_layers"]
    types = text.get("layer_types")
    if types is None:
        interval = text.get("full_attention_interval", 4)
        types = [FULL_ATTENTION if (i + 1) % interval == 0 else LINEAR_ATTENTION for i in range(n)]
    unknown = sorted(set(types) - {FULL_ATTENTION, LINEAR_ATTENTION})
    if unknown or len(types) != n:
        problems.append(f"layer_types {unknown or types} (Sluice runs {FULL_ATTENTION!r} and {LINEAR_ATTENTION!r}, "
                        f"one per layer)")
    return tuple(types)


def _rotary_dim(text: dict, head_dim: int) -> int:
    params = text.get("rope_parameters") or text.get("rope_scaling") or {}
    factor = params.get("partial_rotary_factor", text.get("partial_rotary_factor", 0.25))
    return int(head_dim * factor)


def _fields(text: dict, raw: dict, source: str, *, renormalize: bool, prefix: str) -> dict:
    problems = []
    if rope_type(text) != "default":
        problems.append(f"rope scaling {rope_type(text)!r}")
    if text.get("attention_bias"):
        problems.append("attention bias")
    if text.get("hidden_act", "silu") != "silu":
        problems.append(f"hidden_act {text['hidden_act']!r}")
    if text.get("mlp_only_layers"):
        problems.append("dense mlp_only_layers")
    if text.get("decoder_sparse_step", 1) != 1:
        problems.append("decoder_sparse_step != 1")
    layer_types = _layer_types(text, problems)
    head_dim = text.get("head_dim") or text["hidden_size"] // text["num_attention_heads"]
    rotary_dim = _rotary_dim(text, head_dim)
    if rotary_dim % 2 or not 0 < rotary_dim <= head_dim:
        problems.append(f"partial rotary of {rotary_dim} of {head_dim} dims")
    linear = LinearAttention(text["linear_num_key_heads"], text["linear_num_value_heads"],
                             text["linear_key_head_dim"], text["linear_value_head_dim"],
                             text.get("linear_conv_kernel_dim", 4))
    if linear.num_v_heads % linear.num_k_heads:
        problems.append(f"{linear.num_v_heads} linear value heads over {linear.num_k_heads} key heads")
    refuse(problems, source)
    return dict(expert_intermediate_size=text["moe_intermediate_size"], renormalize=renormalize, qk_norm=True,
                layer_types=layer_types, linear=linear, rotary_dim=rotary_dim, attn_output_gate=True,
                shared_expert_size=text.get("shared_expert_intermediate_size", 0), norm_offset=True,
                weight_prefix=prefix)


def _qwen3_5_moe(text: dict, raw: dict, source: str) -> dict:
    vlm = VLM in (raw.get("architectures") or [])
    if vlm and raw.get("vision_config"):
        log.info("%s: the vision tower is not loaded; Sluice serves the text model (image and video inputs "
                 "are refused)", source)
    return _fields(text, raw, source, renormalize=True, prefix="model.language_model." if vlm else "model.")


def _qwen3_next(text: dict, raw: dict, source: str) -> dict:
    return _fields(text, raw, source, renormalize=bool(text.get("norm_topk_prob", True)), prefix="model.")


FAMILIES = (Family("qwen3_5_moe", (VLM, "Qwen3_5MoeForCausalLM"), _qwen3_5_moe, _text_config),
            Family("qwen3_next", ("Qwen3NextForCausalLM",), _qwen3_next))
