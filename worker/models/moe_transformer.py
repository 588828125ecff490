"""The decoder both families share: pre-norm GQA attention with RoPE (and per-head q/k RMSNorm for
Qwen3), then a sparse MoE MLP: a ``Routing`` picks each token's experts (the model's router by
default), an ``Experts`` backend of ``moe_offload`` runs them."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from moe_offload.experts import Experts
from moe_offload.kernels.gemv import linear
from moe_offload.routing import ModelRouting, Routing
from moe_offload.synthetic_routing import TokenKeys
from worker.attention import AttentionBackend
from worker.batch import ForwardBatch
from worker.config import ModelConfig
from worker.models.norm import add_rms_norm, rms_norm
from worker.models.rotary import KVWrite, Rotary, qk_rope
from worker.models.weights import LayerWeights, ModelWeights


class MoETransformer:
    def __init__(self, cfg: ModelConfig, weights: ModelWeights, attention: AttentionBackend, experts: Experts,
                 routing: Routing | None = None):
        self.cfg = cfg
        self.weights = weights
        self.attention = attention
        self.rotary = Rotary(cfg.head_dim, cfg.rope_theta, cfg.max_context, weights.embed.device)
        self.experts = experts
        self.routing = routing or ModelRouting(cfg.top_k, cfg.renormalize)

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """Logits (float32) of each sequence's last token: ``[B, V]``."""
        w = self.weights
        eps = self.cfg.rms_norm_eps
        self.experts.begin(batch.pipelined, self._flops(batch))
        self.routing.begin(token_keys(batch) if self.routing.uses_keys else None)
        ahead = self.experts.fetches_ahead(batch.num_tokens, self.cfg.top_k)
        x = w.embed[batch.input_ids]
        h = rms_norm(x, w.layers[0].input_norm, eps)
        next_norms = [lw.input_norm for lw in w.layers[1:]] + [w.final_norm]
        for i, lw in enumerate(w.layers):  # each residual add is fused with the norm after it
            h, x = add_rms_norm(x, self._attention(i, lw, h, batch), lw.post_norm, eps)
            weights, ids = self.routing(i, h, lw.router)
            guess = self.routing.predict(i + 1, h, w.layers[i + 1].router) if ahead and i + 1 < len(w.layers) else None
            h, x = add_rms_norm(x, self.experts.forward(i, h, weights, ids, guess, pipelined=batch.pipelined),
                                next_norms[i], eps)
        # the last residual add joins the final norm (of every token: prefill's extra rows cost nothing)
        return F.linear(h[batch.last_index], w.lm_head).float()

    def _flops(self, batch: ForwardBatch) -> float:
        """The batch's matmul work, which picks how a pipelined chunk stages experts; a decode
        step's is too small to matter, so it is not counted on that path."""
        if batch.is_decode:
            return 0.0
        prefixes = [s - n for s, n in zip(batch.seq_lens_host, batch.q_lens)]
        return self.cfg.forward_flops(batch.q_lens, prefixes)

    def _attention(self, layer: int, lw: LayerWeights, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        cfg = self.cfg
        T = x.shape[0]
        q, k, v = linear(x, lw.qkv).split([cfg.q_size, cfg.kv_size, cfg.kv_size], dim=-1)
        q = q.view(T, cfg.num_heads, cfg.head_dim)
        k = k.view(T, cfg.num_kv_heads, cfg.head_dim)
        v = v.view(T, cfg.num_kv_heads, cfg.head_dim)
        norms = (lw.q_norm, lw.k_norm) if cfg.qk_norm else (None, None)
        write = KVWrite(v, *self.attention.pool.layer_slots(layer), batch.out_loc)
        q, k = qk_rope(q, k, batch.positions, self.rotary, *norms, cfg.rms_norm_eps, write=write)
        out = self.attention.forward(layer, q, k, v, batch)
        return linear(out.reshape(T, cfg.q_size), lw.o)


def token_keys(batch: ForwardBatch) -> TokenKeys:
    """Each token's sequence key (its sequence's first KV page), position and id, on the device."""
    tokens = torch.arange(batch.num_tokens, device=batch.positions.device)
    sequence = torch.searchsorted(batch.last_index, tokens)
    return TokenKeys(batch.page_table[sequence, 0], batch.positions, batch.input_ids)
