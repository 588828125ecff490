"""The scheduler process: request queue, continuous batching, chunked prefill, the radix prefix
cache, KV tier policy, the overlap loop and stats, and offline generation through the same loop
(``generate``). It owns the CUDA device and its streams.

May import: ``worker``, ``moe_offload``.
"""
