"""The decoder every family runs: pre-norm layers of a token mixer, then a sparse MoE MLP.

The mixer is GQA attention with RoPE over paged KV (per-head q/k RMSNorm for the Qwen families;
with an output gate and partial rotary for the hybrids; with q/k/v/o biases, per-head sinks and
sliding windows for gpt-oss), or, in a hybrid model's linear layers, a Gated DeltaNet over a
recurrent state (``worker.models.gated_deltanet``). The MLP: a ``Routing``
picks each token's experts (the model's router by default), an ``Experts`` backend of
``moe_offload`` runs them, and a sigmoid-gated shared expert, where the family has one, runs
beside them on the GPU."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from moe_offload.experts import Experts
from moe_offload.routing import ModelRouting, Routing
from moe_offload.synthetic_routing import TokenKeys
from worker.attention import AttentionBackend
from worker.batch import ForwardBatch
from worker.config import ModelConfig
from worker.kv.state_pool import StatePool
from worker.models.hybrid_weights import SharedExpertWeights
from worker.models.linear import add_rms_norm_linear, linear, swiglu_linear_gated_add
from worker.models.norm import add_rms_norm
from worker.models.rotary import KVWrite, RopeInputs, Rotary
from worker.models.weights import LayerWeights, ModelWeights


class MoETransformer:
    def __init__(self, cfg: ModelConfig, weights: ModelWeights, attention: AttentionBackend, experts: Experts,
                 routing: Routing | None = None, states: StatePool | None = None,
                 window_attention: AttentionBackend | None = None):
        """``window_attention``: gpt-oss's sliding layers over their own pool of window pages (the
        batch's ``window`` tables); None: they share the full layers' pool and tables."""
        self.cfg = cfg
        self.weights = weights
        self.attention = attention
        self.window_attention = window_attention
        self.rotary = Rotary(cfg.head_dim, cfg.rope_theta, cfg.max_context, weights.embed.device, cfg.rotary_dim,
                             cfg.yarn)
        self.experts = experts
        self.routing = routing or ModelRouting(cfg.top_k, cfg.renormalize, linear)
        self.states = states
        # each layer's index among its kind: a full layer's KV layer, a linear layer's state layer, a
        # sliding layer's layer of the window pool (when it has one)
        kinds = [layer_kind(cfg, i, window_attention is not None) for i in range(cfg.num_layers)]
        self.kind_index = [kinds[:i].count(kinds[i]) for i in range(cfg.num_layers)]
        self.linear_mixer = None
        if cfg.is_hybrid:
            if states is None:
                raise ValueError("a hybrid model needs a state pool")
            from worker.models.gated_deltanet import GatedDeltaNet
            self.linear_mixer = GatedDeltaNet(cfg, states)

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """Logits (float32) of each sequence's last token: ``[B, V]``."""
        w = self.weights
        eps = self.cfg.rms_norm_eps
        self.experts.begin(batch.pipelined, self._flops(batch))
        self.routing.begin(token_keys(batch) if self.routing.uses_keys else None)
        ahead = self.experts.fetches_ahead(batch.num_tokens, self.cfg.top_k)
        x = w.embed[batch.input_ids]
        if batch.fresh_slots is not None:
            self.states.zero(batch.fresh_slots)
        moe_out = None  # the last MoE output, added to the residual stream x by the next norm
        for i, lw in enumerate(w.layers):  # each residual add is fused with the norm after it
            if lw.linear is not None:
                proj, x = add_rms_norm_linear(x, moe_out, lw.input_norm, eps, lw.linear.in_proj)
                mixer_out = self.linear_mixer(self.kind_index[i], lw.linear, proj, batch)
            else:
                mixer_out, x = self._attention(i, lw, x, moe_out, batch)
            h, x = add_rms_norm(x, mixer_out, lw.post_norm, eps)
            weights, ids = self.routing(i, h, router(lw))
            guess = self.routing.predict(i + 1, h, router(w.layers[i + 1])) if ahead and i + 1 < len(w.layers) else None
            moe_out = self.experts.forward(i, h, weights, ids, guess, pipelined=batch.pipelined, bias=lw.expert_bias,
                                           activation=self.cfg.expert_activation)
            if lw.shared is not None:
                moe_out = shared_expert(h, lw.shared, moe_out)
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
        the qkv projection, with its bias, are one launch at one token)."""
        cfg = self.cfg
        T, kv_layer = x.shape[0], self.kind_index[layer]
        qkv, x = add_rms_norm_linear(x, moe_out, lw.input_norm, cfg.rms_norm_eps, lw.qkv, lw.qkv_bias)
        q, k, v = qkv[:, :cfg.q_size + 2 * cfg.kv_size].split([cfg.q_size, cfg.kv_size, cfg.kv_size], dim=-1)
        q = q.view(T, cfg.num_heads, cfg.head_dim)
        k = k.view(T, cfg.num_kv_heads, cfg.head_dim)
        v = v.view(T, cfg.num_kv_heads, cfg.head_dim)
        norms = (lw.q_norm, lw.k_norm) if cfg.qk_norm else (None, None)
        attention, window = self.attention, cfg.window(layer)
        if window and self.window_attention is not None:
            attention, batch = self.window_attention, batch.window
        write = KVWrite(v, *attention.pool.layer_slots(kv_layer), batch.out_loc)
        rope = RopeInputs(batch.positions, self.rotary, *norms, cfg.rms_norm_eps, write)
        out = attention.forward(kv_layer, q, k, v, batch, sinks=lw.sinks, window=window, rope=rope)
        out = out.reshape(T, cfg.q_size)
        if cfg.attn_output_gate:
            out = out * torch.sigmoid(qkv[:, cfg.q_size + 2 * cfg.kv_size:])
        return linear(out, lw.o, lw.o_bias), x


def layer_kind(cfg: ModelConfig, layer: int, window_pool: bool) -> str:
    """Which pool a layer keeps its state in: "linear" (recurrent state), "window" (gpt-oss's
    sliding layers, given a pool of window pages) or "full" (the KV pool)."""
    if cfg.is_linear(layer):
        return "linear"
    return "window" if window_pool and cfg.window(layer) else "full"


def router(lw: LayerWeights) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """What ``Routing`` takes: the router's weight, with its bias where it has one (gpt-oss)."""
    return lw.router if lw.router_bias is None else (lw.router, lw.router_bias)


def shared_expert(h: torch.Tensor, w: SharedExpertWeights, routed: torch.Tensor) -> torch.Tensor:
    """``routed`` plus the shared expert's SwiGLU scaled by the sigmoid of its gate: one projection
    computes gate, up and the gate's logit, the down projection takes the rest (one launch each
    at one row, ``swiglu_linear_gated_add``)."""
    return swiglu_linear_gated_add(linear(h, w.w13), w.w2, routed)


def token_keys(batch: ForwardBatch) -> TokenKeys:
    """Each token's sequence key (its sequence's first KV page), position and id, on the device."""
    tokens = torch.arange(batch.num_tokens, device=batch.positions.device)
    sequence = torch.searchsorted(batch.last_index, tokens)
    return TokenKeys(batch.page_table[sequence, 0], batch.positions, batch.input_ids)
