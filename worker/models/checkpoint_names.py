"""Where each weight of a family lives in a Hugging Face checkpoint."""
from __future__ import annotations

from typing import NamedTuple


class LayerNames(NamedTuple):
    input_norm: str
    post_norm: str
    q: str
    k: str
    v: str
    o: str
    q_norm: str | None
    k_norm: str | None
    router: str
    expert_prefix: str  # + "{e}.<proj>.weight" (per expert) or "gate_up_proj" (fused)
    gate: str
    up: str
    down: str


def layer_names(family: str, layer: int) -> LayerNames:
    p = f"model.layers.{layer}."
    attn = p + "self_attn."
    if family == "mixtral":
        moe = p + "block_sparse_moe."
        return LayerNames(p + "input_layernorm.weight", p + "post_attention_layernorm.weight",
                          attn + "q_proj.weight", attn + "k_proj.weight", attn + "v_proj.weight",
                          attn + "o_proj.weight", None, None, moe + "gate.weight", moe + "experts.",
                          "w1", "w3", "w2")
    moe = p + "mlp."
    return LayerNames(p + "input_layernorm.weight", p + "post_attention_layernorm.weight",
                      attn + "q_proj.weight", attn + "k_proj.weight", attn + "v_proj.weight",
                      attn + "o_proj.weight", attn + "q_norm.weight", attn + "k_norm.weight",
                      moe + "gate.weight", moe + "experts.", "gate_proj", "up_proj", "down_proj")


EMBED = "model.embed_tokens.weight"
FINAL_NORM = "model.norm.weight"
LM_HEAD = "lm_head.weight"
FUSED_GATE_UP = "gate_up_proj"  # transformers 5 style: experts.gate_up_proj [E, 2I, H]
FUSED_DOWN = "down_proj"  # experts.down_proj [E, H, I]
