"""Where the experts of each supported checkpoint style live: tensor-name templates per layer and
expert, and the probe that tells the styles apart. The dense weights' names are the model's
(``worker/models/checkpoint_names.py``); these are the only expert names."""
from __future__ import annotations

from typing import Collection, NamedTuple, Sequence

from moe_offload.checkpoint_matrix import is_stored


class ExpertNames(NamedTuple):
    """Tensor-name templates of one checkpoint style, with ``{layer}`` and ``{expert}`` to fill in.
    A per-expert style names ``gate [I, H]``, ``up [I, H]`` and ``down [H, I]``; a fused style names
    ``gate_up [E, 2I, H]`` (gate rows, then up rows) and ``down [E, H, I]`` once per layer. gpt-oss's
    fused style, told apart by its ``gate_up_bias``, is transposed: ``gate_up [E, H, 2I]`` with gate
    and up alternating by column, ``down [E, I, H]`` (its biases are the worker's dense weights)."""

    down: str
    gate: str | None = None
    up: str | None = None
    gate_up: str | None = None
    gate_up_bias: str | None = None

    @property
    def probe(self) -> str:
        """The weight whose presence identifies the style (with ``gate_up_bias``, where it has one)."""
        return self.gate_up or self.gate


_MIXTRAL = "model.layers.{layer}.block_sparse_moe.experts.{expert}."
_QWEN3_MOE = "model.layers.{layer}.mlp.experts.{expert}."
_FUSED = "model.layers.{layer}.mlp.experts."
MIXTRAL_NAMES = ExpertNames(down=_MIXTRAL + "w2.weight", gate=_MIXTRAL + "w1.weight", up=_MIXTRAL + "w3.weight")
QWEN3_MOE_NAMES = ExpertNames(
    down=_QWEN3_MOE + "down_proj.weight", gate=_QWEN3_MOE + "gate_proj.weight", up=_QWEN3_MOE + "up_proj.weight"
)
FUSED_NAMES = ExpertNames(down=_FUSED + "down_proj", gate_up=_FUSED + "gate_up_proj")  # transformers 5
GPT_OSS_NAMES = FUSED_NAMES._replace(gate_up_bias=_FUSED + "gate_up_proj_bias")


def under(prefix: str, names: ExpertNames) -> ExpertNames:
    """``names`` with the text model's weights under ``prefix`` instead of ``model.`` (a multimodal
    checkpoint keeps them under ``model.language_model.``)."""
    return ExpertNames(*(None if t is None else prefix + t.removeprefix("model.") for t in names))


_LANGUAGE_MODEL = tuple(under("model.language_model.", n) for n in (QWEN3_MOE_NAMES, FUSED_NAMES))
CHECKPOINT_STYLES = (MIXTRAL_NAMES, QWEN3_MOE_NAMES, GPT_OSS_NAMES, FUSED_NAMES, *_LANGUAGE_MODEL)


def detect_names(tensor_names: Collection[str], layer: int, styles: Sequence[ExpertNames] = CHECKPOINT_STYLES) -> ExpertNames:
    for style in styles:
        marker = style.gate_up_bias is None or style.gate_up_bias.format(layer=layer) in tensor_names
        if marker and is_stored(style.probe.format(layer=layer, expert=0), tensor_names):
            return style
    tried = [style.probe.format(layer=layer, expert=0) for style in styles]
    raise ValueError(f"no expert weights for layer {layer} in the checkpoint; looked for {tried}")
