"""All weights of a model, allocated once on the device and filled from the checkpoint."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from moe_offload.experts import ExpertBanks
from worker.config import ModelConfig
from worker.loader import checkpoint_files, load_tensors, tensor_names
from worker.models import checkpoint_names as names


@dataclass
class LayerWeights:
    input_norm: torch.Tensor  # [H]
    post_norm: torch.Tensor  # [H]
    qkv: torch.Tensor  # [q + 2 kv, H]
    o: torch.Tensor  # [H, q]
    q_norm: torch.Tensor | None  # [D]
    k_norm: torch.Tensor | None  # [D]
    router: torch.Tensor  # [E, H]


@dataclass
class ModelWeights:
    embed: torch.Tensor  # [V, H]
    final_norm: torch.Tensor  # [H]
    lm_head: torch.Tensor  # [V, H]
    layers: list[LayerWeights]
    experts: ExpertBanks  # w13 [L, E, 2I, H], w2 [L, E, H, I]

    @classmethod
    def allocate(cls, cfg: ModelConfig, dtype: torch.dtype, device: torch.device,
                 with_experts: bool = True) -> ModelWeights:
        def empty(*shape):
            return torch.empty(shape, dtype=dtype, device=device)

        H, D, I, E, L = cfg.hidden_size, cfg.head_dim, cfg.expert_intermediate_size, cfg.num_experts, cfg.num_layers
        layers = [
            LayerWeights(empty(H), empty(H), empty(cfg.q_size + 2 * cfg.kv_size, H), empty(H, cfg.q_size),
                         empty(D) if cfg.qk_norm else None, empty(D) if cfg.qk_norm else None, empty(E, H))
            for _ in range(L)
        ]
        embed = empty(cfg.vocab_size, H)
        lm_head = embed if cfg.tie_word_embeddings else empty(cfg.vocab_size, H)
        n = E if with_experts else 0
        banks = ExpertBanks(empty(L, n, 2 * I, H), empty(L, n, H, I))
        return cls(embed, empty(H), lm_head, layers, banks)

    def targets(self, cfg: ModelConfig, checkpoint: set[str], with_experts: bool = True) -> dict[str, torch.Tensor]:
        """Checkpoint name -> destination view, for every tensor the model needs."""
        t = {names.EMBED: self.embed, names.FINAL_NORM: self.final_norm}
        if not cfg.tie_word_embeddings:
            t[names.LM_HEAD] = self.lm_head
        q, kv = cfg.q_size, cfg.kv_size
        for i, (lw, n) in enumerate((lw, names.layer_names(cfg.family, i)) for i, lw in enumerate(self.layers)):
            t.update({n.input_norm: lw.input_norm, n.post_norm: lw.post_norm, n.o: lw.o, n.router: lw.router,
                      n.q: lw.qkv[:q], n.k: lw.qkv[q:q + kv], n.v: lw.qkv[q + kv:]})
            if cfg.qk_norm:
                t.update({n.q_norm: lw.q_norm, n.k_norm: lw.k_norm})
            if with_experts:
                t.update(expert_targets(self.experts, cfg, i, n, checkpoint))
        return t

    @classmethod
    def load(cls, model_dir: str | Path, cfg: ModelConfig, dtype: torch.dtype, device: torch.device,
             with_experts: bool = True) -> ModelWeights:
        """With ``with_experts=False`` the expert banks are left empty (``[L, 0, ...]``): the
        experts then live in the expert store."""
        files = checkpoint_files(model_dir)
        weights = cls.allocate(cfg, dtype, device, with_experts)
        load_tensors(files, weights.targets(cfg, tensor_names(files), with_experts), label="loading weights")
        return weights

    @classmethod
    def random(cls, cfg: ModelConfig, dtype: torch.dtype, device: torch.device, seed: int,
               with_experts: bool = True) -> ModelWeights:
        """Seeded random weights (``--dummy-weights``): norms 1, matrices N(0, 0.02)."""
        weights = cls.allocate(cfg, dtype, device, with_experts)
        gen = torch.Generator(device=device).manual_seed(seed)
        for name, t in weights.targets(cfg, set(), with_experts).items():
            if name.endswith("norm.weight"):
                t.fill_(1.0)
            else:
                t.normal_(0.0, 0.02, generator=gen)
        return weights


def expert_targets(banks: ExpertBanks, cfg: ModelConfig, layer: int, n: names.LayerNames,
                   checkpoint: set[str]) -> dict[str, torch.Tensor]:
    """Destinations of one layer's experts, per-expert tensors or the fused layout, whichever the
    checkpoint holds."""
    I = cfg.expert_intermediate_size
    w13, w2 = banks.w13[layer], banks.w2[layer]
    fused = n.expert_prefix + names.FUSED_GATE_UP
    if fused in checkpoint:
        return {fused: w13, n.expert_prefix + names.FUSED_DOWN: w2}
    t = {}
    for e in range(cfg.num_experts):
        p = f"{n.expert_prefix}{e}."
        t[p + n.gate + ".weight"] = w13[e, :I]
        t[p + n.up + ".weight"] = w13[e, I:]
        t[p + n.down + ".weight"] = w2[e]
    return t
