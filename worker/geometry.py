"""Named model geometries for benchmarks with ``--dummy-weights`` (seeded random weights, no
checkpoint on disk). ``--model qwen3-30b-geometry`` selects one instead of a directory."""
from __future__ import annotations

LIN, FULL, SLIDE = "linear_attention", "full_attention", "sliding_attention"


def _gpt_oss(layers: int, experts: int, **kw) -> dict:
    """gpt-oss's shapes: sliding (128) and full layers alternating, 64 query / 8 KV heads of 64,
    experts of 2880 with biases, top-4, YaRN as released; MXFP4 experts of 2880 are 13 MB each
    (``--expert-dtype mxfp4``; bf16 50 MB)."""
    return dict(
        architectures=["GptOssForCausalLM"], vocab_size=201088, hidden_size=2880, num_hidden_layers=layers,
        layer_types=[SLIDE if i % 2 == 0 else FULL for i in range(layers)], sliding_window=128,
        num_attention_heads=64, num_key_value_heads=8, head_dim=64, intermediate_size=2880,
        num_local_experts=experts, num_experts_per_tok=4, attention_bias=True, swiglu_limit=7.0,
        rope_parameters=dict(rope_type="yarn", rope_theta=150000.0, factor=32.0, beta_fast=32.0, beta_slow=1.0,
                             truncate=False, original_max_position_embeddings=4096),
        rms_norm_eps=1e-5, max_position_embeddings=131072, tie_word_embeddings=False, torch_dtype="bfloat16",
        eos_token_id=200002,  # <|return|>, the release's stop token
    ) | kw

GEOMETRIES: dict[str, dict] = {
    # Qwen3-30B-A3B's shapes; experts ~58 GB in bf16, ~9.4 MB each
    "qwen3-30b-geometry": dict(
        architectures=["Qwen3MoeForCausalLM"], vocab_size=151936, hidden_size=2048, num_hidden_layers=48,
        num_attention_heads=32, num_key_value_heads=4, head_dim=128, moe_intermediate_size=768,
        num_experts=128, num_experts_per_tok=8, norm_topk_prob=True, rope_theta=1e6, rms_norm_eps=1e-6,
        max_position_embeddings=262144, tie_word_embeddings=False, torch_dtype="bfloat16", eos_token_id=151645,
    ),
    # a small one with the same structure, for CPU tests of the dummy path
    "tiny-geometry": dict(
        architectures=["Qwen3MoeForCausalLM"], vocab_size=256, hidden_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, moe_intermediate_size=32, num_experts=16,
        num_experts_per_tok=4, norm_topk_prob=True, rope_theta=1e6, rms_norm_eps=1e-6,
        max_position_embeddings=4096, tie_word_embeddings=False, torch_dtype="float32", eos_token_id=255,
    ),
    # enough layers that a cache of 25% holds the prefill pipeline's 3E slots (12 x 16 / 4 = 48)
    "small-geometry": dict(
        architectures=["Qwen3MoeForCausalLM"], vocab_size=512, hidden_size=128, num_hidden_layers=12,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, moe_intermediate_size=64, num_experts=16,
        num_experts_per_tok=4, norm_topk_prob=True, rope_theta=1e6, rms_norm_eps=1e-6,
        max_position_embeddings=8192, tie_word_embeddings=False, torch_dtype="bfloat16", eos_token_id=511,
    ),
    # Qwen3.5-35B-A3B's text model: 30 Gated DeltaNet layers and 10 of gated attention (every 4th), 256
    # experts of 512 and a shared expert of 512 each layer; experts 3 x 2048 x 512 x 2 B = 6.3 MB each
    # in bf16 (3.2 MB in fp8 128x128), 40 x 256 of them = 64.4 GB; a top-8 token reads 50 MB per layer
    "qwen3.5-35b-a3b-geometry": dict(
        architectures=["Qwen3_5MoeForCausalLM"], vocab_size=248320, hidden_size=2048, num_hidden_layers=40,
        layer_types=[FULL if i % 4 == 3 else LIN for i in range(40)], num_attention_heads=16, num_key_value_heads=2,
        head_dim=256, rope_parameters=dict(rope_type="default", rope_theta=1e7, partial_rotary_factor=0.25),
        linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128, linear_value_head_dim=128,
        linear_conv_kernel_dim=4, num_experts=256, moe_intermediate_size=512, shared_expert_intermediate_size=512,
        num_experts_per_tok=8, rms_norm_eps=1e-6, max_position_embeddings=262144, tie_word_embeddings=False,
        torch_dtype="bfloat16", eos_token_id=248046,  # <|im_end|>, the release's stop token
    ),
    # the same structure at toy size (three linear layers, then a full one), for CPU tests of the dummy path
    "tiny-hybrid-geometry": dict(
        architectures=["Qwen3_5MoeForCausalLM"], vocab_size=256, hidden_size=64, num_hidden_layers=4,
        layer_types=[LIN, LIN, LIN, FULL], num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        rope_parameters=dict(rope_type="default", rope_theta=1e7, partial_rotary_factor=0.25),
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=8,
        linear_conv_kernel_dim=4, num_experts=8, moe_intermediate_size=32, shared_expert_intermediate_size=32,
        num_experts_per_tok=2, rms_norm_eps=1e-6, max_position_embeddings=4096, tie_word_embeddings=False,
        torch_dtype="float32", eos_token_id=255,
    ),
    # gpt-oss-120b: 36 layers x 128 experts (MXFP4 about 61 GB of experts); gpt-oss-20b: 24 x 32
    "gpt-oss-120b-geometry": _gpt_oss(36, 128),
    "gpt-oss-20b-geometry": _gpt_oss(24, 32),
    # the same structure at toy size, for CPU tests of the dummy path
    "tiny-gpt-oss-geometry": _gpt_oss(4, 8, vocab_size=256, hidden_size=64, num_attention_heads=4,
                                      num_key_value_heads=2, head_dim=16, intermediate_size=32, sliding_window=8,
                                      max_position_embeddings=4096, torch_dtype="float32", eos_token_id=255),
}
