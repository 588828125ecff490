"""The sampler's top-k / top-p cut (worker/sampling.py) against the textbook nucleus: the smallest
prefix of the tokens sorted by probability whose mass reaches ``top_p``, at most ``top_k`` of them."""
from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from worker.sampling import SamplingTensors, sample


@dataclass
class Params:
    temperature: float
    top_k: int
    top_p: float
    seed: int | None


def nucleus(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> set[int]:
    probs = (logits.double() / temperature).softmax(-1)
    order = probs.argsort(descending=True).tolist()
    kept, mass = [], 0.0
    for token in order[:top_k or len(order)]:
        kept.append(token)
        mass += probs[token].item()
        if mass >= top_p:
            break
    return set(kept)


def draws(logits: torch.Tensor, params: Params, steps: int) -> list[int]:
    s = SamplingTensors.build([params] * steps, list(range(steps)), logits.shape[-1], torch.device("cpu"))
    return sample(logits.expand(steps, -1).contiguous(), s).tolist()


def test_top_p_keeps_the_nucleus_and_nothing_else():
    logits = torch.tensor([0.5, 0.3, 0.2]).log()  # mass before each: 0, 0.5, 0.8
    seen = set(draws(logits[None], Params(1.0, 0, 0.75, 7), 400))
    assert seen == {0, 1}


@pytest.mark.parametrize("top_k, top_p, temperature", [(0, 0.9, 1.0), (5, 1.0, 0.7), (20, 0.5, 1.3), (0, 0.3, 2.0)])
def test_samples_lie_in_the_reference_nucleus(top_k, top_p, temperature):
    gen = torch.Generator().manual_seed(top_k * 100 + int(top_p * 10))
    for trial in range(10):
        logits = torch.randn(1, 300, generator=gen) * 3
        allowed = nucleus(logits[0], temperature, top_k, top_p)
        seen = set(draws(logits, Params(temperature, top_k, top_p, trial), 200))
        assert seen <= allowed, (trial, seen - allowed)
        assert len(seen) > 1 or len(allowed) == 1


def test_greedy_rows_take_the_argmax_beside_sampled_rows():
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(3))
    params = [Params(0.0, 0, 1.0, None), Params(1.0, 0, 1.0, 1), Params(0.0, 3, 0.5, 2)]
    s = SamplingTensors.build(params, [0, 0, 0], 50, torch.device("cpu"))
    out = sample(logits, s)
    assert out[0] == logits[0].argmax() and out[2] == logits[2].argmax()
