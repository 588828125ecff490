"""Client-facing side of Sluice: the wire protocol to clients, the client library and CLI,
tokenization and chat templates, and the frontend process that spawns the scheduler.

May import: ``scheduler.messages`` only (never torch, worker or moe_offload).
"""
