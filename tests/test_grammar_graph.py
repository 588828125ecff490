"""The grammar mask inside the decode graphs (worker/cuda_graph.py): the static-buffer step run
eagerly on the CPU against the runner's eager step with the same mask, and on a GPU a captured
graph replayed with a mask under sync debug mode "error" (graphs captured before any mask, so
the mask buffer they read is the one every later step fills)."""
from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from scheduler.messages.to_scheduler import SamplingParams  # noqa: E402
from tests.test_token_mask import random_mask  # noqa: E402
from tests.tiny_models import write_tiny  # noqa: E402
from worker.attention import create_backend  # noqa: E402
from worker.batch import SequenceChunk  # noqa: E402
from worker.cuda_graph import DecodeGraphs  # noqa: E402
from worker.runner import ModelRunner, RunnerConfig  # noqa: E402
from worker.token_mask import TokenMask  # noqa: E402

VOCAB = 300
PARAMS = [SamplingParams(), SamplingParams(temperature=1.0, seed=5), SamplingParams(temperature=0.7, top_p=0.9, seed=2)]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("tiny-mask-graph")
    write_tiny(path, "qwen3_moe", seed=4, layers=2, heads=8, kv_heads=2, head_dim=16, experts=8, top_k=2, vocab=VOCAB)
    return str(path)


def prefill(runner: ModelRunner, prompts: list[list[int]], extra: int = 16):
    pool = runner.kv_pool
    pages = [pool.allocate(pool.pages_for(len(p) + extra)) for p in prompts]
    out = runner.forward([SequenceChunk(p, 0, pg) for p, pg in zip(prompts, pages)], [PARAMS[0]] * len(prompts),
                         [0] * len(prompts))
    return pages, out.next_tokens.tolist()


def decode_with_masks(run, prompts_pages_tokens, device: str, steps: int = 3, mask_rows: int = 70):
    """Decode steps of batch 5 with mask rows [r, -1, r', r'', -1] (row numbers past 64 on purpose:
    the graphs' mask buffer grows); returns each step's (logits, tokens, allowed)."""
    gen = torch.Generator().manual_seed(9)
    pages, tokens, lens = prompts_pages_tokens
    out = []
    for step in range(steps):
        words, allowed = random_mask(mask_rows, VOCAB, 0.1, gen)
        rows = [mask_rows - 1, -1, 3, 65, -1]
        chunks = [SequenceChunk([tokens[b]], lens[b], pages[b]) for b in range(5)]
        params = [PARAMS[b % 3] for b in range(5)]
        logits, nxt = run(chunks, params, [lens[b] for b in range(5)], TokenMask(words.to(device), rows))
        out.append((logits.clone().cpu(), nxt.tolist(), allowed, rows))
        tokens[:5] = nxt.tolist()
        lens[:5] = [n + 1 for n in lens[:5]]
    return out


def check_masked(results) -> None:
    for logits, tokens, allowed, rows in results:
        for b, (t, r) in enumerate(zip(tokens, rows)):
            if r >= 0:
                assert allowed[r, t] and torch.isinf(logits[b][~allowed[r]]).all(), (b, t)
            else:
                assert torch.isfinite(logits[b]).all()


def test_static_buffer_step_with_a_mask_matches_eager_on_cpu(model_dir):
    runner = ModelRunner(RunnerConfig(model_dir, device="cpu", dtype="float32", page_size=4, kv_tokens=1024))
    cfg = runner.model_config
    graphs = DecodeGraphs(runner.model, create_backend("triton", runner.kv_pool, cfg.head_dim ** -0.5),
                          runner.kv_pool, cfg.max_context, 8, use_graphs=False)
    prompts = [[(7 * b + i) % VOCAB for i in range(3 + 2 * b)] for b in range(5)]
    pages, tokens = prefill(runner, prompts)
    lens = [len(p) for p in prompts]
    eager = decode_with_masks(lambda c, p, s, m: tuple(runner.forward(c, p, s, mask=m)),
                              (pages, list(tokens), list(lens)), "cpu")
    static = decode_with_masks(lambda c, p, s, m: graphs.run(c, p, s, mask=m), (pages, list(tokens), list(lens)), "cpu")
    check_masked(eager)
    for (want, want_tokens, _, _), (got, got_tokens, _, _) in zip(eager, static):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        assert got_tokens == want_tokens
    assert graphs.mask.shape[0] == 70  # grown past its first 64 rows


@pytest.mark.cuda
def test_captured_decode_graph_applies_the_mask_without_syncs(model_dir):
    graphed = ModelRunner(RunnerConfig(model_dir, device="cuda", dtype="float32", page_size=16, kv_tokens=8192,
                                       cuda_graph=True))
    prompts = [[(7 * b + i) % VOCAB for i in range(3 + 2 * b)] for b in range(5)]
    pages, tokens = prefill(graphed, prompts)
    graphed.graphs.capture_all()
    graphed.graphs._fit_mask(torch.zeros(70, graphed.graphs.mask.shape[1], dtype=torch.int32, device="cuda"))
    graphed.graphs.capture_all()  # the grown buffer is the one the graphs read from now on

    def run(chunks, params, steps, mask):
        torch.cuda.set_sync_debug_mode("error")
        try:
            return tuple(graphed.forward(chunks, params, steps, mask=mask))
        finally:
            torch.cuda.set_sync_debug_mode("default")

    check_masked(decode_with_masks(run, (pages, tokens, [len(p) for p in prompts]), "cuda"))
    assert all(c.forward is not None and c.sample is not None for c in graphed.graphs.captured.values())
