"""Gated DeltaNet ops for the linear-attention layers of hybrid models (Qwen3-Next, Qwen3.5-MoE):
the short causal conv over q/k/v (``conv``) and the gated delta rule (``gated_delta``), each over a
pool of per-request states indexed by slot, in a prefill form (packed sequences) and a decode
step (one token per sequence, capturable in a CUDA graph).

Each op runs Triton kernels on CUDA tensors (ours, or fla's chunked kernels for the delta-rule
prefill) and an eager twin elsewhere; the twins are the oracles of the tests.

    conv.py, conv_kernel.py                 causal_conv1d, conv1d_step
    gated_delta.py, delta_step_kernel.py    gated_delta_chunk, gated_delta_step
    delta_rule_eager.py                     the twins: chunked and recurrent
    varlen.py                               the packed layout's checks and index copies

May import: torch, triton and fla (both lazily, on first CUDA use), and the lazy-Triton plumbing of
``moe_offload.kernels.triton_support``; nothing from ``scheduler`` or ``frontend``, nor the model
families that call these ops.
"""
from worker.linear_attention.conv import causal_conv1d, conv1d_step
from worker.linear_attention.gated_delta import gated_delta_chunk, gated_delta_step

__all__ = ["causal_conv1d", "conv1d_step", "gated_delta_chunk", "gated_delta_step"]
