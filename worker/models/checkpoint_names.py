"""Where each dense weight of a family lives in a Hugging Face checkpoint (the experts' names are
``moe_offload/expert_names.py``'s: the expert store reads them without the worker)."""
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


def layer_names(family: str, layer: int) -> LayerNames:
    p = f"model.layers.{layer}."
    attn = p + "self_attn."
    if family == "mixtral":
        moe = p + "block_sparse_moe."
        return LayerNames(p + "input_layernorm.weight", p + "post_attention_layernorm.weight",
                          attn + "q_proj.weight", attn + "k_proj.weight", attn + "v_proj.weight",
                          attn + "o_proj.weight", None, None, moe + "gate.weight")
    moe = p + "mlp."
    return LayerNames(p + "input_layernorm.weight", p + "post_attention_layernorm.weight",
                      attn + "q_proj.weight", attn + "k_proj.weight", attn + "v_proj.weight",
                      attn + "o_proj.weight", attn + "q_norm.weight", attn + "k_norm.weight",
                      moe + "gate.weight")


EMBED = "model.embed_tokens.weight"
FINAL_NORM = "model.norm.weight"
LM_HEAD = "lm_head.weight"
