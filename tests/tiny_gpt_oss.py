"""Tiny random gpt-oss checkpoints written with Hugging Face transformers (the released bf16
layout: ``mlp.experts.gate_up_proj [E, H, 2I]`` with gate and up interleaved, biases beside every
projection, per-head sinks), and the reference logits and greedy tokens of the model that wrote
them. Sinks and biases are drawn far from zero and the window is shorter than the prompts, so
every part of the family moves the logits."""
from __future__ import annotations

from pathlib import Path

import torch

from tests.tiny_hybrid import _save_quietly, hf_greedy, hf_logits  # noqa: F401  (re-exported for the tests)

SLIDING, FULL = "sliding_attention", "full_attention"


def write_tiny_gpt_oss(path: Path, seed: int = 0, layer_types: tuple[str, ...] = (SLIDING, FULL),
                       hidden: int = 64, heads: int = 4, kv_heads: int = 2, head_dim: int = 16, experts: int = 8,
                       top_k: int = 4, inter: int = 32, vocab: int = 128, window: int = 8,
                       max_positions: int = 2048, yarn: bool = True, dtype: torch.dtype = torch.float32):
    """Write a checkpoint directory with ``save_pretrained`` and return the HF model (eager
    attention, which is the one that adds the sinks, float32, eval mode). YaRN as the releases
    set it (factor 32, beta 32 / 1, no truncation) over a short original context, so that the
    ramp crosses the tiny head's frequencies."""
    import transformers

    torch.manual_seed(seed)
    rope = dict(rope_type="default", rope_theta=150000.0)
    if yarn:
        rope = dict(rope_type="yarn", rope_theta=150000.0, factor=32.0, beta_fast=32.0, beta_slow=1.0,
                    truncate=False, original_max_position_embeddings=max_positions // 32)
    config = transformers.GptOssConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=len(layer_types),
        layer_types=list(layer_types), num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
        num_local_experts=experts, num_experts_per_tok=top_k, sliding_window=window,
        max_position_embeddings=max_positions, rms_norm_eps=1e-5, rope_parameters=rope, tie_word_embeddings=False,
        eos_token_id=vocab - 1, bos_token_id=1, pad_token_id=0, attn_implementation="eager")
    model = transformers.GptOssForCausalLM(config)
    _randomise(model)
    model = model.to(dtype).eval()
    _save_quietly(model, path)
    return model


def _randomise(model: torch.nn.Module) -> None:
    """Every parameter drawn again, biases and sinks far from zero (the default init zeroes the
    expert biases and draws sinks at 0.02)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            elif name.endswith("sinks"):
                p.normal_(1.0, 1.5)
            elif name.endswith("router.weight"):
                p.normal_(0.0, 0.3)
            elif "bias" in name:
                p.normal_(0.0, 0.5)
            elif "experts" in name:  # large enough that the clamps at +-7 bite
                p.normal_(0.0, 0.6)
            else:
                p.normal_(0.0, 0.08)


def write_tiny_gpt_oss_mxfp4(path: Path, **kw):
    """A tiny checkpoint in the released MXFP4 layout: every layer's ``mlp.experts.gate_up_proj``
    and ``down_proj`` replaced by ``*_blocks [E, N, K/32, 16]`` (uint8, two e2m1 a byte, low nibble
    first) and ``*_scales [E, N, K/32]`` (e8m0) over the transposed matrices (rows by output), the
    biases and every other tensor as they are, ``quantization_config`` as the release declares it.
    Returns the HF model whose experts are transformers' own dequantization of those blocks
    (``convert_moe_packed_tensors``), the reference for a run of the checkpoint."""
    import json

    from safetensors.torch import load_file, save_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    from moe_offload.fp4 import quantize_mxfp4

    model = write_tiny_gpt_oss(path, **kw)
    state = load_file(path / "model.safetensors")
    for name in [n for n in state if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        matrix = state.pop(name).transpose(1, 2).contiguous()  # [E, N, K]: the release quantizes rows
        packed, scale = quantize_mxfp4(matrix)
        E, N, K = matrix.shape
        state[name + "_blocks"], state[name + "_scales"] = packed.view(E, N, K // 32, 16), scale
        param = model.get_parameter(name)
        with torch.no_grad():
            param.copy_(convert_moe_packed_tensors(state[name + "_blocks"], scale, dtype=torch.float32))
    save_file(state, path / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (path / "config.json").write_text(json.dumps(config, indent=2))
    return model
