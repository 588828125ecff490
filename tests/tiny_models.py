"""Tiny random Mixtral and Qwen3-MoE checkpoints written with Hugging Face transformers."""
from __future__ import annotations

from pathlib import Path

import torch


def write_tiny(path: Path, family: str, seed: int = 0, layers: int = 2, hidden: int = 64, heads: int = 4,
               kv_heads: int = 2, head_dim: int = 16, experts: int = 8, top_k: int = 2, inter: int = 32,
               vocab: int = 128, norm_topk_prob: bool = True, router_std: float = 0.3,
               weight_std: float = 0.08, bf16_weights: bool = False):
    """Write a checkpoint directory and return the HF model (float32, eval mode). With
    ``bf16_weights`` every weight is representable in bfloat16, so a bf16 run and the fp32
    reference compute the same function and differ only by the rounding of activations."""
    import transformers

    torch.manual_seed(seed)
    common = dict(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                  num_key_value_heads=kv_heads, head_dim=head_dim, num_experts_per_tok=top_k,
                  max_position_embeddings=512, rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=False,
                  eos_token_id=vocab - 1, bos_token_id=1)
    if family == "mixtral":
        config = transformers.MixtralConfig(intermediate_size=inter, num_local_experts=experts, sliding_window=None,
                                            **common)
        model = transformers.MixtralForCausalLM(config)
    else:
        config = transformers.Qwen3MoeConfig(moe_intermediate_size=inter, intermediate_size=inter * 2,
                                             num_experts=experts, norm_topk_prob=norm_topk_prob, **common)
        model = transformers.Qwen3MoeForCausalLM(config)
    with torch.no_grad():  # default init is too small to make routing and norms matter
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            else:
                p.normal_(0.0, router_std if "gate.weight" in name else weight_std)
            if bf16_weights:
                p.copy_(p.bfloat16().float())
    model.eval()
    model.save_pretrained(path)
    return model
