"""Tiny random Qwen3.5-MoE and Qwen3-Next checkpoints (linear + full attention) written with Hugging
Face transformers, and the reference logits and greedy tokens of the model that wrote them."""
from __future__ import annotations

import json
import math
import warnings
from pathlib import Path

import torch

FAMILIES = ("qwen3_5_moe", "qwen3_5_moe_causal", "qwen3_next")


def write_tiny_hybrid(path: Path, family: str, seed: int = 0,
                      layer_types: tuple[str, ...] = ("linear_attention", "full_attention"), hidden: int = 64,
                      heads: int = 4, kv_heads: int = 2, head_dim: int = 16, linear_k_heads: int = 2,
                      linear_v_heads: int = 4, linear_k_dim: int = 16, linear_v_dim: int = 8, experts: int = 8,
                      top_k: int = 2, inter: int = 32, shared_inter: int = 48, vocab: int = 128,
                      partial_rotary_factor: float = 0.25, norm_topk_prob: bool = True, max_positions: int = 512,
                      fused_experts: bool = False):
    """Write a checkpoint directory with ``save_pretrained`` and return the HF model (float32,
    eval mode). ``qwen3_5_moe`` is the released layout: the VLM with a tiny vision tower, text
    weights under ``model.language_model.``. Qwen3.5's router always renormalises its top k (its
    config has no ``norm_topk_prob``), so ``norm_topk_prob`` only reaches Qwen3-Next.

    ``save_pretrained`` writes the experts one by one (``mlp.experts.{e}.gate_proj.weight``: it
    reverts transformers' own fused layout); ``fused_experts`` then rewrites the weights file with
    the fused tensors as the model holds them (``mlp.experts.gate_up_proj [E, 2I, H]``, gate rows
    first, and ``mlp.experts.down_proj [E, H, I]``), the layout vLLM's Qwen3.5 loader also reads."""
    use_torch_gated_delta_rule()
    torch.manual_seed(seed)
    text = dict(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=len(layer_types), layer_types=list(layer_types),
                num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
                linear_num_key_heads=linear_k_heads, linear_num_value_heads=linear_v_heads,
                linear_key_head_dim=linear_k_dim, linear_value_head_dim=linear_v_dim, num_experts=experts,
                num_experts_per_tok=top_k, moe_intermediate_size=inter, shared_expert_intermediate_size=shared_inter,
                max_position_embeddings=max_positions, rms_norm_eps=1e-6, tie_word_embeddings=False,
                rope_parameters=dict(rope_type="default", rope_theta=10000.0,
                                     partial_rotary_factor=partial_rotary_factor),
                eos_token_id=vocab - 1, bos_token_id=1)
    model = _build(family, text, norm_topk_prob)
    _randomise(model)
    model.eval()
    _save_quietly(model, path)
    if fused_experts:
        _write_fused_experts(path, model)
    _check_rope(path, partial_rotary_factor)
    return model


def _build(family: str, text: dict, norm_topk_prob: bool):
    import transformers

    if family == "qwen3_5_moe":
        vision = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, patch_size=2, temporal_patch_size=2,
                      spatial_merge_size=2, out_hidden_size=text["hidden_size"], num_position_embeddings=16)
        # the VLM's ids of image and video tokens must lie inside the tiny vocabulary
        v = text["vocab_size"]
        config = transformers.Qwen3_5MoeConfig(text_config=text, vision_config=vision, tie_word_embeddings=False,
                                               image_token_id=v - 5, video_token_id=v - 4,
                                               vision_start_token_id=v - 3, vision_end_token_id=v - 2)
        return transformers.Qwen3_5MoeForConditionalGeneration(config)
    if family == "qwen3_5_moe_causal":
        return transformers.Qwen3_5MoeForCausalLM(transformers.Qwen3_5MoeTextConfig(**text))
    if family == "qwen3_next":
        config = transformers.Qwen3NextConfig(intermediate_size=text["moe_intermediate_size"] * 2,
                                              norm_topk_prob=norm_topk_prob, **text)
        return transformers.Qwen3NextForCausalLM(config)
    raise ValueError(f"unknown family {family!r}; one of {FAMILIES}")


def _randomise(model: torch.nn.Module) -> None:
    """The default init is too small (and its norms too uniform) for routing, gating and norms to
    matter, so every parameter is drawn again."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("linear_attn.norm.weight"):  # gated norm: scales by w
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            elif "norm" in name:  # zero-centred RMSNorm: scales by 1 + w
                p.normal_(0.0, 0.2)
            elif name.endswith("A_log"):
                p.copy_(torch.empty_like(p).uniform_(1.0, 16.0).log())
            elif name.endswith("dt_bias"):
                p.copy_(_dt_bias(p))
            elif "conv1d" in name:
                p.normal_(0.0, 0.3)
            elif name.endswith("mlp.gate.weight"):  # the router
                p.normal_(0.0, 0.3)
            else:
                p.normal_(0.0, 0.08)


def _dt_bias(p: torch.Tensor) -> torch.Tensor:
    """fla's Gated DeltaNet init (Mamba2's): softplus(dt_bias) = dt, log-uniform in [1e-3, 0.1].
    With dt_bias ~ N(0, 0.5) instead, g = -A softplus(a + dt_bias) decays most heads by e^-6 a
    token: the state forgets a chunk boundary within a few tokens, and the gated norm magnifies
    the tiny outputs until HF's own fp32 forward is 2.6e-4 away from fp64 (over the 1e-4 bound)."""
    dt = torch.empty_like(p).uniform_(math.log(1e-3), math.log(0.1)).exp()
    return dt + torch.log(-torch.expm1(-dt))


def _save_quietly(model, path: Path) -> None:
    """``save_pretrained`` without its progress bar."""
    from transformers.utils import logging

    shown = logging.is_progress_bar_enabled()
    logging.disable_progress_bar()
    try:
        model.save_pretrained(path)
    finally:
        if shown:
            logging.enable_progress_bar()


def _write_fused_experts(path: Path, model: torch.nn.Module) -> None:
    from safetensors.torch import save_file

    files = list(Path(path).glob("*.safetensors"))
    assert [f.name for f in files] == ["model.safetensors"], files  # tiny: one shard, no index
    state = {name: t.detach().contiguous() for name, t in model.state_dict().items()}
    assert any(name.endswith("mlp.experts.gate_up_proj") for name in state)
    save_file(state, files[0], metadata={"format": "pt"})


def _check_rope(path: Path, partial_rotary_factor: float) -> None:
    raw = json.loads((Path(path) / "config.json").read_text())
    rope = raw.get("text_config", raw)["rope_parameters"]
    assert rope["rope_type"] == "default", rope
    assert math.isclose(rope["partial_rotary_factor"], partial_rotary_factor), rope


def use_torch_gated_delta_rule() -> None:
    """Make HF's linear attention run its own torch code. With fla installed, transformers binds
    fla's Triton ``chunk_gated_delta_rule``/``fused_recurrent_gated_delta_rule`` at import
    (``use_kernel_func_from_hub_with_fallback``), and on CPU they fail ("0 active drivers"), even
    under TRITON_INTERPRET (tests/conftest.py). Each wrapper keeps the torch function as
    ``__wrapped__`` (functools.wraps) and the layers look the name up in the module's globals at
    call time, so rebinding the module attribute is enough."""
    with warnings.catch_warnings():  # fla's import warns that Triton has no device here
        warnings.simplefilter("ignore")
        from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe
        from transformers.models.qwen3_next import modeling_qwen3_next

    names = ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule", "causal_conv1d_fn",
             "causal_conv1d_update")
    for module in (modeling_qwen3_5_moe, modeling_qwen3_next):
        for name in names:
            fn = getattr(module, name)
            setattr(module, name, getattr(fn, "__wrapped__", fn))


def hf_logits(model, ids: list[int]) -> torch.Tensor:
    """[len(ids), V] float32 logits of one full forward, no cache."""
    with torch.no_grad():
        return model(torch.tensor([ids]), use_cache=False).logits[0].float()


def hf_greedy(model, ids: list[int], n: int) -> list[int]:
    """``n`` greedy tokens after ``ids``, by full forwards: the reference is the plain function,
    not HF's hybrid cache (``generate`` agrees, but stops at eos = vocab - 1, and its
    ``min_new_tokens`` would mask eos out of the argmax)."""
    out = list(ids)
    for _ in range(n):
        out.append(int(hf_logits(model, out)[-1].argmax()))
    return out[len(ids):]
