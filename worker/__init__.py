"""Model execution: config, safetensors loader, model families, attention backends, the paged KV
pools and their page moves (``kv/``), sampling and the ModelRunner that runs one batch.

May import: ``moe_offload`` (and torch, safetensors, tokenizers).
"""
