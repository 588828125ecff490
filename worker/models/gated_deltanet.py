"""The Gated DeltaNet token mixer of the hybrid families (Qwen3-Next, Qwen3.5): a linear-attention
layer whose memory is a fixed-size state per sequence, not KV pages.

```
 x ─ in_proj ─┬─ q k v ─ causal conv (K taps, state: the last K-1 inputs) ─ SiLU ─┐
              ├─ z ──────────────────────────────────────────────────────────────┐ │
              ├─ b ─ sigmoid ─ beta                                               │ │
              └─ a ─ g = -exp(A_log) softplus(a + dt_bias)    gated delta rule ◀──┘ │
                                                              (state [Hv, Dk, Dv])  │
                                   out_proj ◀─ RMSNorm(o) * SiLU(z) ◀───────────────┘
```

A prefill chunk runs the chunked form over each sequence's new tokens, a decode step the one-token
recurrent update; both start from the state in the sequence's slot and leave theirs there
(``worker.linear_attention``: fla's Triton kernels on CUDA, eager twins elsewhere).
"""
from __future__ import annotations

import torch

from worker.batch import ForwardBatch
from worker.config import ModelConfig
from worker.kv.state_pool import StatePool
from worker.linear_attention.conv import causal_conv1d, conv1d_step
from worker.linear_attention.gated_delta import gated_delta_chunk, gated_delta_step
from worker.linear_attention.gates import delta_gates, gated_rms_norm
from worker.models.hybrid_weights import LinearAttentionWeights
from worker.models.linear import linear


class GatedDeltaNet:
    def __init__(self, cfg: ModelConfig, states: StatePool):
        self.la, self.eps, self.states = cfg.linear, cfg.rms_norm_eps, states

    def __call__(self, j: int, w: LinearAttentionWeights, proj: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """Linear layer ``j``'s output ``[T, H]`` from its input projection ``proj [T, in_proj_size]``."""
        la, T = self.la, proj.shape[0]
        mixed, z, b, a = proj.split([la.conv_dim, la.value_dim, la.num_v_heads, la.num_v_heads], dim=-1)
        conv_state, ssm = self.states.layer(j)
        slots = batch.state_slots
        if batch.is_decode:
            mixed = conv1d_step(mixed.contiguous(), w.conv, conv_state, slots)
        else:
            mixed = causal_conv1d(mixed.contiguous(), w.conv, conv_state, slots, batch.cu_seqlens,
                                  batch.cu_seqlens_host)
        q, k, v = mixed.split([la.key_dim, la.key_dim, la.value_dim], dim=-1)
        q = q.reshape(T, la.num_k_heads, la.head_k_dim)
        k = k.reshape(T, la.num_k_heads, la.head_k_dim)
        v = v.reshape(T, la.num_v_heads, la.head_v_dim)
        g, beta = delta_gates(a, b, w.A_log, w.dt_bias)
        if batch.is_decode:
            o = gated_delta_step(q, k, v, g, beta, ssm, slots)
        else:
            o = gated_delta_chunk(q, k, v, g, beta, ssm, slots, batch.cu_seqlens, batch.cu_seqlens_host)
        o = gated_rms_norm(o, z.reshape(T, la.num_v_heads, la.head_v_dim), w.norm, self.eps)
        return linear(o.reshape(T, la.value_dim), w.out)

