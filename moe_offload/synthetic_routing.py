"""Synthetic expert routing for dummy weights, calibrated to Qwen3-30B-A3B's decode statistics.

Seeded random weights route nearly the same experts every step, so an expert-cache benchmark on
them measures no misses. This router replaces the model's choice with a process calibrated to the
published figures for Qwen3-30B-A3B: about 45% of a layer's top-k choices repeat at the next
token, about 80% within 8 tokens, and a near-flat popularity (90% of the routing mass in about 60
of 128 experts, the top expert about 5%).

The process is a pure function of ``(layer, sequence key, position, token)``, so a token's routing
needs no state carried from the tokens before it, and prefill tokens (all at once) and decode
tokens (one a step, inside a CUDA graph) follow the same process. Each (layer, sequence) has a
working set of ``W = 2.25k`` lanes; lane ``w`` holds one expert, drawn from the layer's popularity,
for ``PERIOD`` positions at a time (its own phase), so consecutive tokens share most of the set:

```
 position      t-3  t-2  t-1   t   ...   lane w's expert changes every PERIOD positions
 lane 0        e17  e17  e17  e90        token t routes to the k lanes of highest hash(t, lane),
 lane 1        e4   e4   e4   e4         then fresh popularity draws fill in for duplicates;
 ...                                     top-k over an integer score per expert keeps ids distinct
```

A lane picked at ``t`` holds the same expert at ``t - d`` with probability ``1 - d/PERIOD`` and
is picked there with probability ``k/W``: 7/8 x 4/9 = 0.39 for the next token, plus about 0.06 of
chance repeats (popular experts drawn again), and about 0.8 for any of the last 8. Everything is
integer arithmetic on 32-bit hashes (exact on CPU and CUDA), with fixed shapes and no host reads;
the weights are normalised random positive numbers.

On CUDA ``route`` and ``guess`` are one launch each (``moe_offload.kernels.synthetic_route``) for
all the layers asked for; the torch code here (``route_eager``, ``guess_eager``: 51 and 18
launches) is their twin and the CPU path. The raw weights are integers below ``2^14``, so
their sum is exact in float32 in any order of additions and the kernel's weights are the twin's
bit for bit (CPU's and CUDA's alike).

Cross-layer prefetch guesses a layer's choices from the layer before; the model's router is not
used here, so ``guess`` stands in for that predictor: each true choice survives with probability
``GUESS_ACCURACY``, the rest are popularity draws.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from moe_offload.kernels.triton_support import use_triton

# Fitted at E = 128, k = 8 by a grid search over these four (tests/test_synthetic_routing.py measures
# the result): W = 2.25k lanes (a lane is picked with probability 4/9 per token) holding their expert
# for 8 positions; the popularity of the expert ranked r of E is (r/E + OFFSET)^-POWER, the same
# shape for any E.
LANES_PER_CHOICE = 2.25
PERIOD = 8
POPULARITY_OFFSET = 0.25
POPULARITY_POWER = 2.75
DRAW_BITS = 24  # popularity draws are 24-bit integers against an integer CDF
# raw weights are integers in [2^13, 2^14): k <= 1024 of them sum below 2^24, exactly in float32
WEIGHT_BITS = 13
# An assumption, not a fit: predictors that read the previous layer's activations reach about 15-19
# points below the 94.7% exact-match accuracy of same-layer pre-attention predictors on Qwen3-30B-A3B
# (Zhu et al. 2025, arXiv 2511.10676); taken here as the share of choices a guess gets right.
GUESS_ACCURACY = 0.78
GUESS_BITS = 16
_GUESS_KEEP = round(GUESS_ACCURACY * (1 << GUESS_BITS))  # kept: a hash's low GUESS_BITS below this
_SALTS = {"phase": 1, "lane": 2, "pick": 3, "fresh": 4, "weight": 5, "shuffle": 6, "guess": 7}
_M32 = 0xFFFFFFFF


def mix32(x):
    """The router's 32-bit hash (xorshift-multiply) of Python ints or int64 tensors holding 32-bit
    values; multipliers are below 2^31, so no int64 product overflows (the kernel's ``_mix32``
    computes the same bits in uint32)."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _M32
    x = x ^ (x >> 15)
    x = (x * 0x68E31DA5) & _M32
    return x ^ (x >> 16)


def hash_ints(*parts: int) -> int:
    h = 0x9E3779B9
    for p in parts:
        h = mix32(h ^ (p & _M32))
    return h


class TokenKeys(NamedTuple):
    """What identifies each routed token: its sequence's key, its position and its token id, ``[T]`` int64."""

    sequence: torch.Tensor
    positions: torch.Tensor
    tokens: torch.Tensor


def popularity(num_experts: int, layer: int, seed: int) -> torch.Tensor:
    """The layer's expert popularity ``[E]`` float64 (sums to 1): the fitted profile, shuffled per layer."""
    ranks = (torch.arange(num_experts, dtype=torch.float64) + 0.5) / num_experts
    profile = (ranks + POPULARITY_OFFSET) ** -POPULARITY_POWER
    order = torch.tensor([hash_ints(seed, _SALTS["shuffle"], layer, e) for e in range(num_experts)])
    return (profile / profile.sum())[torch.argsort(torch.argsort(order))]


def _cdf(pop: torch.Tensor) -> torch.Tensor:
    """Integer inclusive CDF over ``2^DRAW_BITS``, every expert at least one unit wide."""
    units = torch.clamp(torch.round(pop * ((1 << DRAW_BITS) - pop.numel())), min=0).long() + 1
    cdf = torch.cumsum(units, 0)
    cdf[-1] = 1 << DRAW_BITS
    return cdf


class SyntheticRouter:
    """Routes ``[T]`` tokens of any layers to ``top_k`` of ``num_experts`` experts (see the module doc)."""

    def __init__(self, num_layers: int, num_experts: int, top_k: int, device: torch.device | str, seed: int = 0):
        if not 1 <= top_k <= num_experts or num_layers < 1 or num_experts > 1024:
            raise ValueError(f"synthetic routing needs 1 <= top_k <= experts <= 1024 and layers >= 1, "
                             f"got {num_layers} layers, {num_experts} experts, top {top_k}")
        self.num_layers, self.num_experts, self.top_k = num_layers, num_experts, top_k
        self.lanes = min(round(LANES_PER_CHOICE * top_k), 255)
        self.cdf = torch.stack([_cdf(popularity(num_experts, i, seed)) for i in range(num_layers)]).to(device)
        seed_h = hash_ints(seed)
        self.seed_h = seed_h

        def consts(salt: str, n: int) -> torch.Tensor:  # one 32-bit constant per (layer, lane or rank)
            return torch.tensor([[hash_ints(seed_h, _SALTS[salt], i, j) for j in range(n)]
                                 for i in range(num_layers)], dtype=torch.int64, device=device)

        self.phase_c, self.lane_c = consts("phase", self.lanes), consts("lane", self.lanes)
        self.pick_c, self.fresh_c = consts("pick", self.lanes), consts("fresh", top_k)
        self.weight_c, self.guess_c = consts("weight", top_k), consts("guess", top_k)
        self.expert_bits = torch.arange(num_experts, dtype=torch.int64, device=device)

    def route(self, layers: slice, keys: TokenKeys, *,
              backend: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Float32 weights and int64 ids ``[Ls, T, k]`` of the layers in ``layers`` (a slice of the
        ``L`` layers), for tokens ``keys``. Fixed shapes, no host reads; CUDA keys run the kernel."""
        if not use_triton(keys.sequence, backend):
            return self.route_eager(layers, keys)
        from moe_offload.kernels import synthetic_route  # imports triton: only when a kernel launches

        return synthetic_route.route(keys, range(self.num_layers)[layers], self.cdf,
                                     (self.phase_c, self.lane_c, self.pick_c), (self.fresh_c, self.weight_c),
                                     self.seed_h, period=PERIOD, draw_bits=DRAW_BITS, weight_bits=WEIGHT_BITS)

    def guess(self, layers: slice, keys: TokenKeys, ids: torch.Tensor, *, backend: str | None = None) -> torch.Tensor:
        """A prefetch's guess ``[Ls, T, k]`` of the choices ``ids [Ls, T, k]`` of ``layers``: each
        kept with probability ``GUESS_ACCURACY``, else a popularity draw (duplicates allowed)."""
        if not use_triton(keys.sequence, backend):
            return self.guess_eager(layers, keys, ids)
        from moe_offload.kernels import synthetic_route

        return synthetic_route.guess(keys, range(self.num_layers)[layers], self.cdf, self.guess_c, ids, self.seed_h,
                                     draw_bits=DRAW_BITS, keep_bits=GUESS_BITS, keep_below=_GUESS_KEEP)

    def route_eager(self, layers: slice, keys: TokenKeys) -> tuple[torch.Tensor, torch.Tensor]:
        """``route``'s twin in torch ops."""
        seq, tok = self._hashes(keys)
        lane_experts = self._lanes(layers, seq, keys.positions)  # [Ls, T, W]
        pick = (mix32(tok[None, :, None] ^ self.pick_c[layers, None, :]) << 8) | torch.arange(
            self.lanes, device=seq.device)  # unique per lane, so top-k has no ties
        chosen = torch.gather(lane_experts, 2, torch.topk(pick, self.top_k, dim=2).indices)
        fresh = self._draw(layers, mix32(tok[None, :, None] ^ self.fresh_c[layers, None, :]))
        order = torch.arange(self.top_k, 0, -1, device=seq.device)
        score = torch.zeros(*chosen.shape[:2], self.num_experts, dtype=torch.int64, device=seq.device)
        score.scatter_reduce_(2, fresh, ((1 << 20) | (order << 10)).expand_as(fresh), "amax")
        score.scatter_reduce_(2, chosen, ((2 << 20) | (order << 10)).expand_as(chosen), "amax")
        ids = torch.topk(score | self.expert_bits, self.top_k, dim=2).indices
        hashed = mix32(tok[None, :, None] ^ self.weight_c[layers, None, :])
        raw = ((hashed >> (32 - WEIGHT_BITS)) | (1 << WEIGHT_BITS)).float()
        return raw / raw.sum(dim=2, keepdim=True), ids

    def guess_eager(self, layers: slice, keys: TokenKeys, ids: torch.Tensor) -> torch.Tensor:
        """``guess``'s twin in torch ops."""
        _, tok = self._hashes(keys)
        hashed = mix32(tok[None, :, None] ^ self.guess_c[layers, None, :])
        keep = (hashed & ((1 << GUESS_BITS) - 1)) < _GUESS_KEEP
        return torch.where(keep, ids, self._draw(layers, mix32(hashed)))

    def _hashes(self, keys: TokenKeys) -> tuple[torch.Tensor, torch.Tensor]:
        """Each token's sequence hash and token hash ``[T]``."""
        seq = mix32((keys.sequence & _M32) ^ self.seed_h)
        return seq, mix32(mix32(seq ^ (keys.positions & _M32)) ^ (keys.tokens & _M32))

    def _lanes(self, layers: slice, seq: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Each lane's expert at each token ``[Ls, T, W]``: a popularity draw per (lane, epoch)."""
        phase = mix32(seq[None, :, None] ^ self.phase_c[layers, None, :]) % PERIOD
        epoch = (positions[None, :, None] + phase) // PERIOD
        return self._draw(layers, mix32(mix32(seq[None, :, None] ^ self.lane_c[layers, None, :]) ^ (epoch & _M32)))

    def _draw(self, layers: slice, hashed: torch.Tensor) -> torch.Tensor:
        """Experts drawn by popularity ``[Ls, T, n]`` from 32-bit hashes ``[Ls, T, n]``."""
        draws = (hashed & ((1 << DRAW_BITS) - 1)).flatten(1)
        picked = torch.searchsorted(self.cdf[layers], draws, right=True)
        return picked.clamp(max=self.num_experts - 1).view_as(hashed)


def routing_statistics(ids: torch.Tensor, num_experts: int, window: int = 8) -> dict:
    """Measured statistics of ``ids [L, N, T, k]`` (layers, sequences, consecutive tokens): the
    fraction of choices also made at the previous token, and at any of the previous ``window``;
    the share of all choices on the most chosen expert and on the top ``60/128`` of the experts
    (per layer, then averaged). Host-side analysis, not for the hot path."""
    L, N, T, k = ids.shape
    onehot = torch.zeros(L, N, T, num_experts, dtype=torch.bool)
    onehot.scatter_(3, ids.long().cpu(), True)
    prev = onehot[:, :, :-1] & onehot[:, :, 1:]
    recent = torch.zeros_like(onehot[:, :, window:])
    for d in range(1, window + 1):
        recent |= onehot[:, :, window - d:T - d]
    within = (recent & onehot[:, :, window:]).sum() / (L * N * (T - window) * k)
    counts = onehot.sum(dim=(1, 2)).double()  # [L, E]
    share = counts / counts.sum(dim=1, keepdim=True)
    top = torch.sort(share, dim=1, descending=True).values
    head = max(1, round(num_experts * 60 / 128))
    return {"repeat_next": float(prev.sum() / (L * N * (T - 1) * k)), "repeat_within": float(within),
            "top_share": float(top[:, 0].mean()), "head_mass": float(top[:, :head].sum(dim=1).mean()),
            "head": head}


def synthetic_trace(num_layers: int, num_experts: int, top_k: int, sequences: int, tokens: int,
                    seed: int = 0, device: torch.device | str = "cpu") -> torch.Tensor:
    """Decode routing of ``sequences`` sequences over ``tokens`` positions: ids ``[L, N, T, k]``."""
    router = SyntheticRouter(num_layers, num_experts, top_k, device, seed)
    seq = torch.arange(1, sequences + 1, device=device).repeat_interleave(tokens)
    pos = torch.arange(tokens, device=device).repeat(sequences)
    _, ids = router.route(slice(None), TokenKeys(seq, pos, torch.zeros_like(pos)))
    return ids.view(num_layers, sequences, tokens, top_k)
