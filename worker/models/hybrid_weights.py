"""Where a hybrid family's dense weights come from (Qwen3.5-MoE, Qwen3-Next), and how they are laid
out for the decoder: the checkpoint names, plus the few reorderings done once at load.

```
 Sluice tensor            rows, in order                               from the checkpoint
 full  qkv [2q + 2kv, H]  q | k | v | output gate                      q_proj (per head: q then gate), k_proj, v_proj;
                                                                       q and k dims in partial_rotary_order
       q_norm, k_norm [D] 1 + w, in partial_rotary_order               q_norm, k_norm
 lin.  in_proj [.., H]    q | k | v (the conv's channels) | z | b | a  in_proj_qkv, _z, _b, _a (Qwen3.5), or
                                                                       in_proj_qkvz, _ba grouped per key head (Next)
       conv [C, K], A_log, dt_bias (float32), norm [Dv], out [H, V]
 both  shared_w13 [2Is + 1, H]  gate | up | the shared expert's gate   shared_expert.gate_proj, up_proj, shared_expert_gate
       shared_w2 [H, Is], router, input_norm and post_norm (1 + w)
```
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from worker.config import ModelConfig
from worker.models.rotary import partial_rotary_order
from worker.models.targets import Targets


@dataclass
class LinearAttentionWeights:
    in_proj: torch.Tensor  # [conv_dim + value_dim + 2 Hv, H]
    conv: torch.Tensor  # [conv_dim, K]
    A_log: torch.Tensor  # [Hv] float32
    dt_bias: torch.Tensor  # [Hv] float32
    norm: torch.Tensor  # [Dv], the gated RMSNorm's weight (no offset)
    out: torch.Tensor  # [H, value_dim]


@dataclass
class SharedExpertWeights:
    w13: torch.Tensor  # [2 Is + 1, H]: gate rows, up rows, the sigmoid gate's row
    w2: torch.Tensor  # [H, Is]


def allocate_linear(cfg: ModelConfig, empty: Callable[..., torch.Tensor]) -> LinearAttentionWeights:
    la, H = cfg.linear, cfg.hidden_size
    return LinearAttentionWeights(empty(la.in_proj_size, H), empty(la.conv_dim, la.conv_kernel),
                                  empty(la.num_v_heads, dtype=torch.float32), empty(la.num_v_heads, dtype=torch.float32),
                                  empty(la.head_v_dim), empty(H, la.value_dim))


def allocate_shared(cfg: ModelConfig, empty: Callable[..., torch.Tensor]) -> SharedExpertWeights:
    return SharedExpertWeights(empty(2 * cfg.shared_expert_size + 1, cfg.hidden_size),
                               empty(cfg.hidden_size, cfg.shared_expert_size))


def offset_norm(name: str) -> bool:
    """Norms that scale by (1 + weight) in these families (the gated norm of linear attention does not)."""
    return name.endswith(("layernorm.weight", "q_norm.weight", "k_norm.weight")) or name.endswith(".norm.weight") \
        and "linear_attn" not in name


def hybrid_targets(cfg: ModelConfig, weights) -> Targets:
    """Every dense tensor of a hybrid checkpoint, for ``ModelWeights`` ``weights``."""
    p, t = cfg.weight_prefix, Targets()
    t.direct[p + "embed_tokens.weight"] = weights.embed
    _add_one(t, p + "norm.weight", weights.final_norm)
    if not cfg.tie_word_embeddings:
        t.direct["lm_head.weight"] = weights.lm_head
    for i, lw in enumerate(weights.layers):
        n = f"{p}layers.{i}."
        _add_one(t, n + "input_layernorm.weight", lw.input_norm)
        _add_one(t, n + "post_attention_layernorm.weight", lw.post_norm)
        _moe(t, cfg, n + "mlp.", lw)
        if lw.linear is not None:
            (_next_linear if cfg.family == "qwen3_next" else _linear)(t, cfg, n + "linear_attn.", lw.linear)
        else:
            _gated_attention(t, cfg, n + "self_attn.", lw)
    return t


def _add_one(t: Targets, name: str, dst: torch.Tensor) -> None:
    t.staged(name, dst, tuple(dst.shape), lambda buf: dst.copy_(buf.float() + 1.0))


def _moe(t: Targets, cfg: ModelConfig, n: str, lw) -> None:
    Is, w13 = cfg.shared_expert_size, lw.shared.w13
    t.direct.update({n + "gate.weight": lw.router, n + "shared_expert.gate_proj.weight": w13[:Is],
                     n + "shared_expert.up_proj.weight": w13[Is:2 * Is], n + "shared_expert_gate.weight": w13[2 * Is:],
                     n + "shared_expert.down_proj.weight": lw.shared.w2})


def _gated_attention(t: Targets, cfg: ModelConfig, n: str, lw) -> None:
    H, D, heads, kv = cfg.hidden_size, cfg.head_dim, cfg.num_heads, cfg.num_kv_heads
    q, k = cfg.q_size, cfg.kv_size
    order = partial_rotary_order(D, cfg.rotary_dim).to(lw.qkv.device)

    def place_q(buf):  # per head: D query rows, then D gate rows
        rows = buf.view(heads, 2, D, H)
        lw.qkv[:q].view(heads, D, H).copy_(rows[:, 0, order])
        lw.qkv[q + 2 * k:].view(heads, D, H).copy_(rows[:, 1])

    t.staged(n + "q_proj.weight", lw.qkv, (2 * q, H), place_q)
    t.staged(n + "k_proj.weight", lw.qkv, (k, H),
             lambda buf: lw.qkv[q:q + k].view(kv, D, H).copy_(buf.view(kv, D, H)[:, order]))
    t.direct[n + "v_proj.weight"] = lw.qkv[q + k:q + 2 * k]
    t.direct[n + "o_proj.weight"] = lw.o
    for name, dst in ((n + "q_norm.weight", lw.q_norm), (n + "k_norm.weight", lw.k_norm)):
        t.staged(name, dst, (D,), lambda buf, dst=dst: dst.copy_(buf.float()[order] + 1.0))


def _linear_common(t: Targets, n: str, w: LinearAttentionWeights) -> None:
    t.staged(n + "conv1d.weight", w.conv, (w.conv.shape[0], 1, w.conv.shape[1]), lambda buf: w.conv.copy_(buf[:, 0]))
    t.direct.update({n + "A_log": w.A_log, n + "dt_bias": w.dt_bias, n + "norm.weight": w.norm,
                     n + "out_proj.weight": w.out})


def _linear(t: Targets, cfg: ModelConfig, n: str, w: LinearAttentionWeights) -> None:
    la = cfg.linear
    c, v, hv = la.conv_dim, la.value_dim, la.num_v_heads
    t.direct.update({n + "in_proj_qkv.weight": w.in_proj[:c], n + "in_proj_z.weight": w.in_proj[c:c + v],
                     n + "in_proj_b.weight": w.in_proj[c + v:c + v + hv], n + "in_proj_a.weight": w.in_proj[c + v + hv:]})
    _linear_common(t, n, w)


def _next_linear(t: Targets, cfg: ModelConfig, n: str, w: LinearAttentionWeights) -> None:
    """Qwen3-Next groups its projections per key head: ``[Hk, (q Dk | k Dk | v r Dv | z r Dv)]``
    and ``[Hk, (b r | a r)]`` with r = Hv / Hk; regrouped here into Qwen3.5's q | k | v | z | b | a."""
    la, H = cfg.linear, cfg.hidden_size
    hk, dk, r = la.num_k_heads, la.head_k_dim, la.num_v_heads // la.num_k_heads
    rv = r * la.head_v_dim

    def place_qkvz(buf):
        q, k, v, z = buf.view(hk, 2 * dk + 2 * rv, H).split([dk, dk, rv, rv], dim=1)
        w.in_proj[:la.conv_dim + la.value_dim].copy_(torch.cat([x.reshape(-1, H) for x in (q, k, v, z)]))

    def place_ba(buf):
        b, a = buf.view(hk, 2 * r, H).split([r, r], dim=1)
        w.in_proj[la.conv_dim + la.value_dim:].copy_(torch.cat([b.reshape(-1, H), a.reshape(-1, H)]))

    t.staged(n + "in_proj_qkvz.weight", w.in_proj, (la.conv_dim + la.value_dim, H), place_qkvz)
    t.staged(n + "in_proj_ba.weight", w.in_proj, (2 * la.num_v_heads, H), place_ba)
    _linear_common(t, n, w)
