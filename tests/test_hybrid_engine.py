"""A hybrid model (Qwen3.5-MoE) served by the engine on CPU: agent sessions whose turns resume the
linear layers from state snapshots in the prefix cache, through host-tier eviction and restore,
with every page and state slot accounted for after each step."""
from __future__ import annotations

import pytest
import torch

from scheduler.engine import Engine, EngineConfig
from tests.test_engine import req, run
from tests.tiny_hybrid import write_tiny_hybrid
from worker.runner import ModelRunner, RunnerConfig

LAYERS = ("linear_attention", "full_attention", "linear_attention")


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory):
    path = tmp_path_factory.mktemp("hybrid")
    return str(path), write_tiny_hybrid(path, "qwen3_5_moe", seed=3, layer_types=LAYERS)


def make_engine(model_dir: str, snapshots: int, kv_host_size: float | None = None, max_prefill_tokens: int = 32,
                **kw) -> Engine:
    runner = ModelRunner(RunnerConfig(model_dir, device="cpu", dtype="float32", page_size=4, kv_tokens=4096,
                                      max_prefill_tokens=max_prefill_tokens, state_slots=4, state_snapshots=snapshots,
                                      kv_host_size=kv_host_size))
    return Engine(runner, EngineConfig(max_running=4, **kw))


def hf_greedy(hf, ids: list[int], n: int) -> list[int]:
    out = list(ids)
    with torch.no_grad():
        for _ in range(n):
            out.append(int(hf(torch.tensor([out])).logits[0, -1].argmax()))
    return out[len(ids):]


def new_tokens(gen: torch.Generator) -> list[int]:
    n = int(torch.randint(3, 24, (1,), generator=gen))
    return torch.randint(0, 120, (n,), generator=gen).tolist()


def session_turns(engine: Engine, hf, sessions: int, turns: int, seed: int = 0):
    """Interleaved agent sessions: each turn's prompt is the last prompt, its reply and new tokens."""
    gen = torch.Generator().manual_seed(seed)
    history = [new_tokens(gen) + new_tokens(gen) for _ in range(sessions)]
    for turn in range(turns):
        for s in range(sessions):
            before = dict(engine.stats())
            out = run(engine, [req(f"s{s}t{turn}", history[s], max_tokens=5)])[f"s{s}t{turn}"][0]
            assert out == hf_greedy(hf, history[s], len(out)), f"session {s} turn {turn}"
            yield s, turn, history[s], before, engine.stats()
            history[s] = history[s] + out + new_tokens(gen)


def test_twenty_turns_compute_only_their_new_tokens(hybrid):
    """Each turn after the first resumes at the previous prompt's last page boundary or later."""
    model_dir, hf = hybrid
    engine = make_engine(model_dir, snapshots=8)
    previous = 0
    for _, turn, prompt, before, after in session_turns(engine, hf, sessions=1, turns=20):
        resumed = after["state_prefix_tokens"] - before["state_prefix_tokens"]
        if turn:
            assert resumed >= (previous - 1) // 4 * 4, (turn, resumed, previous)
        assert after["state_recomputed_tokens"] == 0
        previous = len(prompt)
    assert after["state_snapshots_restored_gpu"] == 19


def test_a_prompt_takes_one_forward_with_its_snapshot_inside(hybrid):
    """The prompt-end snapshot (its last page boundary) is written inside the prompt's one chunk, not
    after a chunk cut there: a turn takes one prefill step, and the next turn, whose prompt parts from
    this one's reply, resumes from that boundary."""
    model_dir, hf = hybrid
    engine = make_engine(model_dir, snapshots=8, max_prefill_tokens=64)
    gen = torch.Generator().manual_seed(5)
    prompt = torch.randint(0, 120, (23,), generator=gen).tolist()
    resumes_at = 0  # the reply is not in the next prompt: it resumes at the last prompt's last boundary
    for turn in range(4):
        before = dict(engine.stats())
        out = run(engine, [req(f"t{turn}", prompt, max_tokens=1)])[f"t{turn}"][0]
        after = engine.stats()
        assert out == hf_greedy(hf, prompt, 1)
        assert after["steps"] - before["steps"] == 1, f"turn {turn}: a prompt of {len(prompt)} in one step"
        assert after["state_prefix_tokens"] - before["state_prefix_tokens"] == resumes_at, turn
        engine.check_pages()
        resumes_at = (len(prompt) - 1) // 4 * 4
        prompt = prompt + torch.randint(0, 120, (int(torch.randint(2, 9, (1,), generator=gen)),),
                                        generator=gen).tolist()


def test_snapshots_survive_host_eviction_and_restore(hybrid):
    """Three sessions share two GPU snapshot slots: older snapshots go to the host tier and later
    turns resume from there, with the same greedy text as transformers."""
    model_dir, hf = hybrid
    engine = make_engine(model_dir, snapshots=2, kv_host_size=0.02)
    for s, turn, prompt, before, after in session_turns(engine, hf, sessions=3, turns=4, seed=1):
        if turn:
            assert after["state_prefix_tokens"] > before["state_prefix_tokens"], (s, turn)
    assert after["state_snapshots_to_host"] > 0 and after["state_snapshots_restored_host"] > 0
    assert after["state_snapshots_gpu"] <= 2


def test_without_host_tier_evicted_snapshots_are_recomputed(hybrid):
    """With one GPU snapshot slot and no host tier, a session whose snapshot was dropped computes
    its prefix again (counted), and still answers exactly."""
    model_dir, hf = hybrid
    engine = make_engine(model_dir, snapshots=1)
    for _ in session_turns(engine, hf, sessions=2, turns=3, seed=2):
        pass
    stats = engine.stats()
    assert stats["state_snapshots_dropped"] > 0 and stats["state_recomputed_tokens"] > 0


def test_ragged_batch_with_abort_leaks_nothing(hybrid):
    """Several requests at once in small prefill chunks, one aborted midway: the others answer
    exactly, and every page and state slot is accounted for after each step."""
    model_dir, hf = hybrid
    engine = make_engine(model_dir, snapshots=3, max_prefill_tokens=8)
    gen = torch.Generator().manual_seed(4)
    prompts = [torch.randint(0, 120, (n,), generator=gen).tolist() for n in (5, 17, 30, 9)]
    for i, p in enumerate(prompts):
        assert engine.submit(req(f"r{i}", p, max_tokens=6)) is None
    outputs: dict[str, list[int]] = {f"r{i}": [] for i in range(4)}
    for step in range(200):
        if not engine.has_work:
            break
        if step == 2:
            assert engine.abort("r2")
        for u in engine.step():
            outputs[u.rid] += u.token_ids
        if not engine.in_flight:
            engine.check_pages()
    engine.check_pages()
    for i in (0, 1, 3):
        assert outputs[f"r{i}"] == hf_greedy(hf, prompts[i], 6)
    states = engine.pages.states
    assert states.pool.num_free + len(states.gpu_holders) == states.pool.capacity
