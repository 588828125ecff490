"""Named model geometries for benchmarks with ``--dummy-weights`` (seeded random weights, no
checkpoint on disk). ``--model qwen3-30b-geometry`` selects one instead of a directory."""
from __future__ import annotations

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
}
