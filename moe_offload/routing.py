"""Top-k routing: router logits -> (combine weights, expert ids), fixed shapes, no host reads.

A model asks a ``Routing`` for each MoE layer's choice. ``ModelRouting`` is the model's own router;
``SyntheticRouting`` replaces it for dummy weights (``synthetic_routing``); ``routing_trace``
records any routing and replays a recorded one.
"""
from __future__ import annotations

from typing import Callable, Protocol

import torch
import torch.nn.functional as F

from moe_offload.kernels.triton_support import use_triton
from moe_offload.kernels.topk_softmax import topk_softmax, topk_softmax_eager
from moe_offload.synthetic_routing import SyntheticRouter, TokenKeys

# synthetic routing computes every layer at once in ``begin`` up to this many scores (decode
# steps: one set of launches per step); bigger batches (prefill chunks) go layer by layer
ALL_LAYERS_MAX_SCORES = 1 << 22

def route(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax over all experts, keep the top k, optionally renormalise them to sum to one.

    This is the normalisation of both Mixtral (always renormalised, which equals a softmax over the
    top-k logits) and Qwen3-MoE (renormalised when ``norm_topk_prob``). Returns float32 weights
    ``[T, k]`` and int64 expert ids ``[T, k]``. One fused launch on CUDA (``kernels.topk_softmax``).
    """
    if use_triton(router_logits):
        return topk_softmax(router_logits, top_k, renormalize)
    return topk_softmax_eager(router_logits, top_k, renormalize)


class Routing(Protocol):
    uses_keys: bool  # whether ``begin`` needs the tokens' keys (else it gets None)

    def begin(self, keys: TokenKeys | None) -> None:
        """A forward pass over tokens ``keys`` starts (before layer 0)."""
        ...

    def __call__(self, layer: int, hidden: torch.Tensor, router: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Float32 weights and int64 ids ``[T, k]`` of ``layer`` for ``hidden [T, H]`` (``router [E, H]``)."""
        ...

    def predict(self, layer: int, hidden: torch.Tensor, router: torch.Tensor) -> torch.Tensor:
        """A guess of ``layer``'s int64 ids ``[T, k]`` from the layer before's ``hidden [T, H]`` and
        ``layer``'s ``router [E, H]`` (cross-layer prefetch); fixed shapes, no host reads."""
        ...


class ModelRouting:
    """The model's own router."""

    uses_keys = False

    def __init__(self, top_k: int, renormalize: bool,
                 project: Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor] = F.linear):
        self.top_k = top_k
        self.renormalize = renormalize
        self.project = project  # hidden, router weight, bias -> logits (the worker passes its one-row kernel)

    def begin(self, keys: TokenKeys | None) -> None:
        pass

    def __call__(self, layer: int, hidden: torch.Tensor, router: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``router``: the weight ``[E, H]``, or a ``(weight, bias [E])`` pair (gpt-oss)."""
        weight, bias = router if isinstance(router, tuple) else (router, None)
        return route(self.project(hidden, weight, bias), self.top_k, self.renormalize)

    def predict(self, layer: int, hidden: torch.Tensor, router: torch.Tensor) -> torch.Tensor:
        """Layer ``layer``'s router applied to the layer before's hidden state (Pre-gated MoE, HOBBIT)."""
        return self(layer, hidden, router)[1]


class SyntheticRouting:
    """The synthetic router in place of the model's (whose weights are random anyway)."""

    uses_keys = True

    def __init__(self, router: SyntheticRouter):
        self.router = router
        self.keys: TokenKeys | None = None
        self.all_layers: tuple[torch.Tensor, torch.Tensor] | None = None
        self.all_guesses: torch.Tensor | None = None

    def begin(self, keys: TokenKeys | None) -> None:
        r = self.router
        self.keys = keys
        small = keys.sequence.numel() * r.num_layers * r.num_experts <= ALL_LAYERS_MAX_SCORES
        self.all_layers = r.route(slice(None), keys) if small else None
        self.all_guesses = None

    def __call__(self, layer: int, hidden: torch.Tensor, router: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.all_layers is not None:
            weights, ids = self.all_layers
            return weights[layer], ids[layer]
        weights, ids = self.router.route(slice(layer, layer + 1), self.keys)
        return weights[0], ids[0]

    def predict(self, layer: int, hidden: torch.Tensor, router: torch.Tensor) -> torch.Tensor:
        """The synthetic stand-in for a predictor (``SyntheticRouter.guess``): every layer's guess
        at the first call of a small batch (one set of launches a step, as for the routing)."""
        if self.all_layers is None:
            return self.router.guess(slice(layer, layer + 1), self.keys, self(layer, hidden, router)[1][None])[0]
        if self.all_guesses is None:
            self.all_guesses = self.router.guess(slice(None), self.keys, self.all_layers[1])
        return self.all_guesses[layer]
