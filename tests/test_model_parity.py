"""Sluice's model execution against Hugging Face transformers on tiny random checkpoints (CPU, fp32)."""
from __future__ import annotations

import pytest
import torch

from tests.tiny_models import write_tiny
from worker.batch import SequenceChunk
from worker.runner import ModelRunner, RunnerConfig
from scheduler.messages.to_scheduler import SamplingParams

SHAPES = [
    dict(family="mixtral", seed=0),
    dict(family="mixtral", seed=1, heads=6, kv_heads=3, head_dim=8, hidden=48, experts=4, top_k=2),
    dict(family="mixtral", seed=2, heads=5, kv_heads=1, head_dim=16, layers=3, experts=8, top_k=3),
    dict(family="qwen3_moe", seed=0, norm_topk_prob=True),
    dict(family="qwen3_moe", seed=1, norm_topk_prob=False, heads=6, kv_heads=2, head_dim=8, experts=16, top_k=4),
    dict(family="qwen3_moe", seed=3, norm_topk_prob=False, heads=7, kv_heads=7, head_dim=16, experts=4, top_k=1),
]
GREEDY = SamplingParams()


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


@pytest.fixture(params=SHAPES, ids=lambda s: "-".join(f"{v}" for v in s.values()))
def tiny(request, tmp_path):
    hf = write_tiny(tmp_path, **request.param)
    runner = ModelRunner(RunnerConfig(str(tmp_path), device="cpu", dtype="float32", page_size=4, kv_tokens=256))
    return hf, runner


def hf_logits(hf, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float()


def test_batched_prefill_matches_hf(tiny):
    hf, runner = tiny
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 128, (n,), generator=gen).tolist() for n in (1, 7, 13, 22)]
    pool = runner.kv_pool
    chunks = [SequenceChunk(p, 0, pool.allocate(pool.pages_for(len(p)))) for p in prompts]
    out = runner.forward(chunks, [GREEDY] * len(chunks), [0] * len(chunks))
    for b, p in enumerate(prompts):
        ref = hf_logits(hf, p)[-1]
        assert rel_err(out.logits[b], ref) < 1e-4
        assert out.next_tokens[b].item() == ref.argmax().item()


def test_prefix_chunks_and_decode_match_full_forward(tiny):
    """Prefill in two chunks (the second over a cached prefix), then decode token by token: every
    step's logits equal the full forward's logits at that position."""
    hf, runner = tiny
    pool, P = runner.kv_pool, runner.page_size
    ids = torch.randint(0, 128, (30,), generator=torch.Generator().manual_seed(1)).tolist()
    ref = hf_logits(hf, ids)
    pages = pool.allocate(pool.pages_for(len(ids)))
    split, prompt_end = 9, 21
    for start, end in ((0, split), (split, prompt_end)):
        out = runner.forward([SequenceChunk(ids[start:end], start, pages)], [GREEDY], [0])
        assert rel_err(out.logits[0], ref[end - 1]) < 1e-4
    for pos in range(prompt_end, len(ids)):
        out = runner.forward([SequenceChunk([ids[pos]], pos, pages)], [GREEDY], [0])
        assert rel_err(out.logits[0], ref[pos]) < 1e-4
    assert P * len(pages) >= len(ids)


def test_mixed_decode_batch_matches_hf(tiny):
    """Sequences at different lengths decode together in one batch."""
    hf, runner = tiny
    pool = runner.kv_pool
    gen = torch.Generator().manual_seed(2)
    seqs = [torch.randint(0, 128, (n,), generator=gen).tolist() for n in (3, 10, 17)]
    pages = [pool.allocate(pool.pages_for(len(s) + 1)) for s in seqs]
    runner.forward([SequenceChunk(s, 0, pg) for s, pg in zip(seqs, pages)], [GREEDY] * 3, [0] * 3)
    nxt = [int(t) for t in torch.randint(0, 128, (3,), generator=gen)]
    out = runner.forward([SequenceChunk([t], len(s), pg) for s, t, pg in zip(seqs, nxt, pages)], [GREEDY] * 3, [1] * 3)
    for b, (s, t) in enumerate(zip(seqs, nxt)):
        assert rel_err(out.logits[b], hf_logits(hf, s + [t])[-1]) < 1e-4
