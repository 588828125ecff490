"""The MoE layer API that models call: ``route -> experts -> combine``.

An ``Experts`` backend turns routed expert ids into the layer's output. ``ResidentExperts`` keeps
every expert on the device and indexes the banks by expert id; the offloaded backends (expert
cache, prefill pipeline) implement the same ``forward`` and slot in behind the same API.
"""
from __future__ import annotations

from typing import NamedTuple, Protocol

import torch

from moe_offload.expert_scales import ExpertScales
from moe_offload.formats import ExpertFormat, ScaleBlock
from moe_offload.grouped import ExpertBias, bias_args, grouped_swiglu


class ExpertBanks(NamedTuple):
    """All expert weights of the model, stacked: ``w13 [L, E, 2I, H]`` (gate; up), ``w2 [L, E, H, I]``
    in a float dtype, or in a quantized format (``moe_offload.formats``) with its scale banks beside
    them: fp8 ``w13_scale [L, E, R13, C13]``, ``w2_scale [L, E, R2, C2]`` per ``scale_block``; 4-bit
    (``kind``) packed ``w13 [L, E, 2I, H/2]``, ``w2 [L, E, H, I/2]`` with group scales and, for
    nvfp4, per-row global scales ``w13_channel_scale [L, E, 2I, 1]``, ``w2_channel_scale [L, E, H, 1]``.
    """

    w13: torch.Tensor
    w2: torch.Tensor
    w13_scale: torch.Tensor | None = None
    w2_scale: torch.Tensor | None = None
    scale_block: ScaleBlock | None = None
    w13_channel_scale: torch.Tensor | None = None
    w2_channel_scale: torch.Tensor | None = None
    kind: str = ""

    @property
    def quantized(self) -> bool:
        return self.w13_scale is not None

    @property
    def format(self) -> ExpertFormat:
        return ExpertFormat(self.w13.dtype, self.scale_block, self.kind)

    def tensors(self) -> tuple[torch.Tensor, ...]:
        """The banks present, in store order: ``w13``, ``w2``, then their scale banks."""
        return tuple(t for t in (getattr(self, name) for name in BANK_NAMES) if t is not None)

    def to(self, device: torch.device | str) -> ExpertBanks:
        return self._replace(**{name: getattr(self, name).to(device) for name in BANK_NAMES
                                if getattr(self, name) is not None})

    def scales(self, layer: int) -> ExpertScales | None:
        """One layer's scales for ``grouped_swiglu`` (None for unquantized banks)."""
        if self.w13_scale is None:
            return None
        channels = [None if t is None else t[layer] for t in (self.w13_channel_scale, self.w2_channel_scale)]
        return ExpertScales(self.w13_scale[layer], self.w2_scale[layer], self.scale_block, *channels, self.kind)

    @property
    def num_layers(self) -> int:
        return self.w13.shape[0]

    @property
    def num_experts(self) -> int:
        return self.w13.shape[1]


BANK_NAMES = ("w13", "w2", "w13_scale", "w2_scale", "w13_channel_scale", "w2_channel_scale")


class Experts(Protocol):
    def pipeline_from(self, top_k: int) -> int | None:
        """The fewest tokens of a batch that streams its experts through a prefill pipeline (None:
        no batch does). A shape rule, so the batch decides once (``ForwardBatch.pipelined``) and
        the decode graphs' buckets stop below it."""
        ...

    def begin(self, pipelined: bool, flops: float = 0.0) -> None:
        """A batch starts (before layer 0's attention): a chance to start moving experts early;
        ``flops`` is its estimated matmul work (``ModelConfig.forward_flops``)."""
        ...

    def fetches_ahead(self, num_tokens: int, top_k: int) -> bool:
        """Whether a batch of this size wants each next layer's guessed ids in ``forward`` (shapes
        only): the model then asks its routing for the guess."""
        ...

    def forward(self, layer: int, hidden: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                next_ids: torch.Tensor | None = None, out_dtype: torch.dtype | None = None,
                pipelined: bool | None = None, bias: ExpertBias | None = None,
                activation: str = "silu") -> torch.Tensor:
        """``hidden [T, H]``, combine ``weights [T, k]``, expert ``ids [T, k]`` (-1: none) -> ``[T, H]``
        in ``out_dtype`` (default hidden's; see ``grouped_swiglu``); ``next_ids [T, k]``, when given,
        guesses layer ``layer + 1``'s ids (a prefetch hint: it may be wrong, and never changes a result).
        ``pipelined`` is the batch's decision (None: from ``ids``' shape, for callers without a batch).
        ``bias`` (indexed by expert id) and ``activation``: gpt-oss's experts (``grouped_swiglu``)."""
        ...

    def stats(self) -> dict[str, int | float | str]:
        """Counters for the scheduler's stats reply (none for resident experts); off the hot path."""
        ...

    def reset_stats(self) -> None:
        ...


class ResidentExperts:
    """Every expert resident on the device: no lookups at all."""

    def __init__(self, banks: ExpertBanks):
        self.banks = banks

    def pipeline_from(self, top_k: int) -> int | None:
        return None

    def begin(self, pipelined: bool, flops: float = 0.0) -> None:
        pass

    def fetches_ahead(self, num_tokens: int, top_k: int) -> bool:
        return False

    def forward(self, layer: int, hidden: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                next_ids: torch.Tensor | None = None, out_dtype: torch.dtype | None = None,
                pipelined: bool | None = None, bias: ExpertBias | None = None,
                activation: str = "silu") -> torch.Tensor:
        return grouped_swiglu(hidden, weights, ids, self.banks.w13[layer], self.banks.w2[layer],
                              scales=self.banks.scales(layer), out_dtype=out_dtype, activation=activation,
                              **bias_args(bias, ids))

    def stats(self) -> dict[str, int | float | str]:
        return {}

    def reset_stats(self) -> None:
        pass

