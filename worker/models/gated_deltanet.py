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
(``worker.linear_attention``: fla's Triton kernels on CUDA, eager twins elsewhere). A chunk that
snapshots its state inside it (the prompt's last page boundary, for the prefix cache) runs the conv
and the delta rule in two passes around the copy (``ForwardBatch.state_split``); the rest of the
layer, and of the model, runs over the whole chunk once.
"""
from __future__ import annotations

import torch

from collections.abc import Callable

from worker.batch import ForwardBatch, Varlen
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
        split = batch.state_split
        if split is not None and split.order is not None:
            proj = proj.index_select(0, split.order)
        mixed, z, b, a = proj.split([la.conv_dim, la.value_dim, la.num_v_heads, la.num_v_heads], dim=-1)
        conv_state, ssm = self.states.layer(j)
        slots = batch.state_slots
        if batch.is_decode:
            mixed = conv1d_step(mixed.contiguous(), w.conv, conv_state, slots)
        else:
            mixed = mixed.contiguous()
            mixed = _in_passes(batch, conv_state,
                               lambda rows, seqs: causal_conv1d(mixed[rows], w.conv, conv_state, *seqs))
        q, k, v = mixed.split([la.key_dim, la.key_dim, la.value_dim], dim=-1)
        q = q.reshape(T, la.num_k_heads, la.head_k_dim)
        k = k.reshape(T, la.num_k_heads, la.head_k_dim)
        v = v.reshape(T, la.num_v_heads, la.head_v_dim)
        g, beta = delta_gates(a, b, w.A_log, w.dt_bias)
        if batch.is_decode:
            o = gated_delta_step(q, k, v, g, beta, ssm, slots)
        else:
            o = _in_passes(batch, ssm, lambda rows, seqs: gated_delta_chunk(
                q[rows], k[rows], v[rows], g[rows], beta[rows], ssm, *seqs))
        o = gated_rms_norm(o, z.reshape(T, la.num_v_heads, la.head_v_dim), w.norm, self.eps)
        out = linear(o.reshape(T, la.value_dim), w.out)
        return out.index_select(0, split.inverse) if split is not None and split.inverse is not None else out


def _in_passes(batch: ForwardBatch, state: torch.Tensor,
               run: Callable[[slice, Varlen], torch.Tensor]) -> torch.Tensor:
    """``run(rows, sequences)`` over a prefill batch's sequences; with a ``state_split``, over the
    heads, then the split sequences' ``state`` rows copied into their snapshot slots, then over the
    tails (the tokens in the split's order)."""
    split = batch.state_split
    if split is None:
        return run(slice(None), Varlen(batch.state_slots, batch.cu_seqlens, batch.cu_seqlens_host))
    head = run(slice(0, split.head_tokens), split.head)
    state.index_copy_(0, split.copy_to, state.index_select(0, split.copy_from))
    return torch.cat([head, run(slice(split.head_tokens, None), split.tail)])

