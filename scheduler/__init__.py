"""The scheduler process: request queue, continuous batching, chunked prefill, the radix prefix
cache, KV tier policy, the overlap loop and stats. It owns the CUDA device and its streams.

May import: ``worker``, ``moe_offload``.
"""
