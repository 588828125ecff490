"""Mixtral and Qwen3-MoE: pre-norm GQA decoders with RoPE and a sparse MoE MLP in every layer
(``worker.models.moe_transformer``). They differ in checkpoint names (``checkpoint_names``), the
per-head q/k RMSNorm of Qwen3 and its optional routing renormalisation."""
from __future__ import annotations

from worker.models.family_config import Family, refuse, rope_type


def _mixtral(text: dict, raw: dict, source: str) -> dict:
    problems = [f"rope scaling {rope_type(text)!r}"] if rope_type(text) != "default" else []
    if text.get("sliding_window") and text["sliding_window"] < text.get("max_position_embeddings", 0):
        problems.append("sliding-window attention")
    refuse(problems, source)
    return dict(expert_intermediate_size=text["intermediate_size"], renormalize=True, qk_norm=False)


def _qwen3_moe(text: dict, raw: dict, source: str) -> dict:
    problems = [f"rope scaling {rope_type(text)!r}"] if rope_type(text) != "default" else []
    if text.get("mlp_only_layers"):
        problems.append("dense mlp_only_layers")
    if text.get("decoder_sparse_step", 1) != 1:
        problems.append("decoder_sparse_step != 1")
    if text.get("use_sliding_window"):
        problems.append("sliding-window attention")
    if text.get("attention_bias"):
        problems.append("attention bias")
    refuse(problems, source)
    return dict(expert_intermediate_size=text["moe_intermediate_size"],
                renormalize=bool(text.get("norm_topk_prob", False)), qk_norm=True)


FAMILIES = (Family("mixtral", ("MixtralForCausalLM",), _mixtral),
            Family("qwen3_moe", ("Qwen3MoeForCausalLM",), _qwen3_moe))
