"""What the families' config readers share (``worker/models/registry.py``): the layer kinds, the
linear-attention shapes, the rope type and the one-line refusal. Below ``worker.config``, so that
a family module and the config can both import it."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, NamedTuple

from worker.errors import CheckpointError

class Family(NamedTuple):
    """A family as its module declares it (``FAMILIES``); ``worker.models.registry`` keys them by
    the checkpoint's ``architectures``."""

    name: str
    architectures: tuple[str, ...]
    # (the text part of config.json, the whole of it, source) -> ModelConfig's fields; raises CheckpointError
    config_fields: Callable[[dict, dict, str], dict]
    # the part of config.json that describes the text model (a multimodal checkpoint nests it)
    text_config: Callable[[dict], dict] = lambda raw: raw
    # (ModelConfig, ModelWeights) -> Targets, for a family whose dense weights are not the classic
    # or hybrid layouts of ``worker.models.weights`` (None: those)
    targets: Callable | None = None


FULL_ATTENTION, LINEAR_ATTENTION = "full_attention", "linear_attention"
SLIDING_ATTENTION = "sliding_attention"  # full attention over the last ``sliding_window`` tokens only


@dataclass(frozen=True)
class Yarn:
    """YaRN rotary scaling as transformers' ``_compute_yarn_parameters`` reads it (gpt-oss: factor
    32 over 4,096, beta 32 / 1, no truncation); cos and sin are scaled by ``attention_factor``."""

    factor: float
    original_max_positions: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True
    attention_factor: float | None = None  # None: 0.1 ln(factor) + 1


@dataclass(frozen=True)
class LinearAttention:
    """A Gated DeltaNet layer's shapes (Qwen3-Next, Qwen3.5): q/k heads, value heads, the conv."""

    num_k_heads: int
    num_v_heads: int
    head_k_dim: int
    head_v_dim: int
    conv_kernel: int

    @property
    def key_dim(self) -> int:
        return self.num_k_heads * self.head_k_dim

    @property
    def value_dim(self) -> int:
        return self.num_v_heads * self.head_v_dim

    @property
    def conv_dim(self) -> int:
        """Channels of the conv: q, k and v."""
        return 2 * self.key_dim + self.value_dim

    @property
    def in_proj_size(self) -> int:
        """Rows of the fused input projection: q, k, v, then z, then b and a (one per value head)."""
        return self.conv_dim + self.value_dim + 2 * self.num_v_heads


def rope_type(raw: dict) -> str:
    rope = raw.get("rope_scaling") or raw.get("rope_parameters") or {}
    return rope.get("rope_type") or rope.get("type") or "default"


def refuse(problems: list[str], source: str) -> None:
    """One line naming every option of the checkpoint that Sluice cannot run."""
    if problems:
        raise CheckpointError(f"{source}: not supported: {', '.join(problems)}")
