"""All weights of a model, allocated once on the device and filled from the checkpoint."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from moe_offload.experts import ExpertBanks
from moe_offload.formats import ExpertFormat, resolve_expert_format
from moe_offload.grouped import ExpertBias
from moe_offload.safetensors_file import checkpoint_files
from moe_offload.expert_names import detect_names
from moe_offload.store_fill import bank_layer, empty_expert_layer, load_expert_layer
from moe_offload.store_layout import ExpertGeometry
from worker.config import ModelConfig
from worker.loader import checkpoint_errors, load_tensors, open_checkpoint
from worker.models import checkpoint_names as names
from worker.models.registry import family_named
from worker.models.hybrid_weights import (LinearAttentionWeights, SharedExpertWeights, Targets, allocate_linear,
                                          allocate_shared, hybrid_targets, offset_norm)
from worker.expert_format import checkpoint_expert_format


@dataclass
class LayerWeights:
    input_norm: torch.Tensor  # [H]
    post_norm: torch.Tensor  # [H]
    qkv: torch.Tensor | None  # [q + 2 kv (+ q: the output gate), H]; None in a linear-attention layer
    o: torch.Tensor | None  # [H, q]
    q_norm: torch.Tensor | None  # [D]
    k_norm: torch.Tensor | None  # [D]
    router: torch.Tensor  # [E, H]
    linear: LinearAttentionWeights | None = None  # a linear-attention layer's (hybrid families)
    shared: SharedExpertWeights | None = None  # the shared expert beside the routed ones
    # gpt-oss (worker/models/gpt_oss.py): projection biases, per-head sink logits (float32), the
    # router's bias and the experts' biases (indexed by expert id, on the device)
    qkv_bias: torch.Tensor | None = None  # [q + 2 kv]
    o_bias: torch.Tensor | None = None  # [H]
    sinks: torch.Tensor | None = None  # [heads]
    router_bias: torch.Tensor | None = None  # [E]
    expert_bias: ExpertBias | None = None


@dataclass
class ModelWeights:
    embed: torch.Tensor  # [V, H]
    final_norm: torch.Tensor  # [H]
    lm_head: torch.Tensor  # [V, H]
    layers: list[LayerWeights]
    experts: ExpertBanks  # w13 [L, E, 2I, H], w2 [L, E, H, I]

    @classmethod
    def allocate(cls, cfg: ModelConfig, dtype: torch.dtype, device: torch.device, with_experts: bool = True,
                 expert_format: ExpertFormat | None = None) -> ModelWeights:
        """Uninitialised weights; the experts in ``expert_format`` (default: ``dtype``), or none
        (``[L, 0, ...]`` banks) without ``with_experts``."""
        def empty(*shape, dtype=dtype):
            return torch.empty(shape, dtype=dtype, device=device)

        H, E, L = cfg.hidden_size, cfg.num_experts, cfg.num_layers
        layers = [_allocate_layer(cfg, i, empty) for i in range(L)]
        embed = empty(cfg.vocab_size, H)
        lm_head = embed if cfg.tie_word_embeddings else empty(cfg.vocab_size, H)
        geometry = ExpertGeometry(L, E if with_experts else 0, H, cfg.expert_intermediate_size)
        fmt = expert_format or ExpertFormat(dtype)
        banks = empty_expert_layer(geometry, fmt, device, num_layers=(L,))
        return cls(embed, empty(H), lm_head, layers, ExpertBanks(**banks._asdict(), scale_block=fmt.scale_block,
                                                                 kind=fmt.kind))

    def targets(self, cfg: ModelConfig) -> Targets:
        """Checkpoint name -> destination, for every tensor but the experts (and the reorderings
        to run once they are read)."""
        if family_named(cfg.family).targets is not None:
            return family_named(cfg.family).targets(cfg, self)
        if cfg.is_hybrid:
            return hybrid_targets(cfg, self)
        targets = Targets()
        targets.direct.update(self._classic_targets(cfg))
        return targets

    def _classic_targets(self, cfg: ModelConfig) -> dict[str, torch.Tensor]:
        t = {names.EMBED: self.embed, names.FINAL_NORM: self.final_norm}
        if not cfg.tie_word_embeddings:
            t[names.LM_HEAD] = self.lm_head
        q, kv = cfg.q_size, cfg.kv_size
        for i, (lw, n) in enumerate((lw, names.layer_names(cfg.family, i)) for i, lw in enumerate(self.layers)):
            t.update({n.input_norm: lw.input_norm, n.post_norm: lw.post_norm, n.o: lw.o, n.router: lw.router,
                      n.q: lw.qkv[:q], n.k: lw.qkv[q:q + kv], n.v: lw.qkv[q + kv:]})
            if cfg.qk_norm:
                t.update({n.q_norm: lw.q_norm, n.k_norm: lw.k_norm})
        return t

    @classmethod
    def load(cls, model_dir: str | Path, cfg: ModelConfig, dtype: torch.dtype, device: torch.device,
             with_experts: bool = True, expert_format: ExpertFormat | None = None) -> ModelWeights:
        """Dense weights in ``dtype`` (fp8 ones dequantized). Experts in ``expert_format`` (default:
        as ``--expert-dtype auto``, the checkpoint's fp8 or else ``dtype``); with
        ``with_experts=False`` the banks are left empty (``[L, 0, ...]``): the experts then live in
        the expert store."""
        with checkpoint_errors():
            files = checkpoint_files(model_dir)
        if with_experts and expert_format is None:
            expert_format = resolve_expert_format("auto", checkpoint_expert_format(model_dir), dtype)
        weights = cls.allocate(cfg, dtype, device, with_experts, expert_format)
        targets = weights.targets(cfg)
        load_tensors(files, targets.direct, label="loading weights", scheme=cfg.quantization)
        targets.finish()
        if with_experts:
            load_resident_experts(files, cfg, weights.experts, expert_format)
        return weights

    @classmethod
    def random(cls, cfg: ModelConfig, dtype: torch.dtype, device: torch.device, seed: int,
               with_experts: bool = True) -> ModelWeights:
        """Seeded random weights (``--dummy-weights``): norms 1, matrices N(0, 0.02)."""
        weights = cls.allocate(cfg, dtype, device, with_experts)
        gen = torch.Generator(device=device).manual_seed(seed)
        targets = weights.targets(cfg)
        for name, t in targets.direct.items():
            if name.endswith("norm.weight"):
                t.fill_(0.0 if cfg.norm_offset and offset_norm(name) else 1.0)
            else:
                t.normal_(0.0, 0.02, generator=gen)
        targets.finish()
        weights.experts.w13.normal_(0.0, 0.02, generator=gen)
        weights.experts.w2.normal_(0.0, 0.02, generator=gen)
        return weights


def _allocate_layer(cfg: ModelConfig, layer: int, empty) -> LayerWeights:
    H, D, E = cfg.hidden_size, cfg.head_dim, cfg.num_experts
    shared = allocate_shared(cfg, empty) if cfg.shared_expert_size else None
    norms = (empty(D), empty(D)) if cfg.qk_norm else (None, None)
    if cfg.is_linear(layer):
        return LayerWeights(empty(H), empty(H), None, None, None, None, empty(E, H), allocate_linear(cfg, empty), shared)
    qkv_rows = cfg.q_size * (2 if cfg.attn_output_gate else 1) + 2 * cfg.kv_size
    return LayerWeights(empty(H), empty(H), empty(qkv_rows, H), empty(H, cfg.q_size), *norms, empty(E, H),
                        shared=shared, **_gpt_oss_extras(cfg, qkv_rows, empty))


def _gpt_oss_extras(cfg: ModelConfig, qkv_rows: int, empty) -> dict:
    H, E = cfg.hidden_size, cfg.num_experts
    extras = dict(qkv_bias=empty(qkv_rows), o_bias=empty(H)) if cfg.attention_bias else {}
    if cfg.attention_sinks:
        extras["sinks"] = empty(cfg.num_heads, dtype=torch.float32)
    if cfg.router_bias:
        extras["router_bias"] = empty(E)
    if cfg.expert_bias:
        extras["expert_bias"] = ExpertBias(empty(E, 2 * cfg.expert_intermediate_size), empty(E, H))
    return extras


def load_resident_experts(files: list[Path], cfg: ModelConfig, banks: ExpertBanks, fmt: ExpertFormat) -> None:
    """Every layer's experts into ``banks`` (on the device), converted to ``fmt`` on the way."""
    with checkpoint_errors():
        index = open_checkpoint(files)
        style = detect_names(index.keys(), 0)
        for layer in range(cfg.num_layers):
            load_expert_layer(index, style, layer, bank_layer(banks, layer), fmt, cfg.quantization)
