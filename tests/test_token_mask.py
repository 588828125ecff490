"""Grammar masks: the host rows llguidance fills (scheduler.grammar.HostMask), the device op that
applies them (worker.token_mask: kernel against its eager twin, interpreted on the CPU), and the
sampler respecting them, greedy and sampled; on a GPU, sync-free in sampling and in a captured
decode graph."""
from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from worker.sampling import SamplingTensors, sample  # noqa: E402
from worker.token_mask import TokenMask, apply_token_mask, apply_token_mask_eager, mask_words  # noqa: E402


class Params:
    def __init__(self, temperature: float, top_k: int = 0, top_p: float = 1.0, seed: int | None = 0):
        self.temperature, self.top_k, self.top_p, self.seed = temperature, top_k, top_p, seed


def random_mask(rows: int, vocab: int, density: float, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """(words [rows, ceil(V/32)] int32, allowed [rows, V] bool), every row allowing a token."""
    allowed = torch.rand(rows, vocab, generator=gen) < density
    allowed[torch.arange(rows), torch.randint(0, vocab, (rows,), generator=gen)] = True
    padded = torch.zeros(rows, mask_words(vocab) * 32, dtype=torch.int64)
    padded[:, :vocab] = allowed.long()
    words = (padded.view(rows, -1, 32) << torch.arange(32)).sum(-1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32), allowed


def reference(logits: torch.Tensor, allowed: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    out = logits.clone()
    for b, r in enumerate(rows.tolist()):
        if r >= 0:
            out[b, ~allowed[r]] = float("-inf")
    return out


@pytest.mark.parametrize("batch, vocab, mask_rows", [(1, 31, 1), (3, 4097, 5), (8, 300, 2), (5, 9000, 8)])
def test_kernel_and_twin_agree_with_the_reference(batch, vocab, mask_rows):
    gen = torch.Generator().manual_seed(batch * vocab)
    for trial in range(4):
        words, allowed = random_mask(mask_rows, vocab, [0.5, 0.02, 0.97, 0.3][trial], gen)
        rows = torch.randint(-1, mask_rows, (batch,), generator=gen)  # -1: unconstrained; repeats allowed
        logits = torch.randn(batch, vocab, generator=gen)
        want = reference(logits, allowed, rows)
        assert torch.equal(apply_token_mask_eager(logits.clone(), words, rows), want)
        assert torch.equal(apply_token_mask(logits.clone(), words, rows, backend="triton"), want)


def test_bounds_are_checked_on_the_host():
    logits, rows = torch.zeros(2, 100), torch.tensor([0, -1])
    with pytest.raises(ValueError, match="cover fewer"):
        apply_token_mask(logits, torch.zeros(1, 3, dtype=torch.int32), rows)
    with pytest.raises(ValueError, match="one mask row per logits row"):
        apply_token_mask(logits, torch.zeros(1, 4, dtype=torch.int32), torch.tensor([0]))
    with pytest.raises(ValueError, match="past the mask"):
        TokenMask(torch.zeros(2, 4, dtype=torch.int32), [0, 2]).check(2)
    with pytest.raises(ValueError, match="2 rows for 3"):
        TokenMask(torch.zeros(2, 4, dtype=torch.int32), [0, 1]).check(3)


@pytest.mark.parametrize("temperature, top_k, top_p", [(0.0, 0, 1.0), (1.0, 0, 1.0), (1.3, 5, 0.9), (0.7, 0, 0.5)])
def test_greedy_and_sampled_draws_respect_the_mask(temperature, top_k, top_p):
    gen = torch.Generator().manual_seed(int(temperature * 10) + top_k)
    vocab, batch = 700, 6
    words, allowed = random_mask(3, vocab, 0.05, gen)
    rows = [0, 1, 2, -1, 0, 2]
    logits = torch.randn(batch, vocab, generator=gen)
    seen: set[tuple[int, int]] = set()
    for step in range(30):
        params = [Params(temperature, top_k, top_p, seed=b) for b in range(batch)]
        tensors = SamplingTensors.build(params, [step] * batch, vocab, torch.device("cpu"), TokenMask(words, rows))
        for backend in ("eager", "triton"):
            tokens = sample(logits.clone(), tensors, backend=backend).tolist()
            for b, (t, r) in enumerate(zip(tokens, rows)):
                assert r < 0 or allowed[r, t], (backend, b, t)
                seen.add((b, t))
    if temperature > 0:  # still a draw, not a fixed pick
        assert len({t for b, t in seen if b == 0}) > 1


def test_host_rows_from_llguidance(tmp_path):
    from scheduler.grammar import Grammars, HostMask
    from scheduler.messages.to_scheduler import Grammar
    from tests.fake_scheduler import EOS_ID, SPECIALS, write_byte_tokenizer

    write_byte_tokenizer(tmp_path)
    vocab = 256 + len(SPECIALS) + 5  # the model's vocabulary may run past the tokenizer's
    grammars = Grammars.from_dir(tmp_path, vocab, [EOS_ID])
    host = HostMask(4, vocab, torch.device("cpu"))
    digits = grammars.compile(Grammar(lark='start: /[0-9]+/ "!"'))
    done = grammars.compile(Grammar(lark='start: "a"'))
    assert done.consume_token(ord("a"))
    assert host.fill([(digits, 2), (done, 0)]) == {}  # no row left without a token
    bits = ((host.host.unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1).flatten(1)[:, :vocab]
    assert set(bits[2].nonzero().flatten().tolist()) == set(range(ord("0"), ord("9") + 1))
    assert bits[0].nonzero().flatten().tolist() == [EOS_ID]  # complete: only the end
    assert not bits[1].any() and not bits[:, 256 + len(SPECIALS):].any()


# ==== on a GPU: no hidden syncs ====


@pytest.mark.cuda
def test_mask_in_sampling_is_sync_free_on_the_gpu():
    gen = torch.Generator().manual_seed(0)
    words, allowed = random_mask(4, 151_936, 0.01, gen)
    words, allowed = words.cuda(), allowed.cuda()
    logits = torch.randn(8, 151_936, generator=gen).cuda()  # a CPU generator: no CUDA RNG state involved
    rows = [0, -1, 1, 2, 3, -1, 0, 1]
    params = [Params(1.0 if b % 2 else 0.0, 0, 0.9, b) for b in range(8)]
    tensors = SamplingTensors.build(params, [0] * 8, 151_936, torch.device("cuda"), TokenMask(words, rows))
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        tokens = sample(logits, tensors)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    for b, (t, r) in enumerate(zip(tokens.tolist(), rows)):
        assert r < 0 or allowed[r, t], (b, t)
