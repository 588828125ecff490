"""The sampler (worker/sampling.py) against the textbook nucleus, the smallest prefix of the tokens
sorted by probability whose mass reaches ``top_p``, at most ``top_k`` of them: which tokens it
draws and how often; its kernel (worker/sample_kernel.py) against the twin, interpreted on the CPU
and compiled, sync-free, on a GPU."""
from __future__ import annotations

import os
from dataclasses import dataclass

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from worker.sampling import BLOCK, SamplingTensors, sample, sample_eager  # noqa: E402


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


def test_draws_follow_the_nucleus_probabilities():
    probs = torch.tensor([0.4, 0.25, 0.15, 0.1, 0.06, 0.04])
    n = 4000
    counts = torch.bincount(torch.tensor(draws(probs.log()[None], Params(1.0, 0, 0.85, 11), n)), minlength=6)
    kept = probs[:4] / probs[:4].sum()  # mass before the 4th: 0.8 <= 0.85, before the 5th: 0.9
    assert counts[4:].sum() == 0
    sigma = (kept * (1 - kept) / n).sqrt()
    assert bool(((counts[:4] / n - kept).abs() < 5 * sigma).all()), counts


def test_masked_tokens_are_never_drawn_and_top_k_one_is_greedy():
    logits = torch.zeros(1, 40)
    logits[0, ::2] = float("-inf")
    assert set(draws(logits, Params(1.0, 0, 1.0, 5), 300)) <= set(range(1, 40, 2))
    logits = torch.randn(1, 40, generator=torch.Generator().manual_seed(1))
    assert set(draws(logits, Params(1.5, 1, 1.0, 5), 50)) == {int(logits.argmax())}


# ==== the kernel against the twin ====

# rows of (temperature, top_k, top_p): greedy, the whole vocabulary, top-k, both cuts, a tight
# nucleus, top-k 1 (greedy), a tiny temperature
ROWS = [(0.0, 0, 1.0), (1.0, 0, 1.0), (0.7, 5, 1.0), (1.3, 20, 0.5), (2.0, 0, 0.3), (1.0, 1, 1.0), (1e-6, 0, 0.9),
        (1.0, 0, 0.95)]


def check_kernel(rows: int, vocab: int, block: int, device: str, gen: torch.Generator, steps: int) -> None:
    from worker.sample_kernel import launch

    logits = torch.randn(rows, vocab, generator=gen) * torch.rand(rows, 1, generator=gen) * 6
    logits[0, vocab // 3] = float("-inf")
    params = [Params(*ROWS[r % len(ROWS)], seed=int(torch.randint(0, 1 << 40, (1,), generator=gen)))
              for r in range(rows)]
    on_device = logits.to(device)
    for step in range(steps):
        s = SamplingTensors.build(params, [step * 7919 + r for r in range(rows)], vocab, torch.device(device))
        if device == "cuda":
            torch.cuda.set_sync_debug_mode("error")
        try:
            got = launch(on_device, s.temperature, s.top_k, s.top_p, s.seed, s.step, block)
        finally:
            if device == "cuda":
                torch.cuda.set_sync_debug_mode("default")
        cpu = SamplingTensors(*(t.cpu() for t in (s.temperature, s.top_k, s.top_p, s.seed, s.step)), all_greedy=False)
        assert got.cpu().tolist() == sample_eager(logits, cpu, block).tolist(), step


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs TRITON_INTERPRET=1")
@pytest.mark.parametrize("rows, vocab, block", [(8, 300, 64), (5, 1000, 128), (3, 5000, 4096)])
def test_kernel_matches_twin_interpreted(rows, vocab, block):
    check_kernel(rows, vocab, block, "cpu", torch.Generator().manual_seed(vocab), steps=20)


@pytest.mark.cuda
@pytest.mark.parametrize("rows, vocab, block", [(8, 300, 64), (16, 5000, 4096), (8, 151936, BLOCK)])
def test_kernel_matches_twin_on_gpu_without_syncs(rows, vocab, block):
    from worker.sample_kernel import launch

    zeros = torch.zeros(1, device="cuda")
    launch(zeros[None], zeros, zeros.long(), zeros, zeros.long(), zeros.long(), block)  # compile outside the check
    check_kernel(rows, vocab, block, "cuda", torch.Generator().manual_seed(vocab), steps=20)
