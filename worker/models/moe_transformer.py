"""The decoder both families share: pre-norm GQA attention with RoPE (and per-head q/k RMSNorm for
Qwen3), then a sparse MoE MLP: a ``Routing`` picks each token's experts (the model's router by
default), an ``Experts`` backend of ``moe_offload`` runs them."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from moe_offload.experts import Experts
from moe_offload.routing import ModelRouting, Routing
from moe_offload.synthetic_routing import TokenKeys
from worker.attention import AttentionBackend
from worker.batch import ForwardBatch
from worker.config import ModelConfig
from worker.models.linear import add_rms_norm_linear, linear
from worker.models.norm import add_rms_norm
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
        self.routing = routing or ModelRouting(cfg.top_k, cfg.renormalize, linear)

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """Logits (float32) of each sequence's last token: ``[B, V]``."""
        w = self.weights
        eps = self.cfg.rms_norm_eps
        self.experts.begin(batch.pipelined, self._flops(batch))
        self.routing.begin(token_keys(batch) if self.routing.uses_keys else None)
        ahead = self.experts.fetches_ahead(batch.num_tokens, self.cfg.top_k)
        x = w.embed[batch.input_ids]
        moe_out = None  # the last MoE output, added to the residual stream x by the next norm
        for i, lw in enumerate(w.layers):  # each residual add is fused with the norm after it
            attn_out, x = self._attention(i, lw, x, moe_out, batch)
            h, x = add_rms_norm(x, attn_out, lw.post_norm, eps)
            weights, ids = self.routing(i, h, lw.router)
            guess = self.routing.predict(i + 1, h, w.layers[i + 1].router) if ahead and i + 1 < len(w.layers) else None
            moe_out = self.experts.forward(i, h, weights, ids, guess, pipelined=batch.pipelined)
        # the last residual add joins the final norm (of every token: prefill's extra rows cost nothing)
        h, _ = add_rms_norm(x, moe_out, w.final_norm, eps)
        return F.linear(h[batch.last_index], w.lm_head).float()

    def _flops(self, batch: ForwardBatch) -> float:
        """The batch's matmul work, which picks how a pipelined chunk stages experts; a decode
        step's is too small to matter, so it is not counted on that path."""
        if batch.is_decode:
            return 0.0
        prefixes = [s - n for s, n in zip(batch.seq_lens_host, batch.q_lens)]
        return self.cfg.forward_flops(batch.q_lens, prefixes)

    def _attention(self, layer: int, lw: LayerWeights, x: torch.Tensor, moe_out: torch.Tensor | None,
                   batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """The attention block's output and the residual stream ``x + moe_out`` (the input norm and
        the qkv projection are one launch at one token)."""
        cfg = self.cfg
        T = x.shape[0]
        qkv, x = add_rms_norm_linear(x, moe_out, lw.input_norm, cfg.rms_norm_eps, lw.qkv)
        q, k, v = qkv.split([cfg.q_size, cfg.kv_size, cfg.kv_size], dim=-1)
        q = q.view(T, cfg.num_heads, cfg.head_dim)
        k = k.view(T, cfg.num_kv_heads, cfg.head_dim)
        v = v.view(T, cfg.num_kv_heads, cfg.head_dim)
        norms = (lw.q_norm, lw.k_norm) if cfg.qk_norm else (None, None)
        write = KVWrite(v, *self.attention.pool.layer_slots(layer), batch.out_loc)
        q, k = qk_rope(q, k, batch.positions, self.rotary, *norms, cfg.rms_norm_eps, write=write)
        out = self.attention.forward(layer, q, k, v, batch)
        return linear(out.reshape(T, cfg.q_size), lw.o), x


def token_keys(batch: ForwardBatch) -> TokenKeys:
    """Each token's sequence key (its sequence's first KV page), position and id, on the device."""
    tokens = torch.arange(batch.num_tokens, device=batch.positions.device)
    sequence = torch.searchsorted(batch.last_index, tokens)
    return TokenKeys(batch.page_table[sequence, 0], batch.positions, batch.input_ids)
