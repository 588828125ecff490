"""gpt-oss (transformers ``gpt_oss``, ``GptOssForCausalLM``): a pre-norm GQA decoder whose layers
alternate sliding-window (128 tokens) and full attention (``layer_types``), each followed by a
routed MoE without a shared expert.

```
 attention  q/k/v/o with biases; a learned sink logit per head joins each softmax's denominator;
            YaRN rotary (factor 32 over 4,096, beta 32 / 1, no truncation; cos and sin scaled)
 router     linear with a bias, top-4, softmax over the four chosen (= softmax, top-k, renormalise)
 experts    gate_up_proj [E, H, 2I] (gate and up interleaved by column), down_proj [E, I, H], both
            with biases; clamped SwiGLU: gate = min(gate, 7), up = clamp(up, -7, 7),
            out = gate * sigmoid(1.702 gate) * (up + 1)
```

Loading lays it out for the one decoder (``worker.models.moe_transformer``): q/k/v stacked into
``qkv`` with their biases stacked alike, the experts transposed and de-interleaved into Sluice's
``w13 [E, 2I, H]`` (gate rows, then up rows; ``moe_offload.store_fill``), their biases de-interleaved
the same way and kept on the GPU beside the dense weights (``moe_offload.grouped.ExpertBias``,
indexed by expert id, so the expert cache and the prefill pipeline move no bias bytes).

The released checkpoints store the experts in MXFP4 (``*_blocks [E, 2I, H/32, 16]``, ``*_scales``,
rows by output, gate and up alternating): ``moe_offload.formats`` reads them as they are (their
rows de-interleaved at load) and the W4A16 kernels take the biases and the activation; bf16/fp32
checkpoints (``gate_up_proj [E, H, 2I]``) run too. fp8 experts with biases are refused.
"""
from __future__ import annotations

from worker.models.family_config import Family, FULL_ATTENTION, SLIDING_ATTENTION, Yarn, refuse, rope_type
from worker.models.targets import Targets

SWIGLU_LIMIT, SWIGLU_ALPHA = 7.0, 1.702  # the activation's constants, fixed in the kernels


def _fields(text: dict, raw: dict, source: str) -> dict:
    problems = []
    types = tuple(text.get("layer_types") or [SLIDING_ATTENTION if i % 2 == 0 else FULL_ATTENTION
                                              for i in range(text["num_hidden_layers"])])
    if set(types) - {SLIDING_ATTENTION, FULL_ATTENTION} or len(types) != text["num_hidden_layers"]:
        problems.append(f"layer_types {sorted(set(types))} (Sluice runs {SLIDING_ATTENTION!r} and {FULL_ATTENTION!r})")
    window = text.get("sliding_window") or 0
    if SLIDING_ATTENTION in types and window < 1:
        problems.append("sliding_attention layers without a sliding_window")
    if (text.get("swiglu_limit", SWIGLU_LIMIT), text.get("swiglu_alpha", SWIGLU_ALPHA)) != (SWIGLU_LIMIT, SWIGLU_ALPHA):
        problems.append(f"swiglu_limit/alpha {text.get('swiglu_limit')}/{text.get('swiglu_alpha')} "
                        f"(the kernels fix {SWIGLU_LIMIT}/{SWIGLU_ALPHA})")
    yarn = _yarn(text, problems)
    refuse(problems, source)
    return dict(expert_intermediate_size=text["intermediate_size"], renormalize=True, qk_norm=False,
                layer_types=types, sliding_window=window, attention_bias=bool(text.get("attention_bias", True)),
                attention_sinks=True, router_bias=True, expert_bias=True, expert_activation="gpt_oss", yarn=yarn)


def _yarn(text: dict, problems: list[str]) -> Yarn | None:
    kind = rope_type(text)
    if kind == "default":
        return None
    if kind != "yarn":
        problems.append(f"rope scaling {kind!r}")
        return None
    p = text.get("rope_parameters") or text.get("rope_scaling")
    if p.get("mscale") or p.get("mscale_all_dim") or p.get("partial_rotary_factor", 1.0) != 1.0:
        problems.append("yarn with mscale or partial rotary")
    return Yarn(float(p["factor"]), int(p["original_max_position_embeddings"]), float(p.get("beta_fast") or 32),
                float(p.get("beta_slow") or 1), bool(p.get("truncate", True)), p.get("attention_factor"))


def gpt_oss_targets(cfg, weights) -> Targets:
    """Every dense tensor of a gpt-oss checkpoint (expert biases included) for ``ModelWeights``."""
    t = Targets()
    t.direct.update({"model.embed_tokens.weight": weights.embed, "model.norm.weight": weights.final_norm})
    if not cfg.tie_word_embeddings:
        t.direct["lm_head.weight"] = weights.lm_head
    q, kv = cfg.q_size, cfg.kv_size
    for i, lw in enumerate(weights.layers):
        n, a = f"model.layers.{i}.", f"model.layers.{i}.self_attn."
        t.direct.update({n + "input_layernorm.weight": lw.input_norm, n + "post_attention_layernorm.weight": lw.post_norm,
                         a + "q_proj.weight": lw.qkv[:q], a + "k_proj.weight": lw.qkv[q:q + kv],
                         a + "v_proj.weight": lw.qkv[q + kv:], a + "o_proj.weight": lw.o, a + "sinks": lw.sinks,
                         n + "mlp.router.weight": lw.router, n + "mlp.router.bias": lw.router_bias,
                         n + "mlp.experts.down_proj_bias": lw.expert_bias.w2})
        if cfg.attention_bias:
            t.direct.update({a + "q_proj.bias": lw.qkv_bias[:q], a + "k_proj.bias": lw.qkv_bias[q:q + kv],
                             a + "v_proj.bias": lw.qkv_bias[q + kv:], a + "o_proj.bias": lw.o_bias})
        bias13 = lw.expert_bias.w13
        t.staged(n + "mlp.experts.gate_up_proj_bias", bias13, tuple(bias13.shape),
                 lambda buf, dst=bias13: dst.copy_(deinterleave(buf)))
    return t


def deinterleave(x):
    """``[..., 2I]`` with gate and up alternating (gate first) -> ``[..., 2I]`` gate | up."""
    return x.unflatten(-1, (-1, 2)).transpose(-1, -2).flatten(-2)


FAMILIES = (Family("gpt_oss", ("GptOssForCausalLM",), _fields, targets=gpt_oss_targets),)
