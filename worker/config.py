"""Model configuration read from a Hugging Face ``config.json``."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from moe_offload.fp8_checkpoint import FP8Scheme
from worker.errors import CheckpointError
from worker.quantization import parse_quantization

SUPPORTED_ARCHITECTURES = {"MixtralForCausalLM": "mixtral", "Qwen3MoeForCausalLM": "qwen3_moe"}

@dataclass(frozen=True)
class ModelConfig:
    family: str  # "mixtral" | "qwen3_moe"
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    expert_intermediate_size: int
    num_experts: int
    top_k: int
    renormalize: bool  # renormalise the top-k routing weights
    qk_norm: bool  # RMSNorm over each head of q and k (Qwen3)
    rope_theta: float
    rms_norm_eps: float
    max_context: int
    tie_word_embeddings: bool
    eos_token_ids: tuple[int, ...]
    quantization: FP8Scheme | None = None  # how the checkpoint stores fp8 weights (None: all float)

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def forward_flops(self, q_lens: list[int], prefixes: list[int]) -> float:
        """Matmul FLOPs of one forward over rows of ``q_lens`` new tokens after ``prefixes`` cached
        ones: projections, router, the routed experts, causal attention, each row's LM head."""
        H, tokens = self.hidden_size, sum(q_lens)
        dense = 2 * tokens * (H * (self.q_size + 2 * self.kv_size) + self.q_size * H + H * self.num_experts)
        moe = 2 * tokens * self.top_k * 3 * H * self.expert_intermediate_size
        attention = 4 * self.q_size * sum(n * p + n * (n + 1) / 2 for n, p in zip(q_lens, prefixes))
        return self.num_layers * (dense + moe + attention) + 2 * H * self.vocab_size * len(q_lens)

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> ModelConfig:
        """A checkpoint directory, or the name of a geometry of ``worker.geometry``."""
        from worker.geometry import GEOMETRIES

        if str(model_dir) in GEOMETRIES:
            return cls.from_dict(GEOMETRIES[str(model_dir)], source=str(model_dir))
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise CheckpointError(f"{model_dir}: no config.json (is this a Hugging Face checkpoint directory?)")
        return cls.from_dict(json.loads(path.read_text()), source=str(path))

    @classmethod
    def from_dict(cls, raw: dict, source: str = "config.json") -> ModelConfig:
        archs = raw.get("architectures") or []
        family = next((SUPPORTED_ARCHITECTURES[a] for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if family is None:
            supported = ", ".join(SUPPORTED_ARCHITECTURES)
            raise CheckpointError(f"{source}: unsupported architecture {archs or '(none)'}; Sluice runs {supported}")
        _refuse_unsupported_features(raw, family, source)
        hidden = raw["hidden_size"]
        heads = raw["num_attention_heads"]
        qwen = family == "qwen3_moe"
        return cls(
            family=family,
            vocab_size=raw["vocab_size"],
            hidden_size=hidden,
            num_layers=raw["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=raw.get("num_key_value_heads") or heads,
            head_dim=raw.get("head_dim") or hidden // heads,
            expert_intermediate_size=raw["moe_intermediate_size"] if qwen else raw["intermediate_size"],
            num_experts=raw.get("num_experts") or raw["num_local_experts"],
            top_k=raw["num_experts_per_tok"],
            renormalize=bool(raw.get("norm_topk_prob", False)) if qwen else True,
            qk_norm=qwen,
            rope_theta=float(_rope_theta(raw)),
            rms_norm_eps=float(raw["rms_norm_eps"]),
            max_context=raw.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            eos_token_ids=_int_tuple(raw.get("eos_token_id")),
            quantization=parse_quantization(raw, source),
        )


def _rope_theta(raw: dict) -> float:
    params = raw.get("rope_parameters") or {}
    return raw.get("rope_theta") or params.get("rope_theta") or 10000.0


def _refuse_unsupported_features(raw: dict, family: str, source: str) -> None:
    rope = raw.get("rope_scaling") or raw.get("rope_parameters") or {}
    rope_type = rope.get("rope_type") or rope.get("type") or "default"
    problems = []
    if rope_type != "default":
        problems.append(f"rope scaling {rope_type!r}")
    if family == "qwen3_moe":
        if raw.get("mlp_only_layers"):
            problems.append("dense mlp_only_layers")
        if raw.get("decoder_sparse_step", 1) != 1:
            problems.append("decoder_sparse_step != 1")
        if raw.get("use_sliding_window"):
            problems.append("sliding-window attention")
        if raw.get("attention_bias"):
            problems.append("attention bias")
    elif raw.get("sliding_window") and raw["sliding_window"] < raw.get("max_position_embeddings", 0):
        problems.append("sliding-window attention")
    if problems:
        raise CheckpointError(f"{source}: not supported: {', '.join(problems)}")


def _int_tuple(value) -> tuple[int, ...]:
    if value is None:
        return ()
    return tuple(value) if isinstance(value, list) else (value,)
