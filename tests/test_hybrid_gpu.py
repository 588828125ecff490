"""The hybrid families on a GPU: fla's kernels and the Triton attention inside the whole model
against transformers, CUDA-graph decode against eager decode, and an engine session whose turns
resume from state snapshots; the forwards under ``set_sync_debug_mode("error")``."""
from __future__ import annotations

import pytest
import torch

from scheduler.engine import Engine, EngineConfig
from tests.parity_helpers import (GREEDY, assert_greedy_up_to_near_ties, gpu_decode_logits, gpu_prefill_then_decode,
                                  rel_err)
from tests.test_engine import req, run
from tests.tiny_hybrid import hf_logits, write_tiny_hybrid
from worker.batch import SequenceChunk
from worker.runner import ModelRunner, RunnerConfig

pytestmark = pytest.mark.cuda
SHAPE = dict(layer_types=("linear_attention", "full_attention", "linear_attention", "linear_attention"),
             hidden=128, heads=4, kv_heads=2, head_dim=64, linear_k_heads=2, linear_v_heads=4, linear_k_dim=64,
             linear_v_dim=64, experts=8, top_k=2, inter=64, shared_inter=64)


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory):
    path = tmp_path_factory.mktemp("hybrid_gpu")
    return str(path), write_tiny_hybrid(path, "qwen3_5_moe", seed=11, **SHAPE)


def runner(model_dir: str, dtype: str = "bfloat16", **kw) -> ModelRunner:
    return ModelRunner(RunnerConfig(model_dir, device="cuda", dtype=dtype, page_size=16, kv_tokens=4096,
                                    max_prefill_tokens=512, state_slots=8, state_snapshots=4, **kw))


def test_model_on_gpu_matches_transformers(hybrid):
    """float32 on the GPU (fla chunk kernels, the step and conv kernels, paged attention) against
    transformers in float32: chunked prefill over a 64-multiple and a ragged split, then decode.
    (In bf16 this amplifying random model drifts 3-12% from float32 on the CPU's eager path too.)"""
    model_dir, hf = hybrid
    r = runner(model_dir, dtype="float32", cuda_graph=False)
    ids = torch.randint(0, 120, (200,), generator=torch.Generator().manual_seed(0)).tolist()
    ref = hf_logits(hf, ids)
    gpu_prefill_then_decode(r, ids, [64, 128, 190], sync_error=False, state_slot=1)  # compiles
    got = gpu_prefill_then_decode(r, ids, [64, 128, 190], sync_error=True, state_slot=1)
    positions = [63, 127, 189] + list(range(190, 200))
    for logits, pos in zip(got, positions):
        assert rel_err(logits, ref[pos]) < 5e-3, pos


def test_graph_decode_equals_eager(hybrid):
    """A batch of three sequences decoded through captured graphs equals the same steps run eagerly."""
    model_dir, _ = hybrid
    graphs, eager = runner(model_dir), runner(model_dir, cuda_graph=False)
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 120, (n,), generator=gen).tolist() for n in (5, 33, 70)]
    results = [gpu_decode_logits(r, prompts, 12, state_slots=[1, 2, 3]) for r in (graphs, eager)]
    assert graphs.graphs is not None and graphs.graphs.captured
    assert rel_err(results[0], results[1]) < 1e-3


def test_engine_session_on_gpu(hybrid):
    """Six turns of one session through the engine (graphs, overlap loop, snapshots): each turn's
    prompt resumes from the last one's snapshot, and the replies are transformers' greedy ones."""
    model_dir, hf = hybrid
    engine = Engine(runner(model_dir, dtype="float32"), EngineConfig(max_running=8))
    gen = torch.Generator().manual_seed(2)
    history = torch.randint(0, 120, (40,), generator=gen).tolist()
    for turn in range(6):
        before = engine.stats()["state_prefix_tokens"]
        out = run(engine, [req(f"t{turn}", history, max_tokens=8)])[f"t{turn}"][0]
        assert len(out) == 8, turn
        ref = hf_logits(hf, history + out)[len(history) - 1:-1]
        # each token is transformers' argmax, up to near-ties (Triton's float32 dots round as TF32)
        assert_greedy_up_to_near_ties(ref, out, turn)
        if turn:
            assert engine.stats()["state_prefix_tokens"] > before
        history = history + out + torch.randint(0, 120, (50,), generator=gen).tolist()


def test_snapshot_inside_a_chunk_on_gpu(hybrid):
    """fla's chunk kernels and the conv in two passes around a snapshot, for a split first sequence
    (tokens reordered) and a one-token tail, under sync debug mode, in float32 against transformers:
    the step's last logits, and each snapshot continued by the rest of its sequence. (The passes move
    fla's 64-token chunk grid, so the split step differs from an unsplit one by TF32 rounding, about
    1e-3, not bit for bit.)"""
    model_dir, hf = hybrid
    r = runner(model_dir, dtype="float32", cuda_graph=False)
    gen = torch.Generator().manual_seed(3)
    seqs = [torch.randint(0, 120, (n,), generator=gen).tolist() for n in (150, 40)]
    want = [hf_logits(hf, s)[-1] for s in seqs]
    pages = [r.kv_pool.allocate(r.kv_pool.pages_for(len(s))) for s in seqs]
    snapshots = [(96, 9), (39, 10)]  # into the snapshot slots after the 8 running ones
    chunks = [SequenceChunk(s, 0, pg, state_slot=i + 1, state_snapshot=snap)
              for i, (s, pg, snap) in enumerate(zip(seqs, pages, snapshots))]
    r.forward(chunks, [GREEDY] * 2, [0] * 2)  # compiles the tails' lengths
    torch.cuda.set_sync_debug_mode("error")
    try:
        got = r.forward(chunks, [GREEDY] * 2, [0] * 2).logits.clone()
        resumed = [r.forward([SequenceChunk(s[cut:], cut, pg, state_slot=slot)], [GREEDY], [0]).logits[0].clone()
                   for s, pg, (cut, slot) in zip(seqs, pages, snapshots)]
    finally:
        torch.cuda.set_sync_debug_mode("default")
    for b in range(2):
        assert rel_err(got[b], want[b]) < 5e-3, b
        assert rel_err(resumed[b], want[b]) < 5e-3, b
