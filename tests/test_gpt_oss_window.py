"""gpt-oss's sliding layers keep only their window's pages (``scheduler.window_cache``): a 4k-token
session on a tiny model with window 128 whose sliding layers hold a ring of pages while the full
layers hold the whole sequence, later turns resuming from the windows the prefix cache kept, with
the logits of a from-scratch run and every page accounted for after each step."""
from __future__ import annotations

import pytest
import torch

from scheduler.engine import Engine, EngineConfig
from tests.test_engine import req, run
from tests.tiny_gpt_oss import FULL, SLIDING, hf_logits, write_tiny_gpt_oss
from worker.runner import ModelRunner, RunnerConfig

WINDOW, PAGE, CHUNK, TOL = 128, 16, 256, 1e-4


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("gpt_oss_window")
    return str(path), write_tiny_gpt_oss(path, seed=5, layer_types=(SLIDING, FULL, SLIDING), window=WINDOW,
                                         max_positions=8192)


def make_engine(model_dir: str, prefix_cache: bool = True, kv_host_size: float | None = None,
                kv_tokens: int = 8192) -> Engine:
    runner = ModelRunner(RunnerConfig(model_dir, device="cpu", dtype="float32", page_size=PAGE, kv_tokens=kv_tokens,
                                      max_prefill_tokens=CHUNK, state_slots=2, kv_host_size=kv_host_size))
    return Engine(runner, EngineConfig(max_running=2, prefix_cache=prefix_cache))


def record_logits(engine: Engine) -> list[tuple[int, torch.Tensor]]:
    """(tokens in KV after the step, logits of its one sequence) of every step ``engine`` runs."""
    seen, forward = [], engine.runner.forward

    def recorded(chunks, *args, **kw):
        out = forward(chunks, *args, **kw)
        seen.append((chunks[0].prefix_len + len(chunks[0].token_ids), out.logits[0].clone()))
        return out
    engine.runner.forward = recorded
    return seen


def sampled_logits(seen: list[tuple[int, torch.Tensor]], prompt_len: int) -> torch.Tensor:
    """The logits a turn with a ``prompt_len``-token prompt sampled from (its last prefill chunk, then decode)."""
    return torch.stack([x for end, x in seen if end >= prompt_len])


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


def session(engine: Engine, turns: int, seed: int, rid: str = "t"):
    """Turns whose prompt is the last prompt, its reply and about 1k new tokens."""
    gen = torch.Generator().manual_seed(seed)
    history: list[int] = []
    for turn in range(turns):
        history = history + torch.randint(0, 127, (1000,), generator=gen).tolist()
        before = dict(engine.stats())
        out = run(engine, [req(f"{rid}{turn}", history, max_tokens=24, ignore_eos=True)])[f"{rid}{turn}"][0]
        yield turn, list(history), out, before, engine.stats()
        history = history + out


def test_a_4k_session_holds_window_pages_only(checkpoint):
    model_dir, hf = checkpoint
    cached, scratch = make_engine(model_dir), make_engine(model_dir, prefix_cache=False)
    assert cached.runner.window_pool is not None and cached.runner.kv_pool.k.shape[0] == 1  # the full layer only
    seen, fresh = record_logits(cached), record_logits(scratch)
    ring = -(-WINDOW // PAGE) + 2
    for turn, prompt, out, before, after in session(cached, turns=4, seed=0):
        want = run(scratch, [req("s", prompt, max_tokens=24, ignore_eos=True)])["s"][0]
        assert out == want, turn
        got, ref = sampled_logits(seen, len(prompt)), sampled_logits(fresh, len(prompt))
        assert rel_err(got, ref) < TOL, turn
        seen.clear()
        fresh.clear()
        resumed = after["window_prefix_tokens"] - before["window_prefix_tokens"]
        assert resumed == (len(prompt) - 1000 - 1) // PAGE * PAGE if turn else resumed == 0, (turn, resumed)
        # between steps a request holds its ring; in a prefill step, the ring and one chunk's pages
        assert after["window_pages_peak"] <= ring + CHUNK // PAGE + 1
    assert len(prompt) > 4000 and after["window_recomputed_tokens"] == 0
    assert after["window_pages_freed"] > len(prompt) // PAGE - 2 * ring
    assert rel_err(hf_logits(hf, prompt)[-1], got[0]) < TOL
    scratch_stats = scratch.stats()
    assert scratch_stats["window_pages_running"] == 0 and scratch_stats["window_snapshots"] == 0
    stats = cached.stats()
    assert stats["window_snapshots"] <= 4 and stats["window_pages_running"] == 0
    assert stats["window_pages_free"] >= stats["window_pages_total"] - 4 * ring
    print(f"\n4k session: {len(prompt) + 24} tokens, window pool {stats['window_pages_total']} pages, "
          f"peak {stats['window_pages_peak']} window pages per request (ring {ring}), "
          f"{stats['window_pages_freed']} freed, {stats['window_prefix_tokens']} tokens resumed from windows")
