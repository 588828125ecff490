"""The scheduler engine in-process on a tiny model: batching, chunked prefill, prefix cache, abort."""
from __future__ import annotations

import pytest
import torch

from scheduler.engine import Engine, EngineConfig
from scheduler.request import Request
from tests.tiny_models import write_tiny
from scheduler.generate import generate
from worker.runner import ModelRunner, RunnerConfig
from scheduler.messages.to_scheduler import SamplingParams

EOS = 127
GREEDY = SamplingParams()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny")
    write_tiny(path, "qwen3_moe", seed=5, layers=2, experts=8, top_k=2)
    return str(path)


def make_engine(model_dir, kv_tokens=1024, max_prefill_tokens=0, kv_host_size=None, **kw) -> Engine:
    """An engine over a fresh runner: the sizes go to the runner's memory plan, the rest to the engine."""
    runner = ModelRunner(RunnerConfig(model_dir, device="cpu", dtype="float32", page_size=4, kv_tokens=kv_tokens,
                                      max_prefill_tokens=max_prefill_tokens, kv_host_size=kv_host_size))
    return Engine(runner, EngineConfig(**kw))


def prompts(n, seed=0, lo=3, hi=40):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, EOS, (int(torch.randint(lo, hi, (1,), generator=gen)),), generator=gen).tolist()
            for _ in range(n)]


def run(engine: Engine, reqs: list[Request], check=True) -> dict[str, list]:
    """Drive the engine until every request finished; returns rid -> [tokens, reason, update list]."""
    results = {r.rid: [[], None, []] for r in reqs}
    for r in reqs:
        assert engine.submit(r) is None
    for _ in range(10_000):
        if not engine.has_work:
            break
        for u in engine.step():
            res = results[u.rid]
            assert res[1] is None, "update after finish"
            res[0] += u.token_ids
            res[2].append(u)
            if u.finished:
                res[1] = u.finish_reason
        if check and not engine.in_flight:
            engine.check_pages()
    engine.check_pages()
    return results


def req(rid, prompt, max_tokens=12, **kw):
    return Request(rid, prompt, kw.pop("sampling", GREEDY), max_tokens, frozenset({EOS}), **kw)


def test_concurrent_equals_one_at_a_time(model_dir):
    ps = prompts(16)
    engine = make_engine(model_dir, max_prefill_tokens=64)
    together = run(engine, [req(str(i), p) for i, p in enumerate(ps)])
    runner = engine.runner
    for i, p in enumerate(ps):
        alone = generate(runner, p, GREEDY, 12, (EOS,))
        assert together[str(i)][0] == alone.token_ids, i


@pytest.mark.parametrize("overlap", [True, False])
def test_chunked_prefill_and_overlap_do_not_change_output(model_dir, overlap):
    ps = prompts(5, seed=1, lo=20, hi=60)
    reference = run(make_engine(model_dir, max_prefill_tokens=4096, prefix_cache=False),
                    [req(str(i), p) for i, p in enumerate(ps)])
    small = run(make_engine(model_dir, max_prefill_tokens=7, overlap=overlap),
                [req(str(i), p) for i, p in enumerate(ps)])
    assert {k: v[0] for k, v in small.items()} == {k: v[0] for k, v in reference.items()}


def test_second_turn_hits_prefix_cache(model_dir):
    engine = make_engine(model_dir)
    first = prompts(1, seed=2, lo=30, hi=31)[0]
    out1 = run(engine, [req("t1", first)])["t1"][0]
    second = first + out1 + prompts(1, seed=3, lo=5, hi=6)[0]
    res = run(engine, [req("t2", second)])["t2"]
    cached = res[2][0].cached_prompt_tokens
    assert cached >= len(first) - engine.pages.page_size
    assert cached <= len(second) - 1
    fresh = run(make_engine(model_dir, prefix_cache=False), [req("t2", second)])["t2"]
    assert res[0] == fresh[0]
    assert fresh[2][0].cached_prompt_tokens == 0


def test_finish_reasons_and_usage(model_dir):
    engine = make_engine(model_dir)
    p = prompts(1, seed=4)[0]
    res = run(engine, [req("len", p, max_tokens=5), req("one", p, max_tokens=1),
                       req("ign", p, max_tokens=9, ignore_eos=True)])
    assert res["len"][1] == "length" and len(res["len"][0]) == 5
    assert res["one"][1] == "length" and len(res["one"][0]) == 1
    assert len(res["ign"][0]) == 9
    assert res["len"][2][-1].prompt_tokens == len(p)
    # EOS: pick the model's own 3rd greedy token as the stop id
    stop_id = res["len"][0][2]
    eos_req = Request("eos", p, GREEDY, 20, frozenset({stop_id}))
    out = run(engine, [eos_req])["eos"]
    assert out[1] == "stop" and out[0][-1] == stop_id and stop_id not in out[0][:-1]


def test_abort_frees_every_page(model_dir):
    engine = make_engine(model_dir, max_prefill_tokens=8)
    ps = prompts(6, seed=6, lo=20, hi=40)
    reqs = [req(str(i), p, max_tokens=30) for i, p in enumerate(ps)]
    for r in reqs:
        engine.submit(r)
    for step in range(6):
        engine.step()
        engine.abort(str(step))  # waiting, prefilling, decoding: each kind gets aborted
    while engine.has_work:
        engine.step()
    engine.check_pages()
    assert engine.pages.pool.num_free + engine.pages.radix.num_pages == engine.pages.pool.capacity
    assert engine.pages.radix.num_locked_pages == 0


def test_pool_pressure_evicts_and_queues(model_dir):
    """More work than KV pages: requests wait, cached prefixes get evicted, all finish correctly."""
    ps = prompts(8, seed=7, lo=30, hi=40)
    tight = run(make_engine(model_dir, kv_tokens=160), [req(str(i), p, max_tokens=10) for i, p in enumerate(ps)])
    roomy = run(make_engine(model_dir), [req(str(i), p, max_tokens=10) for i, p in enumerate(ps)])
    assert {k: v[0] for k, v in tight.items()} == {k: v[0] for k, v in roomy.items()}


def test_decode_takes_pages_as_the_sequence_grows(model_dir):
    engine = make_engine(model_dir)
    r = req("a", prompts(1, seed=9, lo=21, hi=22)[0], max_tokens=30, ignore_eos=True)
    engine.submit(r)
    engine.step()
    pool = engine.pages.pool
    assert len(r.pages) == pool.pages_for(21) < engine.pages.pages_needed(r)  # the prompt's pages, no more
    while len(r.output) < 12:
        engine.step()
    assert len(r.pages) == pool.pages_for(len(r.prompt) + r.launched_outputs - 1 + 1)  # up to the next decode
    while engine.has_work:
        engine.step()
    engine.check_pages()


def test_tight_pool_preempts_and_gives_the_same_tokens(model_dir):
    """Four requests whose prompts fit the pool together but whose full lengths do not: all run at
    once, the newest give their pages back when the pool runs dry and prefill again later (from the
    prefix cache), and every token equals a roomy pool's."""
    ps = prompts(4, seed=8, lo=18, hi=24)

    def reqs():
        return [req(str(i), p, max_tokens=30, ignore_eos=True) for i, p in enumerate(ps)]

    engine = make_engine(model_dir, kv_tokens=160)  # 40 pages of 4; the four need up to 4 x 13
    tight = run(engine, reqs())
    stats = engine.stats()
    roomy = run(make_engine(model_dir), reqs())
    assert stats["requests_preempted"] > 0
    assert {k: v[0] for k, v in tight.items()} == {k: v[0] for k, v in roomy.items()}
    assert all(v[1] == "length" and len(v[0]) == 30 for v in tight.values())
    assert [u.cached_prompt_tokens for v in tight.values() for u in v[2]] == \
        [u.cached_prompt_tokens for v in roomy.values() for u in v[2]]  # usage counts the first admission


@pytest.mark.parametrize("mode", ["writeback", "writethrough"])
def test_preemption_with_a_host_tier_gives_the_same_tokens(model_dir, mode):
    """Two rounds of four sessions at once on a tight pool with a host KV tier: preempted pages go
    to the prefix cache and on to the host, second turns restore them; tokens equal a roomy pool's."""
    first = prompts(4, seed=8, lo=18, hi=24)
    tight = make_engine(model_dir, kv_tokens=160, kv_host_size=64 * 2048 / 2**30, kv_tier_mode=mode)
    roomy = make_engine(model_dir)
    outputs = {}
    for engine in (tight, roomy):
        history = [list(p) for p in first]
        for rnd in range(2):
            got = run(engine, [req(f"{i}.{rnd}", h, max_tokens=24, ignore_eos=True) for i, h in enumerate(history)])
            history = [h + got[f"{i}.{rnd}"][0] + [rnd + 1] for i, h in enumerate(history)]
        outputs[engine is tight] = history
    stats = tight.stats()
    assert stats["requests_preempted"] > 0 and stats["kv_host_pages_restored"] > 0
    assert outputs[True] == outputs[False]


def test_abort_after_preemption_frees_every_page(model_dir):
    engine = make_engine(model_dir, kv_tokens=160)
    for i, p in enumerate(prompts(4, seed=8, lo=18, hi=24)):
        engine.submit(req(str(i), p, max_tokens=30, ignore_eos=True))
    while not engine.counters["requests_preempted"]:
        engine.step()
    for rid in ("3", "2"):
        engine.abort(rid)
    while engine.has_work:
        engine.step()
        if not engine.in_flight:
            engine.check_pages()
    assert engine.pages.pool.num_free + engine.pages.radix.num_pages == engine.pages.pool.capacity


def test_impossible_request_is_refused(model_dir):
    engine = make_engine(model_dir, kv_tokens=64)
    assert "KV pages" in engine.submit(req("big", list(range(60)), max_tokens=30))
    assert "context" in engine.submit(req("ctx", list(range(100)), max_tokens=10_000))


def test_seeded_sampling_is_reproducible_across_batches(model_dir):
    p = prompts(3, seed=8)
    s = SamplingParams(temperature=0.9, top_k=20, top_p=0.9, seed=1234)
    alone = run(make_engine(model_dir), [req("a", p[0], sampling=s)])["a"][0]
    batched = run(make_engine(model_dir), [req("x", p[1], sampling=s), req("a", p[0], sampling=s),
                                           req("y", p[2], sampling=s)])["a"][0]
    other_seed = run(make_engine(model_dir), [req("a", p[0], sampling=SamplingParams(temperature=0.9, top_k=20, top_p=0.9, seed=99))])["a"][0]
    assert alone == batched
    assert alone != other_seed


def test_a_single_sessions_turns_find_their_prefix_in_one_run_of_pages(model_dir, monkeypatch):
    """An agent session alone on the engine: each turn's prompt chunk finds its cached prefix in one
    ascending run of pages, so the long-prefix path reads it where it lies (``cudnn_prefill.prefix_run``,
    ``ForwardBatch.page_table_host``) rather than gathering it."""
    import worker.runner
    from worker.attention.cudnn_prefill import prefix_run

    engine = make_engine(model_dir, kv_tokens=4096, max_prefill_tokens=64)
    pool, real, runs = engine.runner.kv_pool, worker.runner.build_batch, []

    def spy(chunks, page_size, *args, **kw):
        batch = real(chunks, page_size, *args, **kw)
        runs.extend(prefix_run(row, s - n, pool.num_pages, page_size)
                    for row, s, n in zip(batch.page_table_host, batch.seq_lens_host, batch.q_lens) if n > 1 and s > n)
        return batch

    monkeypatch.setattr(worker.runner, "build_batch", spy)
    context = prompts(1, seed=2, lo=30, hi=31)[0]
    for turn in range(8):
        out = run(engine, [req(f"turn{turn}", context, max_tokens=9)])[f"turn{turn}"][0]
        context += out + prompts(1, seed=10 + turn, lo=37, hi=38)[0]
    assert len(runs) >= 7 and runs.count(1) == len(runs)  # every chunk over a prefix: pages 1.. in a run
