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
from worker.batch import SequenceChunk, build_batch, window_lists
from worker.distributed import step_message
from worker.distributed.step_message import RankSampling
from worker.runner import ModelRunner, RunnerConfig

WINDOW, PAGE, CHUNK, TOL = 128, 16, 256, 1e-4


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("gpt_oss_window")
    return str(path), write_tiny_gpt_oss(path, seed=5, layer_types=(SLIDING, FULL, SLIDING), window=WINDOW,
                                         max_positions=8192)


def make_engine(model_dir: str, prefix_cache: bool = True, kv_host_size: float | None = None,
                kv_tokens: int = 8192, running: int = 2) -> Engine:
    runner = ModelRunner(RunnerConfig(model_dir, device="cpu", dtype="float32", page_size=PAGE, kv_tokens=kv_tokens,
                                      max_prefill_tokens=CHUNK, state_slots=running, kv_host_size=kv_host_size))
    return Engine(runner, EngineConfig(max_running=running, prefix_cache=prefix_cache))


def record_logits(engine: Engine) -> list[tuple[int, torch.Tensor]]:
    """(tokens in KV after the step, logits of its one sequence) of every step ``engine`` runs."""
    seen, forward = [], engine.runner.model.forward

    def recorded(batch):
        logits = forward(batch)
        seen.append((batch.seq_lens_host[0], logits[0].clone()))
        return logits
    engine.runner.model.forward = recorded
    return seen


def sampled_logits(seen: list[tuple[int, torch.Tensor]], prompt_len: int) -> torch.Tensor:
    """The logits a turn with a ``prompt_len``-token prompt sampled from (its last prefill chunk, then decode)."""
    return torch.stack([x for end, x in seen if end >= prompt_len])


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


def session(engine: Engine, turns: int, seed: int, rid: str = "t", new: int = 1000):
    """Turns whose prompt is the last prompt, its reply and ``new`` new tokens."""
    gen = torch.Generator().manual_seed(seed)
    history: list[int] = []
    for turn in range(turns):
        history = history + torch.randint(0, 127, (new,), generator=gen).tolist()
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
    assert stats["window_snapshots"] <= 8 and stats["window_pages_running"] == stats["window_pages_pending"] == 0
    assert stats["window_pages_free"] >= stats["window_pages_total"] - 4 * ring
    print(f"\n4k session: {len(prompt) + 24} tokens, window pool {stats['window_pages_total']} pages, "
          f"peak {stats['window_pages_peak']} window pages per request (ring {ring}), "
          f"{stats['window_pages_freed']} freed, {stats['window_prefix_tokens']} tokens resumed from windows")


def rerendered_session(engine: Engine, seed: int, new=(300, 200, 333, 250)):
    """Turns whose prompt is the last prompt, its reply re-rendered (half of it, every token other
    than generated: harmony drops the analysis and ends the turn with <|end|>) and new tokens, so
    the prompt parts from the cached tokens right after the last prompt. 512 is a page multiple."""
    gen = torch.Generator().manual_seed(seed)
    history: list[int] = []
    for turn, n in enumerate(new):
        history = history + torch.randint(0, 127, (n,), generator=gen).tolist()
        before = dict(engine.stats())
        out = run(engine, [req(f"h{turn}", history, max_tokens=24, ignore_eos=True)])[f"h{turn}"][0]
        yield turn, list(history), out, before, engine.stats()
        history = history + [(t + 1) % 127 for t in out[::2]]


def test_a_rerendered_turn_resumes_from_the_prompt_end_window(checkpoint):
    """Each follow-up matches the last prompt only; its sliding layers resume from the window kept
    at that prompt's last page boundary, where its full layers resume, and recompute nothing before
    it. Every page is accounted for after each step, and after the prefix cache is emptied."""
    model_dir, hf = checkpoint
    cached, scratch = make_engine(model_dir), make_engine(model_dir, prefix_cache=False)
    seen, fresh = record_logits(cached), record_logits(scratch)
    last = 0
    for turn, prompt, out, before, after in rerendered_session(cached, seed=3):
        assert out == run(scratch, [req("s", prompt, max_tokens=24, ignore_eos=True)])["s"][0], turn
        got = sampled_logits(seen, len(prompt))
        assert rel_err(got, sampled_logits(fresh, len(prompt))) < TOL, turn
        seen.clear()
        fresh.clear()
        delta = {k: after[k] - before[k] for k in ("window_prefix_tokens", "kv_prefix_tokens_gpu",
                                                   "window_recomputed_tokens", "window_prompt_snapshots")}
        assert delta == dict(window_prefix_tokens=last // PAGE * PAGE, kv_prefix_tokens_gpu=last // PAGE * PAGE,
                             window_recomputed_tokens=0, window_prompt_snapshots=1), (turn, delta)
        last = len(prompt)
    assert rel_err(hf_logits(hf, prompt)[-1], got[0]) < TOL
    stats = cached.stats()
    assert stats["window_pages_running"] == stats["window_pages_pending"] == 0
    assert stats["window_snapshots"] == 8 and stats["window_pages_free"] < stats["window_pages_total"]
    pages = cached.pages
    freed, _ = pages.radix.evict(pages.radix.num_pages, lambda node: None)
    pages.pool.free(freed)
    cached.check_pages()
    stats = cached.stats()
    assert stats["window_snapshots"] == 0 and stats["window_pages_free"] == stats["window_pages_total"]
    assert stats["kv_pages_free"] == stats["kv_pages_total"]
    print(f"\nre-rendered session: {stats['window_snapshots_taken']} windows kept "
          f"({stats['window_prompt_snapshots']} at prompt ends), {stats['window_prefix_tokens']} tokens resumed "
          f"from windows, {stats['kv_prefix_tokens_gpu']} by the full layers, "
          f"{stats['window_recomputed_tokens']} recomputed before the resume point")


@pytest.mark.parametrize("tight", ["window pool", "KV pool"])
def test_evicted_windows_and_host_restored_prefixes_stay_exact(checkpoint, tight):
    """Three interleaved sessions. A window pool of one running ring and one cached window: the
    others' windows are evicted and their turns compute their prefix again. A KV pool smaller than
    the sessions: their full-layer pages go to the host tier and come back, and the turns resume
    from the windows kept on the GPU. Every turn answers as a run without the prefix cache, with
    every page accounted for after each step."""
    model_dir, _ = checkpoint
    small_kv = tight == "KV pool"
    cached = make_engine(model_dir, kv_host_size=0.01 if small_kv else None, kv_tokens=768 if small_kv else 8192,
                         running=2 if small_kv else 1)
    scratch = make_engine(model_dir, prefix_cache=False, running=1)
    seen, fresh = record_logits(cached), record_logits(scratch)
    sessions = [session(cached, turns=2, seed=10 + s, rid=f"s{s}t", new=300) for s in range(3)]
    for turn in range(2):
        for s, turns in enumerate(sessions):
            _, prompt, out, _, after = next(turns)
            assert out == run(scratch, [req("x", prompt, max_tokens=24, ignore_eos=True)])["x"][0], (s, turn)
            assert rel_err(sampled_logits(seen, len(prompt)), sampled_logits(fresh, len(prompt))) < TOL, (s, turn)
            seen.clear()
            fresh.clear()
    if small_kv:
        assert after["kv_host_pages_restored"] > 0 and after["window_prefix_tokens"] >= 3 * 320
    else:
        assert after["window_snapshots_evicted"] > 0 and after["window_recomputed_tokens"] > 0


def test_folded_pages_of_direct_callers_must_not_overlap():
    """A chunk without window pages has its pages folded into the window pool; two rows whose
    folded pages meet are refused on the host."""
    loc, table = window_lists([SequenceChunk([1] * 8, 0, [1, 2]), SequenceChunk([1] * 8, 0, [11, 12])], 4, 2, 9, 8)
    assert table == [1, 2, 3, 4] and loc == [*range(4, 12), *range(12, 20)]
    chunks = [SequenceChunk([1] * 8, 0, [1, 2]), SequenceChunk([1] * 8, 0, [9, 10])]
    with pytest.raises(ValueError, match="overlap"):
        build_batch(chunks, 4, torch.device("cpu"), window_pool_pages=9, window=8)
    ok = [SequenceChunk([1] * 8, 0, [1, 2], window_pages=[3, 4]), SequenceChunk([1] * 8, 0, [9, 10])]
    assert build_batch(ok, 4, torch.device("cpu"), window_pool_pages=9, window=8).window.page_table.tolist() == \
        [[3, 4], [1, 2]]


def test_step_message_carries_window_pages():
    chunks = [SequenceChunk([5, 6], 3, [1, 2], 0, window_pages=[0, 7]), SequenceChunk([8], 0, [3], -1)]
    sampling = [RankSampling(0.0, 0, 1.0, 0)] * 2
    head, payload = step_message.encode(step_message.Step(chunks, sampling, [0, 1], 0))
    got = step_message.decode(head.tolist(), payload)
    assert [c.window_pages for c in got.chunks] == [[0, 7], None] and [c.pages for c in got.chunks] == [[1, 2], [3]]
