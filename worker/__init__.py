"""Model execution: config, safetensors loader, model families, attention backends, the paged KV
pool, sampling and the ModelRunner that runs one batch.

May import: ``moe_offload`` (and torch, safetensors, tokenizers).
"""
