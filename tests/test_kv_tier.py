"""The host KV tier: prefixes evicted from the GPU are kept on the host and restored bit for bit;
page accounting holds in both tiers through aborts, evictions and restores."""
from __future__ import annotations

import contextlib
import os
import random
from dataclasses import replace

import pytest
import torch

if not torch.cuda.is_available():  # the Triton variant of the tier test is interpreted on the CPU
    os.environ.setdefault("TRITON_INTERPRET", "1")

from scheduler.engine import Engine, EngineConfig  # noqa: E402
from scheduler.page_manager import PageManager  # noqa: E402
from scheduler.request import Request  # noqa: E402
from tests.tiny_models import write_tiny  # noqa: E402
from worker.kv import page_copy  # noqa: E402
from worker.kv.gpu_pool import KVPool  # noqa: E402
from worker.memory_plan import MemoryPlan  # noqa: E402
from worker.runner import ModelRunner, RunnerConfig  # noqa: E402
from scheduler.messages.to_scheduler import SamplingParams  # noqa: E402

GREEDY = SamplingParams()


def req(rid, prompt, max_tokens=6):
    return Request(rid, list(prompt), GREEDY, max_tokens, frozenset(), ignore_eos=True)


# ==== the tier without a model: KV contents are a function of (token, position) ====

P = 4


def kv_value(token: int, pos: int) -> float:
    return float(token * 1000 + pos)


def write_kv(pool: KVPool, r: Request, upto: int) -> None:
    """Pretend to prefill ``r.prompt[r.prefilled:upto]``: write each token's K (and -K as V)."""
    for pos in range(r.prefilled, upto):
        page, off = r.pages[pos // P], pos % P
        pool.k[:, page, off] = kv_value(r.prompt[pos], pos)
        pool.v[:, page, off] = -kv_value(r.prompt[pos], pos)
    r.prefilled = upto


def assert_prefix_kv(pool: KVPool, r: Request) -> None:
    for pos in range(r.cached_tokens):
        page, off = r.pages[pos // P], pos % P
        want = kv_value(r.prompt[pos], pos)
        assert pool.k[:, page, off].eq(want).all() and pool.v[:, page, off].eq(-want).all(), \
            f"{r.rid}: cached KV at position {pos} is wrong"


def manager(device_pages: int, host_pages: int, mode="writeback", method="kernel", device="cpu") -> PageManager:
    pool = KVPool(2, device_pages + 1, P, 1, 2, torch.float32, torch.device(device))
    return PageManager(pool, True, host_pages * pool.page_bytes, mode, method)


@contextlib.contextmanager
def no_syncs(pm: PageManager):
    """On CUDA, admission and release (the tier's copies included) must not wait for the device."""
    if pm.pool.k.is_cuda:
        torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        if pm.pool.k.is_cuda:
            torch.cuda.set_sync_debug_mode(0)


def wait_for_copies(r: Request) -> None:
    """What the engine does before launching ``r``: its pages may be restored ones, or ones that a
    write-back on the copy stream still reads, so nothing writes them before that copy is done."""
    if r.kv_ready is not None:
        r.kv_ready.synchronize()


def turn(pm: PageManager, r: Request, live: list[Request], abort_at: int | None = None) -> bool:
    """Admit, check the cached KV, 'prefill', release (all of the prompt, or the first ``abort_at``)."""
    with no_syncs(pm):
        admitted = pm.admit(r)
    if not admitted:
        return False
    wait_for_copies(r)
    live.append(r)
    pm.check(live)
    assert_prefix_kv(pm.pool, r)
    upto = len(r.prompt) if abort_at is None else max(r.prefilled, min(abort_at, len(r.prompt)))
    write_kv(pm.pool, r, upto)
    live.remove(r)
    with no_syncs(pm):
        pm.release(r, r.prompt[:upto])
    pm.check(live)
    return True


def test_the_tiers_copy_methods_are_the_page_copies():
    """``scheduler.config`` keeps its own tuple (it imports no torch for ``--help``); it must name
    the methods ``worker.kv.page_copy`` has."""
    from scheduler.config import KV_TIER_COPIES

    assert KV_TIER_COPIES == page_copy.COPY_METHODS


def test_evicted_prefix_is_restored_and_written_back_once():
    pm = manager(device_pages=8, host_pages=16)
    first = list(range(1, 22))  # 5 full pages cached, 6 pages needed
    assert turn(pm, req("a", first, max_tokens=2), [])
    for i in range(3):  # three other sessions push the first one out of the GPU
        assert turn(pm, req(f"o{i}", [100 + i] * 22, max_tokens=2), [])
    match = pm.radix.match(first)
    assert match.num_pages == 0 and match.num_host_pages == 5
    written = pm.stats()["kv_host_pages_written"]
    again = req("a2", first + [7, 8, 9], max_tokens=2)
    assert turn(pm, again, [])
    assert again.cached_tokens == 20 and pm.stats()["kv_prefix_tokens_host"] == 20
    assert pm.stats()["kv_host_pages_restored"] == 5
    # evicting the restored pages again writes nothing: the host still holds them
    for i in range(3):
        turn(pm, req(f"p{i}", [200 + i] * 22, max_tokens=2), [])
    assert pm.radix.match(first).num_host_pages == 5
    # the new sessions' pages and a2's one new page; not a2's five restored ones
    assert pm.stats()["kv_host_pages_written"] - written == 3 * 5 + 1


def test_host_tier_evicts_least_recently_used():
    pm = manager(device_pages=6, host_pages=10)
    sessions = [[10 * s + 1] * 20 for s in range(5)]  # 5 pages each
    for i, s in enumerate(sessions):
        assert turn(pm, req(str(i), s, max_tokens=1), [])
    tiers = [(pm.radix.match(s).num_pages, pm.radix.match(s).num_host_pages) for s in sessions]
    # the newest is on the GPU, the two before it on the host, the oldest two are gone
    assert tiers == [(0, 0), (0, 0), (0, 5), (0, 5), (5, 0)]
    assert pm.stats()["kv_host_pages_used"] == 10


def test_writethrough_mirrors_at_insert_and_evicts_without_writing():
    pm = manager(device_pages=8, host_pages=32, mode="writethrough")
    assert turn(pm, req("a", list(range(1, 22)), max_tokens=2), [])
    assert pm.stats()["kv_host_pages_written"] == 5
    assert pm.radix.match(list(range(1, 22))).num_host_pages == 0  # on both tiers: the GPU match wins
    for i in range(3):
        turn(pm, req(f"o{i}", [100 + i] * 22, max_tokens=2), [])
    assert pm.stats()["kv_host_pages_written"] == 4 * 5  # each session once, when it entered the cache
    again = req("a2", list(range(1, 25)), max_tokens=2)
    assert turn(pm, again, [])
    assert again.cached_tokens == 20 and pm.stats()["kv_host_pages_restored"] == 5


def test_a_session_of_many_turns_comes_back_whole_from_the_host():
    """Each turn of a session is a radix node below the last one: a match must walk the whole chain
    of host-only nodes, not stop after the first (it did: a 4-session agent run on the H200 lost one
    turn of every session's history per turn once the sessions outgrew the GPU pool)."""
    pm = manager(device_pages=8, host_pages=32)
    history = list(range(1, 5))
    for t in range(3):  # three turns: three nodes, one below the other
        history += [50 + t] * 4
        assert turn(pm, req(f"a{t}", history, max_tokens=1), [])
    for i in range(2):  # two other sessions push the whole chain out of the GPU
        assert turn(pm, req(f"o{i}", [100 + i] * 32, max_tokens=1), [])
    match = pm.radix.match(history)
    assert match.num_pages == 0 and len(match.host_nodes) == 3 and match.num_host_pages == 4
    again = req("a3", history + [7, 8, 9], max_tokens=1)
    assert turn(pm, again, [])
    assert again.cached_tokens == 16 and pm.stats()["kv_host_pages_restored"] == 4


def test_tiny_host_pool_drops_what_it_cannot_hold():
    pm = manager(device_pages=8, host_pages=2)
    first = list(range(1, 22))
    assert turn(pm, req("a", first, max_tokens=2), [])
    for i in range(3):
        turn(pm, req(f"o{i}", [100 + i] * 22, max_tokens=2), [])
    assert pm.radix.match(first).num_host_pages == 0  # 5 pages never fit in 2
    assert pm.stats()["kv_host_pages_used"] == 0


@pytest.mark.parametrize("mode,method,kernels", [
    ("writeback", "kernel", "auto"), ("writethrough", "memcpy", "auto"), ("writeback", "kernel", "triton")])
def test_random_sessions_keep_both_tiers_consistent(mode, method, kernels, monkeypatch):
    """Shared prefixes, multi-turn sessions, aborts mid-prompt, both tiers under pressure: the
    self-check holds after every operation and every cached prefix holds the right KV."""
    if kernels == "triton" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("needs TRITON_INTERPRET=1")
    monkeypatch.setenv("SLUICE_KERNELS", kernels)
    monkeypatch.setattr(page_copy, "PLAN_CAPACITY", 8)  # moves of more pages take several launches
    random_sessions(manager(24, 20, mode, method), random.Random(f"{mode}{method}{kernels}"))


@pytest.mark.cuda
@pytest.mark.parametrize("mode,method", [("writeback", "kernel"), ("writethrough", "kernel"), ("writeback", "memcpy")])
def test_random_sessions_on_cuda_without_syncs(mode, method, monkeypatch):
    """The same on a GPU: copy stream, mapped host pool, and no host wait in admit or release. Every
    copy first stalls its stream (about 0.1 ms), so that a write that does not wait for a copy it must
    wait for lands first and fails the contents check without needing a busy GPU (not yet shown by a
    run with the wait removed)."""
    monkeypatch.setattr(page_copy, "PLAN_CAPACITY", 8)
    pm = manager(24, 20, mode, method, device="cuda")
    launch = pm.tier._launch

    def stalled(kind: str, src: list[int], dst: list[int]) -> None:
        torch.cuda._sleep(200_000)  # GPU cycles on the copy stream (the caller's), before the copy
        launch(kind, src, dst)

    monkeypatch.setattr(pm.tier, "_launch", stalled)
    random_sessions(pm, random.Random(f"{mode}{method}"))


def random_sessions(pm: PageManager, rng: random.Random) -> None:
    system = [rng.randrange(1, 50) for _ in range(9)]
    history = {s: system + [rng.randrange(1, 50) for _ in range(rng.randrange(0, 8))] for s in range(6)}
    live: list[Request] = []
    for step in range(60):
        s = rng.randrange(6)
        prompt = history[s] + [rng.randrange(1, 50) for _ in range(rng.randrange(1, 9))]
        prompt = prompt[-60:]
        if rng.random() < 0.3:  # a request holding pages across other turns
            held = req(f"h{step}", prompt, max_tokens=rng.randrange(1, 8))
            with no_syncs(pm):
                admitted = pm.admit(held)
            if admitted:
                wait_for_copies(held)  # it wrote at once: under a busy GPU it raced the write-backs
                live.append(held)
                pm.check(live)
                write_kv(pm.pool, held, len(held.prompt))
            continue
        abort = rng.randrange(len(prompt)) if rng.random() < 0.2 else None
        turn(pm, req(f"r{step}", prompt, max_tokens=rng.randrange(1, 8)), live, abort)
        history[s] = prompt
        if live and rng.random() < 0.5:
            done = live.pop(rng.randrange(len(live)))
            with no_syncs(pm):
                pm.release(done, done.prompt)
            pm.check(live)
    stats = pm.stats()
    assert stats["kv_host_pages_written"] > 0 and stats["kv_host_pages_restored"] > 0
    for r in list(live):
        live.remove(r)
        pm.release(r, r.prompt[:3])
        pm.check(live)
    assert pm.radix.num_locked_pages == 0
    assert pm.pool.num_free + pm.radix.num_pages == pm.pool.capacity


# ==== the engine on real models: restored KV gives the same logits and tokens ====

class LogitsRecorder:
    """Stands in for ``runner.forward`` and keeps each step's logits."""

    def __init__(self, runner: ModelRunner):
        self.forward = runner.forward
        self.logits: list[torch.Tensor] = []

    def __call__(self, *args, **kwargs):
        out = self.forward(*args, **kwargs)
        self.logits.append(out.logits.clone())
        return out


def run_one(engine: Engine, r: Request, record: bool = False) -> tuple[list[int], list[torch.Tensor], int]:
    """One request alone; returns its tokens, its steps' logits and its cached prompt tokens."""
    recorder = LogitsRecorder(engine.runner)
    if record:
        engine.runner.forward = recorder
    try:
        assert engine.submit(r) is None
        tokens, cached = [], None
        while engine.has_work:
            for u in engine.step():
                tokens += u.token_ids
                cached = u.cached_prompt_tokens
            if not engine.in_flight:
                engine.check_pages()
    finally:
        if record:
            del engine.runner.forward  # back to the method
    engine.check_pages()
    return tokens, recorder.logits, cached


def drain(engine: Engine) -> None:
    """Hand every cached page back to the pool, so another engine can share the runner."""
    pages = engine.pages
    freed, _ = pages.radix.evict(pages.pool.capacity, lambda node: None)
    pages.pool.free(freed)
    assert pages.pool.num_free == pages.pool.capacity


def sessions(vocab: int, lengths: list[int], seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(1, vocab - 1, (n,), generator=gen).tolist() for n in lengths]


def planned(runner: ModelRunner, host_gib: float, prefill_tokens: int | None = None) -> MemoryPlan:
    """The runner's memory plan with a host KV tier of ``host_gib`` (and a prefill chunk of
    ``prefill_tokens``): one runner serves engines of several tiers."""
    chunk = {"prefill_tokens": prefill_tokens} if prefill_tokens else {}
    return replace(runner.plan, host_kv_bytes=int(host_gib * 2**30), **chunk)


def check_restore_parity(runner: ModelRunner, lengths: list[int], host_gib: float, mode: str,
                         exact: bool = True) -> None:
    """Session 0's second turn after the other sessions pushed its KV to the host, against the same
    turn with its KV never evicted (same runner, no other sessions). ``exact``: bitwise equal logits
    (on a GPU, atomics in the MoE may reorder float sums from one run to the next)."""
    vocab = runner.model_config.vocab_size
    first, *others = sessions(vocab, lengths, seed=3)
    follow = sessions(vocab, [5], seed=4)[0]
    config, plan = EngineConfig(kv_tier_mode=mode), planned(runner, host_gib, prefill_tokens=64)

    engine = Engine(runner, config, plan=plan)
    out1, _, _ = run_one(engine, req("s0", first, max_tokens=3))
    second = first + out1 + follow
    want_tokens, want_logits, want_cached = run_one(engine, req("s0b", second, max_tokens=3), record=True)
    assert engine.stats()["kv_host_pages_restored"] == 0
    drain(engine)

    engine = Engine(runner, config, plan=plan)
    assert run_one(engine, req("s0", first, max_tokens=3))[0] == out1
    for i, prompt in enumerate(others):
        run_one(engine, req(f"o{i}", prompt, max_tokens=3))
    match = engine.pages.radix.match(second[:-1])
    assert match.num_pages == 0 and match.num_host_pages * runner.page_size == want_cached, \
        "the other sessions should have pushed all of session 0 to the host"
    tokens, logits, cached = run_one(engine, req("s0b", second, max_tokens=3), record=True)
    stats = engine.stats()
    drain(engine)
    assert cached == want_cached and stats["kv_prefix_tokens_host"] == want_cached
    assert stats["kv_host_pages_restored"] * runner.page_size == want_cached
    assert tokens == want_tokens
    assert len(logits) == len(want_logits)
    for a, b in zip(logits, want_logits):
        if exact:
            assert torch.equal(a, b), "restored KV changed the logits"
        else:
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


@pytest.fixture(scope="module")
def tiny_runner(tmp_path_factory) -> ModelRunner:
    path = tmp_path_factory.mktemp("tiny")
    write_tiny(path, "qwen3_moe", seed=5, layers=2, experts=8, top_k=2)
    return ModelRunner(RunnerConfig(str(path), device="cpu", dtype="float32", page_size=4, kv_tokens=160))


@pytest.fixture(scope="module")
def default_runner() -> ModelRunner:
    try:
        from worker.default_model import default_model_dir

        model_dir = default_model_dir()
    except Exception as err:  # no GGUF package offline: nothing to build it from
        pytest.skip(f"default model unavailable: {err}")
    return ModelRunner(RunnerConfig(str(model_dir), device="cpu", dtype="float32", page_size=8, kv_tokens=64))


@pytest.mark.parametrize("mode", ["writeback", "writethrough"])
def test_tiny_model_restored_prefix_matches_never_evicted(tiny_runner, mode):
    check_restore_parity(tiny_runner, [37, 40, 40, 40, 40], host_gib=1 / 1024, mode=mode)  # 40 GPU pages


@pytest.mark.cuda
@pytest.mark.parametrize("mode", ["writeback", "writethrough"])
def test_tiny_model_on_cuda_restored_prefix_matches_never_evicted(tmp_path, mode):
    write_tiny(tmp_path, "qwen3_moe", seed=5, layers=2, experts=8, top_k=2)
    runner = ModelRunner(RunnerConfig(str(tmp_path), device="cuda", dtype="float32", page_size=4, kv_tokens=160))
    check_restore_parity(runner, [37, 40, 40, 40, 40], host_gib=1 / 1024, mode=mode, exact=False)


def test_default_model_restored_prefix_matches_never_evicted(default_runner):
    check_restore_parity(default_runner, [24, 32, 32], host_gib=1 / 64, mode="writeback")  # 8 GPU pages


def test_big_pool_gives_the_same_tokens(tiny_runner, tmp_path):
    """The whole workload on a roomy pool (nothing evicted) against the small pool with a host tier."""
    write_tiny(tmp_path, "qwen3_moe", seed=5, layers=2, experts=8, top_k=2)
    roomy = Engine(ModelRunner(RunnerConfig(str(tmp_path), device="cpu", dtype="float32", page_size=4, kv_tokens=2048)))
    tight = Engine(tiny_runner, plan=planned(tiny_runner, 1 / 1024))
    prompts = sessions(tiny_runner.model_config.vocab_size, [30, 35, 38, 33], seed=9)
    outputs = {}
    for engine in (roomy, tight):
        history = [list(p) for p in prompts]
        got = []
        for turn_no in range(3):
            for i, h in enumerate(history):
                tokens = run_one(engine, req(f"{i}.{turn_no}", h, max_tokens=3))[0]
                got.append(tokens)
                history[i] = h + tokens + [turn_no + 1]
        outputs[engine is roomy] = got
    stats = tight.stats()
    drain(tight)
    assert stats["kv_host_pages_restored"] > 0 and stats["kv_host_pages_written"] > 0
    assert outputs[True] == outputs[False]


def concurrent_turns(engine: Engine, history: list[list[int]], turn_no: int, new: int, rng: random.Random,
                     vocab: int) -> list[int]:
    """One turn of every session at once (a tool result of ``new`` tokens each); their cached tokens."""
    prompts = [h + [rng.randrange(1, vocab - 1) for _ in range(new)] for h in history]
    reqs = [req(f"{i}.{turn_no}", p, max_tokens=2) for i, p in enumerate(prompts)]
    for r in reqs:
        assert engine.submit(r) is None
    out, cached = {r.rid: [] for r in reqs}, {}
    while engine.has_work:
        for u in engine.step():
            out[u.rid] += u.token_ids
            if u.cached_prompt_tokens is not None:
                cached[u.rid] = u.cached_prompt_tokens
    history[:] = [p + out[r.rid] for p, r in zip(prompts, reqs)]
    return [cached[r.rid] for r in reqs]


@pytest.mark.parametrize("mode", ["writeback", "writethrough"])
def test_concurrent_sessions_beyond_the_gpu_pool_keep_their_whole_history(tiny_runner, mode):
    """Four agent sessions that together outgrow the GPU pool (160 tokens) twice over: with
    the host tier every later turn finds all of its history's whole pages cached, as on a roomy pool."""
    engine = Engine(tiny_runner, EngineConfig(kv_tier_mode=mode), plan=planned(tiny_runner, 1 / 1024))
    vocab, rng = tiny_runner.model_config.vocab_size, random.Random(7)
    history = [[rng.randrange(1, vocab - 1) for _ in range(24)] for _ in range(4)]
    try:  # the runner is shared: its pool goes back whole even when a turn fails
        concurrent_turns(engine, history, 0, 0, rng, vocab)
        for turn_no in range(1, 7):  # to 4 x 86 tokens
            ideal = [(len(h) - 1) // P * P for h in history]  # whole pages; the last sampled token has no KV
            assert concurrent_turns(engine, history, turn_no, 8, rng, vocab) == ideal, f"turn {turn_no}"
        stats = engine.stats()
        engine.check_pages()
    finally:
        drain(engine)
    assert sum(map(len, history)) > 2 * 160 and stats["kv_host_pages_restored"] > 0


@pytest.mark.parametrize("mode", ["writeback", "writethrough"])
def test_engine_aborts_with_host_tier_leak_nothing(tiny_runner, mode):
    engine = Engine(tiny_runner, EngineConfig(kv_tier_mode=mode),
                    plan=planned(tiny_runner, 16 * 2048 / 2**30, prefill_tokens=8))  # 16 pages
    rng = random.Random(5)
    prompts = sessions(tiny_runner.model_config.vocab_size, [rng.randrange(20, 40) for _ in range(8)], seed=11)
    prompts += [p + [9, 9] for p in prompts[:4]]  # later turns of earlier sessions
    for i, p in enumerate(prompts):
        assert engine.submit(req(str(i), p, max_tokens=rng.randrange(1, 6))) is None
    step = 0
    while engine.has_work:
        engine.step()
        if step % 3 == 1:
            engine.abort(str(rng.randrange(len(prompts))))
        if not engine.in_flight:
            engine.check_pages()
        step += 1
    engine.check_pages()
    stats = engine.stats()
    drain(engine)
    assert stats["kv_host_pages_written"] > 0
    assert engine.pages.radix.num_locked_pages == 0


class SlowCopies:
    """Stands in for the copy event of a restore: unfinished for the first ``polls`` queries."""

    def __init__(self, polls: int):
        self.polls, self.waited = polls, False

    def query(self) -> bool:
        self.polls -= 1
        return self.waited or self.polls < 0

    def wait(self) -> None:  # the compute stream waits for it
        self.waited = True


def admitted_with(engine: Engine, copies: SlowCopies, monkeypatch) -> None:
    """The next admission gets ``copies`` as its pending page copies."""
    real = engine.pages.tier.pending
    monkeypatch.setattr(engine.pages.tier, "pending", lambda: copies if not copies.waited and copies.polls > 0 else real())


def test_request_waits_for_its_page_copies_while_others_decode(tiny_runner, monkeypatch):
    vocab = tiny_runner.model_config.vocab_size
    first, second = sessions(vocab, [21, 26], seed=4)
    want = alone(tiny_runner, req("b", second, max_tokens=4))
    engine = Engine(tiny_runner, plan=planned(tiny_runner, 1 / 1024))
    a = req("a", first, max_tokens=12)
    engine.submit(a)
    while not a.output:
        engine.step()
    copies = SlowCopies(polls=3)
    admitted_with(engine, copies, monkeypatch)
    b = req("b", second, max_tokens=4)
    engine.submit(b)
    for _ in range(3):
        outputs = len(a.output)
        engine.step()
        assert b.kv_ready is copies and b.prefilled == b.cached_tokens, "b launched before its copies finished"
        assert len(a.output) == outputs + 1, "a stopped decoding while b waited"
    tokens = []
    while engine.has_work:
        tokens += [t for u in engine.step() if u.rid == "b" for t in u.token_ids]
    assert tokens == want and not copies.waited  # polled to completion, never waited for
    engine.check_pages()
    drain(engine)


def test_lone_request_goes_behind_a_wait_for_its_page_copies(tiny_runner, monkeypatch):
    (prompt,) = sessions(tiny_runner.model_config.vocab_size, [23], seed=6)
    want = alone(tiny_runner, req("x", prompt, max_tokens=3))
    engine = Engine(tiny_runner, plan=planned(tiny_runner, 1 / 1024))
    copies = SlowCopies(polls=10**9)
    admitted_with(engine, copies, monkeypatch)
    assert run_one(engine, req("x", prompt, max_tokens=3))[0] == want
    drain(engine)
    assert copies.waited  # nothing else to run: launched behind a stream wait instead of spinning


def alone(runner: ModelRunner, r: Request) -> list[int]:
    """``r``'s tokens from a fresh engine that leaves the runner's pool empty again."""
    engine = Engine(runner)
    tokens = run_one(engine, r)[0]
    drain(engine)
    return tokens
