"""Model configuration read from a Hugging Face ``config.json``."""
from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

from moe_offload.formats.fp4_checkpoint import FP4Scheme
from moe_offload.fp8_checkpoint import FP8Scheme
from worker.errors import CheckpointError
from worker.models.family_config import LINEAR_ATTENTION, SLIDING_ATTENTION, LinearAttention, Yarn
from worker.models.registry import family_for, supported_architectures
from worker.quantization import parse_quantization, with_modelopt_config

@dataclass(frozen=True)
class ModelConfig:
    family: str  # a family of worker.models.registry: "mixtral", "qwen3_moe", "qwen3_5_moe", "qwen3_next"
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
    quantization: FP8Scheme | FP4Scheme | None = None  # how the checkpoint stores quantized weights (None: all float)
    # hybrid families: each layer's token mixer; () = every layer full attention
    layer_types: tuple[str, ...] = ()
    linear: LinearAttention | None = None  # the linear-attention layers' shapes
    rotary_dim: int = 0  # rotated dims of each head (partial rotary); 0 = all of them
    attn_output_gate: bool = False  # full attention's output is scaled by sigmoid(a gate projection)
    shared_expert_size: int = 0  # intermediate size of a shared expert beside the routed ones (0: none)
    norm_offset: bool = False  # RMSNorms scale by (1 + weight): folded into the weights at load
    weight_prefix: str = "model."  # where the text model's weights start ("model.language_model." in a VLM)
    # gpt-oss: biases on q/k/v/o, the router and the experts; a learned sink logit per head; windowed
    # layers; the clamped SwiGLU ("gpt_oss", see moe_offload.grouped); YaRN rotary
    attention_bias: bool = False
    attention_sinks: bool = False
    sliding_window: int = 0  # keys a "sliding_attention" layer sees, its own token included
    router_bias: bool = False
    expert_bias: bool = False
    expert_activation: str = "silu"
    yarn: Yarn | None = None

    @property
    def is_hybrid(self) -> bool:
        return LINEAR_ATTENTION in self.layer_types

    def is_linear(self, layer: int) -> bool:
        return bool(self.layer_types) and self.layer_types[layer] == LINEAR_ATTENTION

    def window(self, layer: int) -> int:
        """Keys a query of ``layer`` attends to, its own included (0: the whole sequence)."""
        return self.sliding_window if self.layer_types and self.layer_types[layer] == SLIDING_ATTENTION else 0

    @property
    def full_layers(self) -> list[int]:
        """Layers with attention over paged KV, in order: layer ``full_layers[j]`` owns KV layer j."""
        return [i for i in range(self.num_layers) if not self.is_linear(i)]

    @property
    def linear_layers(self) -> list[int]:
        """Layers with a recurrent state, in order: layer ``linear_layers[j]`` owns state layer j."""
        return [i for i in range(self.num_layers) if self.is_linear(i)]

    @property
    def num_kv_layers(self) -> int:
        return len(self.full_layers)

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
        gate = self.q_size if self.attn_output_gate else 0
        full = 2 * tokens * (H * (self.q_size + gate + 2 * self.kv_size) + self.q_size * H)
        full += 4 * self.q_size * sum(n * p + n * (n + 1) / 2 for n, p in zip(q_lens, prefixes))
        moe = 2 * tokens * (H * self.num_experts + (self.top_k * 3 * self.expert_intermediate_size
                                                     + 3 * self.shared_expert_size) * H)
        total = self.num_kv_layers * full + self.num_layers * moe + 2 * H * self.vocab_size * len(q_lens)
        if self.linear is not None:  # projections, and the delta rule's state update and read per token
            la = self.linear
            per_token = 2 * H * (la.in_proj_size + la.value_dim) + 6 * la.num_v_heads * la.head_k_dim * la.head_v_dim
            total += len(self.linear_layers) * tokens * per_token
        return total

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> ModelConfig:
        """A checkpoint directory, or the name of a geometry of ``worker.geometry``."""
        from worker.geometry import GEOMETRIES

        if str(model_dir) in GEOMETRIES:
            return cls.from_dict(GEOMETRIES[str(model_dir)], source=str(model_dir))
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise CheckpointError(f"{model_dir}: no config.json (is this a Hugging Face checkpoint directory?)")
        cfg = cls.from_dict(with_modelopt_config(Path(model_dir), json.loads(path.read_text())), source=str(path))
        extra = [i for i in _generation_eos(Path(model_dir)) if i not in cfg.eos_token_ids]
        return replace(cfg, eos_token_ids=cfg.eos_token_ids + tuple(extra)) if extra else cfg

    @classmethod
    def from_dict(cls, raw: dict, source: str = "config.json") -> ModelConfig:
        archs = raw.get("architectures") or []
        family = family_for(archs)
        if family is None:
            supported = ", ".join(supported_architectures())
            raise CheckpointError(f"{source}: unsupported architecture {archs or '(none)'}; Sluice runs {supported}")
        text = family.text_config(raw)
        fields = family.config_fields(text, raw, source)
        hidden, heads = text["hidden_size"], text["num_attention_heads"]
        return cls(
            family=family.name,
            vocab_size=text["vocab_size"],
            hidden_size=hidden,
            num_layers=text["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=text.get("num_key_value_heads") or heads,
            head_dim=text.get("head_dim") or hidden // heads,
            num_experts=text.get("num_experts") or text["num_local_experts"],
            top_k=text["num_experts_per_tok"],
            rope_theta=float(rope_theta(text)),
            rms_norm_eps=float(text["rms_norm_eps"]),
            max_context=text.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(text.get("tie_word_embeddings", raw.get("tie_word_embeddings", False))),
            eos_token_ids=_int_tuple(text.get("eos_token_id", raw.get("eos_token_id"))),
            quantization=parse_quantization(raw, source),
            **fields,
        )


def rope_theta(raw: dict) -> float:
    params = raw.get("rope_parameters") or {}
    return raw.get("rope_theta") or params.get("rope_theta") or 10000.0


def _generation_eos(model_dir: Path) -> tuple[int, ...]:
    """The stop ids of ``generation_config.json`` (what transformers' ``generate`` stops on; gpt-oss
    names harmony's ``<|call|>`` and ``<|endoftext|>`` there beside config.json's ``<|return|>``)."""
    path = model_dir / "generation_config.json"
    if not path.is_file():
        return ()
    try:
        return _int_tuple(json.loads(path.read_text()).get("eos_token_id"))
    except (ValueError, AttributeError):
        return ()


def _int_tuple(value) -> tuple[int, ...]:
    if value is None:
        return ()
    return tuple(value) if isinstance(value, list) else (value,)
