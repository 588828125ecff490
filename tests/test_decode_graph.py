"""The paged Triton decode attention against its eager twin (interpreted on the CPU, compiled in
bf16 on a GPU) and against the torch backend, and CUDA-graph decode steps against eager ones:
logits, greedy and sampled tokens, offloaded experts, the engine's overlap loop."""
from __future__ import annotations

import os
import types

import pytest
import torch

# The interpreter is chosen when a kernel is decorated, i.e. when the kernel is first built, which
# happens lazily inside the tests; on a GPU the kernels must compile instead.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from moe_offload.experts import ResidentExperts  # noqa: E402
from moe_offload.offloaded import OffloadedExperts  # noqa: E402
from scheduler.engine import Engine, EngineConfig  # noqa: E402
from scheduler.request import Request  # noqa: E402
from tests.tiny_models import write_tiny  # noqa: E402
from worker.attention import create_backend  # noqa: E402
from worker.attention.triton_decode import (BLOCK_N, REDUCE_CHUNK, SPLIT_MIN_TOKENS,  # noqa: E402
                                            paged_decode_attention, paged_decode_attention_eager, row_splits,
                                            split_plan)
from worker.batch import SequenceChunk, build_batch  # noqa: E402
from worker.cuda_graph import BUCKETS, DecodeGraphs, decode_buckets  # noqa: E402
from worker.expert_placement import ExpertOptions  # noqa: E402
from worker.runner import ModelRunner, RunnerConfig  # noqa: E402
from scheduler.messages.to_scheduler import SamplingParams  # noqa: E402

interpreted = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs TRITON_INTERPRET=1")
GREEDY = SamplingParams()
SAMPLED = SamplingParams(temperature=0.8, top_k=20, top_p=0.9, seed=7)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12)).item()


def decode_case(gen, B, heads, kv_heads, D, page, max_pages, num_pages, dtype=torch.float32, device="cpu",
                lens=None):
    """Random q, caches and page tables; seq lens cover 0, 1, page-aligned and full rows."""
    q = torch.randn(B, heads, D, generator=gen).to(dtype).to(device)
    k = torch.randn(num_pages, page, kv_heads, D, generator=gen).to(dtype).to(device)
    v = torch.randn(num_pages, page, kv_heads, D, generator=gen).to(dtype).to(device)
    table = torch.randint(0, num_pages, (B, max_pages), generator=gen)
    if lens is None:
        full = max_pages * page
        edges = [0, 1, page, full, min(2 * page, full), full - 1]
        lens = [edges[b] if b < len(edges) else int(torch.randint(1, full + 1, (1,), generator=gen))
                for b in range(B)]
    return q, k, v, table.to(device), torch.tensor(lens, device=device)


# ==== the kernel against its twin (CPU, interpreted) ====

KERNEL_CONFIGS = [  # B, heads, kv_heads, D, page, max_pages, num_pages
    (6, 4, 2, 16, 4, 12, 20),  # GQA 2
    (7, 8, 1, 32, 16, 5, 9),  # GQA 8 (qwen3's ratio), page 16
    (6, 3, 3, 8, 1, 70, 80),  # no GQA, head dim below 16, page of one token
    (6, 5, 1, 24, 8, 9, 12),  # odd group, head dim not a power of two
]


@interpreted
@pytest.mark.parametrize("config", KERNEL_CONFIGS, ids=lambda c: "-".join(map(str, c)))
def test_kernel_matches_twin(config):
    B, heads, kv_heads, D, page, max_pages, num_pages = config
    gen = torch.Generator().manual_seed(sum(config))
    for trial, splits in enumerate((None, 1, 2, 3)):
        q, k, v, table, lens = decode_case(gen, B, heads, kv_heads, D, page, max_pages, num_pages)
        if trial == 3:  # int32 tables and lens, garbage past each row's pages
            table, lens = table.int(), lens.int()
        out = paged_decode_attention(q, k, v, table, lens, D ** -0.5, num_splits=splits, backend="triton")
        want = paged_decode_attention_eager(q, k, v, table, lens, D ** -0.5)
        assert torch.isfinite(out).all()
        torch.testing.assert_close(out, want, rtol=1e-4, atol=1e-5)
        assert (out[lens == 0] == 0).all()


@interpreted
def test_rows_of_one_split_and_of_two_agree_with_the_twin():
    """A row whose keys fit one split is written by that split's program (the merge skips it);
    the rows just past the boundary take the merge."""
    gen = torch.Generator().manual_seed(9)
    B, heads, kv_heads, D, page, max_pages, num_pages = 6, 4, 2, 16, 4, 48, 60
    splits, min_split = split_plan(B, kv_heads, max_pages * page, num_splits=3)
    lens = [BLOCK_N - 1, BLOCK_N, BLOCK_N + 1, 2 * BLOCK_N + 1, 0, 1]
    assert [row_splits(n, splits, min_split)[2] for n in lens] == [1, 1, 2, 3, 0, 1]
    q, k, v, table, lens = decode_case(gen, B, heads, kv_heads, D, page, max_pages, num_pages, lens=lens)
    out = paged_decode_attention(q, k, v, table, lens, D ** -0.5, num_splits=3, backend="triton")
    torch.testing.assert_close(out, paged_decode_attention_eager(q, k, v, table, lens, D ** -0.5), rtol=1e-4, atol=1e-5)
    assert splits == 3 and (out[4] == 0).all()


@interpreted
@pytest.mark.parametrize("winner", ["first", "last"])
def test_rows_of_hundreds_of_splits_merge_across_reduce_steps(winner):
    """Rows of 1-3 reduce steps (REDUCE_CHUNK splits each) merge as the twin does, whether the
    largest score lies in the first step or the last (which rescales what the steps before summed)."""
    gen = torch.Generator().manual_seed(11)
    B, heads, kv_heads, D, page = 4, 4, 2, 16, 64
    num_splits = 2 * REDUCE_CHUNK + 9
    splits, min_split = split_plan(B, kv_heads, num_splits * page, num_splits=num_splits)
    lens = [REDUCE_CHUNK * page + 5, num_splits * page, 2 * page + 1, REDUCE_CHUNK * page]
    assert splits == num_splits and {row_splits(n, splits, min_split)[1] for n in lens} == {page}
    q, k, v, table, lens = decode_case(gen, B, heads, kv_heads, D, page, num_splits, num_splits + 2, lens=lens)
    table = torch.arange(num_splits).repeat(B, 1)  # split s is page s: the winning key lies in a known split
    at = 3 if winner == "first" else int(lens[0]) - 2
    k[at // page, at % page] = q[0].view(kv_heads, -1, D).mean(1) * 8  # row 0's queries peak there
    out = paged_decode_attention(q, k, v, table, lens, D ** -0.5, num_splits=num_splits, backend="triton")
    want = paged_decode_attention_eager(q, k, v, table, lens, D ** -0.5)
    torch.testing.assert_close(out, want, rtol=1e-4, atol=1e-5)
    scores = torch.einsum("hd,thd->ht", q[0].float(), k.flatten(0, 1)[:int(lens[0])].repeat_interleave(2, 1).float())
    assert (scores.argmax(1) == at).all()


@interpreted
def test_kernel_clamps_device_data():
    """Padded rows: seq_len past the table, negative, and page ids outside the pool are clamped
    the same way in kernel and twin, never read out of bounds."""
    gen = torch.Generator().manual_seed(5)
    q, k, v, table, _ = decode_case(gen, 4, 4, 2, 16, 4, 3, 6)
    table[0] = torch.tensor([-3, 99, 5])
    lens = torch.tensor([12, 40, -2, 1])
    out = paged_decode_attention(q, k, v, table, lens, 0.3, backend="triton")
    torch.testing.assert_close(out, paged_decode_attention_eager(q, k, v, table, lens, 0.3), rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(out[1], paged_decode_attention_eager(q[1:2], k, v, table[1:2], lens[:1], 0.3)[0])
    assert (out[2] == 0).all()


def test_split_plan_covers_the_table():
    for batch, kv_heads, max_tokens in [(1, 4, 40960), (64, 4, 40960), (1, 1, 1), (3, 2, 100), (8, 8, 65536)]:
        splits, min_split = split_plan(batch, kv_heads, max_tokens)
        assert splits >= 1 and min_split == SPLIT_MIN_TOKENS
        assert row_splits(max_tokens, splits, min_split)[2] <= splits  # the table's widest row fits the grid
    assert split_plan(1, 4, 40960)[0] > split_plan(64, 4, 40960)[0] >= 1  # small batches split more


def test_each_row_cuts_its_own_length():
    """Every row's splits cover its keys (the window's alone where one is set) in multiples of
    BLOCK_N, within the grid; a short row in a wide table (a decode graph's) still takes many."""
    for splits, min_split in [(256, SPLIT_MIN_TOKENS), (3, BLOCK_N), (1, SPLIT_MIN_TOKENS), (64, SPLIT_MIN_TOKENS)]:
        for seq_len in [0, 1, 63, 64, 65, 255, 256, 257, 4096, 4097, 40000, 131072, 140000]:
            for window in (0, 128, 5000):
                lo, split_len, active = row_splits(seq_len, splits, min_split, window)
                span = seq_len - lo
                assert lo == (max(seq_len - window, 0) if window else 0)
                assert split_len % BLOCK_N == 0 and 0 <= active <= splits
                assert (active - 1) * split_len < span <= active * split_len or span == active == 0
    wide = split_plan(1, 4, 140000)
    assert row_splits(4096, *wide)[2] == 4096 // SPLIT_MIN_TOKENS and row_splits(140000, *wide)[2] > wide[0] * 3 // 4


def test_host_checks_raise():
    gen = torch.Generator().manual_seed(0)
    q, k, v, table, lens = decode_case(gen, 2, 4, 2, 16, 4, 3, 6)
    with pytest.raises(ValueError, match="multiple"):
        paged_decode_attention(q[:, :3], k, v, table, lens, 1.0)
    with pytest.raises(ValueError, match="rows"):
        paged_decode_attention(q, k, v, table[:1], lens, 1.0)
    with pytest.raises(ValueError, match="int32/int64"):
        paged_decode_attention(q, k, v, table.float(), lens, 1.0)
    with pytest.raises(ValueError, match="do not match"):
        paged_decode_attention(q, k, v[..., :8], table, lens, 1.0)
    with pytest.raises(ValueError, match="share"):
        paged_decode_attention(q.double(), k.double(), v.double(), table, lens, 1.0)


# ==== the twin against the torch backend (same math) ====

def test_triton_backend_matches_torch_backend():
    """Decode batches through the twin, prefill through the torch backend: both equal the torch
    backend's output over the same pool."""
    from worker.kv.gpu_pool import KVPool

    gen = torch.Generator().manual_seed(1)
    pool = KVPool(1, 40, 4, 2, 16, torch.float32, torch.device("cpu"))
    pool.k.normal_(generator=gen)
    pool.v.normal_(generator=gen)
    torch_attn, triton_attn = create_backend("torch", pool, 0.25), create_backend("triton", pool, 0.25)
    pages = [pool.allocate(n) for n in (1, 3, 4, 9)]
    for chunks in ([SequenceChunk([1], 0, pages[0]), SequenceChunk([2], 11, pages[1]),
                    SequenceChunk([3], 15, pages[2]), SequenceChunk([4], 33, pages[3])],
                   [SequenceChunk([5, 6, 7], 4, pages[2]), SequenceChunk([8], 20, pages[3])]):
        batch = build_batch(chunks, 4, torch.device("cpu"))
        q = torch.randn(batch.num_tokens, 4, 16, generator=gen)
        k, v = torch.randn(2, batch.num_tokens, 2, 16, generator=gen)
        pool.store(0, batch.out_loc, k, v)
        want = torch_attn.forward(0, q, k, v, batch)
        torch.testing.assert_close(triton_attn.forward(0, q, k, v, batch), want, rtol=1e-5, atol=1e-5)


# ==== buckets ====

def test_buckets_stop_below_the_prefill_pipeline():
    resident = ResidentExperts(None).pipeline_from(8)
    assert decode_buckets(64, resident) == BUCKETS
    assert decode_buckets(40, resident) == (1, 2, 4, 8, 16, 24, 32, 40)
    qwen3 = offloaded_pipeline_from(num_experts=128, top_k=8)  # k=8: 64 tokens pipeline
    assert decode_buckets(64, qwen3) == (1, 2, 4, 8, 16, 24, 32, 48, 63)
    tiny = offloaded_pipeline_from(num_experts=8, top_k=2)
    assert decode_buckets(64, tiny) == (1, 2, 4, 8, 15)
    assert decode_buckets(0, resident) == ()


def offloaded_pipeline_from(num_experts: int, top_k: int) -> int | None:
    """``OffloadedExperts.pipeline_from`` of a cache of ``num_experts`` per layer, with a pipeline."""
    fake = types.SimpleNamespace(pipeline=object(), cache=types.SimpleNamespace(num_experts=num_experts))
    return OffloadedExperts.pipeline_from(fake, top_k)


# ==== the static-buffer step, eagerly on the CPU ====

@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-graph")
    write_tiny(path, "qwen3_moe", seed=2, layers=2, heads=8, kv_heads=2, head_dim=16, experts=8, top_k=2)
    return str(path)


def prefill(runner, prompts, extra=16):
    pool = runner.kv_pool
    pages = [pool.allocate(pool.pages_for(len(p) + extra)) for p in prompts]
    out = runner.forward([SequenceChunk(p, 0, pg) for p, pg in zip(prompts, pages)], [GREEDY] * len(prompts),
                         [0] * len(prompts))
    return pages, out.next_tokens.tolist()


def test_static_buffer_step_matches_eager_on_cpu(tiny_dir):
    """The graphs' packing (padding rows, the token buffer, sampling fields, page tables) run
    eagerly: same logits and tokens as the eager decode step."""
    runner = ModelRunner(RunnerConfig(tiny_dir, device="cpu", dtype="float32", page_size=4, kv_tokens=512))
    assert runner.graphs is None  # CPU behaviour is unchanged
    cfg = runner.model_config
    graphs = DecodeGraphs(runner.model, create_backend("triton", runner.kv_pool, cfg.head_dim ** -0.5),
                          runner.kv_pool, cfg.max_context, 8, use_graphs=False)
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 128, (n,), generator=gen).tolist() for n in (3, 4, 9, 13, 2)]
    pages, tokens = prefill(runner, prompts)
    token_buffer = torch.tensor([0, 0, 0] + tokens, dtype=torch.int64)  # rows 3.. hold the prompts' tokens
    params = [GREEDY, SAMPLED, GREEDY, SamplingParams(temperature=1.0, seed=3), GREEDY]
    lens = [len(p) for p in prompts]
    for step, batch in enumerate((5, 3, 1, 2, 5, 4)):
        chunks = [SequenceChunk([0], lens[b], pages[b], buffer_slot=3 + b) if step % 2
                  else SequenceChunk([tokens[b]], lens[b], pages[b]) for b in range(batch)]
        args = (params[:batch], [step + 1] * batch, token_buffer)
        want = runner.forward(chunks, *args)
        assert graphs.supports(chunks)
        logits, nxt = graphs.run(chunks, *args)
        torch.testing.assert_close(logits, want.logits, rtol=1e-5, atol=1e-5)
        assert nxt.tolist() == want.next_tokens.tolist()
        tokens[:batch] = nxt.tolist()
        token_buffer[3:3 + batch] = nxt
        lens[:batch] = [n + 1 for n in lens[:batch]]
    assert sorted(graphs.captured) == [1, 2, 4, 8]
    assert not graphs.supports([SequenceChunk([1, 2], 0, pages[0])])
    assert not graphs.supports([SequenceChunk([1], 0, pages[0])] * 9)


def test_static_buffer_step_of_a_hybrid_model_matches_eager_on_cpu(tmp_path):
    """A hybrid model's decode through the graphs' packing: each row's state slot travels in the
    input block, padded rows write the scratch slot; logits and every slot's state equal the eager
    step's (a fresh sequence, whose slot the step would clear, is left to the eager path)."""
    from tests.tiny_hybrid import write_tiny_hybrid

    write_tiny_hybrid(tmp_path, "qwen3_next", seed=2, layer_types=("linear_attention", "full_attention"))
    runner = ModelRunner(RunnerConfig(str(tmp_path), device="cpu", dtype="float32", page_size=4, kv_tokens=512,
                                      state_slots=6, state_snapshots=1))
    cfg, states = runner.model_config, runner.state_pool
    graphs = DecodeGraphs(runner.model, create_backend("triton", runner.kv_pool, cfg.head_dim ** -0.5),
                          runner.kv_pool, cfg.max_context, 8, use_graphs=False)
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 120, (n,), generator=gen).tolist() for n in (3, 9, 6)]
    pool = runner.kv_pool
    pages = [pool.allocate(pool.pages_for(len(p) + 4)) for p in prompts]
    slots = [5, 2, 4]  # not 1..B: the rows' slots must travel, not be implied
    out = runner.forward([SequenceChunk(p, 0, pg, state_slot=s) for p, pg, s in zip(prompts, pages, slots)],
                         [GREEDY] * 3, [0] * 3)
    tokens, lens = out.next_tokens.tolist(), [len(p) for p in prompts]
    for step in range(3):
        chunks = [SequenceChunk([tokens[b]], lens[b], pages[b], state_slot=slots[b]) for b in range(3)]
        before = (states.conv.clone(), states.ssm.clone())
        want = runner.forward(chunks, [GREEDY] * 3, [step + 1] * 3)
        after = (states.conv.clone(), states.ssm.clone())
        states.conv.copy_(before[0])
        states.ssm.copy_(before[1])
        assert graphs.supports(chunks)
        logits, nxt = graphs.run(chunks, [GREEDY] * 3, [step + 1] * 3)  # bucket 4: one padded row
        torch.testing.assert_close(logits, want.logits, rtol=1e-5, atol=1e-5)
        owned = list(range(1, states.num_slots))  # every slot but the scratch one
        torch.testing.assert_close(states.ssm[:, owned], after[1][:, owned], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(states.conv[:, owned], after[0][:, owned], rtol=1e-5, atol=1e-6)
        tokens, lens = nxt.tolist(), [n + 1 for n in lens]
    assert not graphs.supports([SequenceChunk([1], 0, pages[0], state_slot=1)])


# ==== on a GPU ====

@pytest.mark.cuda
@pytest.mark.parametrize("config", [(5, 32, 4, 128, 16, 2560), (8, 16, 2, 64, 16, 300), (3, 9, 3, 64, 1, 700),
                                    (4, 8, 8, 128, 64, 40)], ids=lambda c: "-".join(map(str, c)))
def test_kernel_matches_twin_bf16_on_gpu(config):
    B, heads, kv_heads, D, page, max_pages = config
    gen = torch.Generator().manual_seed(B)
    num_pages = B * max_pages + 1
    for trial in range(3):
        q, k, v, table, lens = decode_case(gen, B, heads, kv_heads, D, page, max_pages, num_pages,
                                           torch.bfloat16, "cuda")
        torch.cuda.set_sync_debug_mode("error" if trial else "default")  # trial 0 compiles
        try:
            out = paged_decode_attention(q, k, v, table, lens, D ** -0.5)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        want = paged_decode_attention_eager(q, k, v, table, lens, D ** -0.5)
        assert torch.isfinite(out).all()
        torch.testing.assert_close(out, want, rtol=2e-2, atol=2e-2)


def gpu_runner(model_dir, dtype, graph, **experts):
    return ModelRunner(RunnerConfig(model_dir, device="cuda", dtype=dtype, page_size=16, kv_tokens=8192,
                                    cuda_graph=graph, experts=ExpertOptions(**experts)))


def decode_in_lockstep(graphed, eager, batches, tol, steps=3):
    """Prefill the same prompts in both runners, then decode batches of the given sizes with the
    eager runner's tokens fed to both (teacher forcing: a near-tie flipped in bf16 cannot derail
    the comparison). Graph replays run under sync debug mode "error"."""
    gen = torch.Generator().manual_seed(11)
    prompts = [torch.randint(0, 128, (int(torch.randint(1, 60, (1,), generator=gen)),), generator=gen).tolist()
               for _ in range(max(batches))]
    pages, tokens = prefill(eager, prompts, extra=steps * len(batches) + 1)
    assert prefill(graphed, prompts, extra=steps * len(batches) + 1)[0] == pages
    graphed.graphs.capture_all()
    lens = [len(p) for p in prompts]
    params = [GREEDY if b % 3 else SAMPLED for b in range(max(batches))]
    for batch in batches:
        for _ in range(steps):
            chunks = [SequenceChunk([tokens[b]], lens[b], pages[b]) for b in range(batch)]
            args = (params[:batch], [lens[b] for b in range(batch)])
            want = eager.forward(chunks, *args)
            torch.cuda.set_sync_debug_mode("error")
            try:
                got = graphed.forward(chunks, *args)
                logits, nxt = got.logits.clone(), got.next_tokens.clone()
            finally:
                torch.cuda.set_sync_debug_mode("default")
            for b in range(batch):
                assert rel_err(logits[b], want.logits[b]) < tol, (batch, b)
                top2 = want.logits[b].topk(2).values
                if params[b] is GREEDY and (top2[0] - top2[1]) > 5 * tol * want.logits[b].abs().max():
                    assert nxt[b] == want.next_tokens[b], (batch, b)
            tokens[:batch] = want.next_tokens.tolist()
            lens[:batch] = [n + 1 for n in lens[:batch]]


@pytest.mark.cuda
@pytest.mark.parametrize("dtype,tol", [("bfloat16", 2e-2), ("float32", 1e-4)])
def test_graph_decode_matches_eager(tmp_path, dtype, tol):
    write_tiny(tmp_path, "qwen3_moe", seed=4, layers=3, heads=8, kv_heads=2, head_dim=32, experts=8, top_k=2,
               router_std=1.0 if dtype == "bfloat16" else 0.3)
    graphed, eager = gpu_runner(str(tmp_path), dtype, True), gpu_runner(str(tmp_path), dtype, False)
    assert graphed.graphs.buckets == BUCKETS and eager.graphs is None
    decode_in_lockstep(graphed, eager, (1, 3, 8, 13, 20, 40), tol)
    assert set(graphed.graphs.captured) == set(BUCKETS)


@pytest.mark.cuda
def test_graph_decode_with_offloaded_experts(tmp_path):
    """Cache of half the experts: replays look up, admit and gather on the device (the stats move)
    and give the resident eager runner's logits. With the prefill pipeline on (4 layers x 8
    experts, 80% cached >= 3E slots), the buckets stop below the pipeline's 16-token batches."""
    write_tiny(tmp_path, "mixtral", seed=6, layers=4, experts=8, top_k=2)
    for fraction, pipelined in ((0.5, False), (0.8, True)):
        eager = gpu_runner(str(tmp_path), "float32", False)
        graphed = gpu_runner(str(tmp_path), "float32", True, cache_fraction=fraction)
        assert isinstance(graphed.experts, OffloadedExperts)
        assert (graphed.experts.pipeline is not None) == pipelined
        assert graphed.graphs.buckets == ((1, 2, 4, 8, 15) if pipelined else BUCKETS)
        before = graphed.experts.cache.stats()["total"]["lookups"]
        decode_in_lockstep(graphed, eager, (1, 6, 15) if pipelined else (1, 6, 20), 1e-4, steps=2)
        assert graphed.experts.cache.stats()["total"]["lookups"] > before
        assert graphed.graphs.supports([SequenceChunk([1], 0, [1])] * 16) != pipelined


@pytest.mark.cuda
@pytest.mark.parametrize("fraction", [1.0, 0.5], ids=["resident", "offloaded"])
def test_graph_decode_same_with_and_without_pdl(tmp_path, monkeypatch, fraction):
    """Programmatic dependent launch (``triton_support.pdl_args``) moves when a kernel starts, not
    what it computes: graphs captured with it and without give float32 logits within 1e-7 (the
    one-row projection's whole-tile load, PDL's other change, runs only in 16-bit dtypes), resident
    and with the lookup, admission and gather between the kernels of a layer."""
    write_tiny(tmp_path, "qwen3_moe", seed=4, layers=3, heads=8, kv_heads=2, head_dim=32, experts=8, top_k=2,
               router_std=0.3)
    monkeypatch.setenv("SLUICE_PDL", "0")
    without = gpu_runner(str(tmp_path), "float32", True, cache_fraction=fraction)
    without.graphs.capture_all()
    monkeypatch.setenv("SLUICE_PDL", "1")
    with_pdl = gpu_runner(str(tmp_path), "float32", True, cache_fraction=fraction)
    decode_in_lockstep(with_pdl, without, (1, 6, 20), 1e-7)


@pytest.mark.cuda
def test_graph_decode_same_with_fill_in_gemm_and_gather(tmp_path):
    """A miss copied into its slot by the expert GEMM itself (``fill="gemm"``) or by a gather launch
    first: the same slots, the same kernels' arithmetic, so the same float32 logits (within 1e-9), at batch 1
    (the per-pair gate_up) and 6 and 20 (the per-slot gate_up), half the experts offloaded."""
    write_tiny(tmp_path, "qwen3_moe", seed=4, layers=3, heads=8, kv_heads=2, head_dim=32, experts=8, top_k=2,
               router_std=0.3)
    gather = gpu_runner(str(tmp_path), "float32", True, cache_fraction=0.5, fill="gather")
    gather.graphs.capture_all()
    in_gemm = gpu_runner(str(tmp_path), "float32", True, cache_fraction=0.5, fill="gemm")
    decode_in_lockstep(in_gemm, gather, (1, 6, 20), 1e-9)
    stats = in_gemm.experts.stats()
    assert stats["moe_misses"] > 0  # the fill had work


def sampling_of(i: int) -> SamplingParams:
    """Request ``i`` of ``engine_outputs``: every fourth one samples."""
    return SAMPLED if i % 4 == 3 else GREEDY


def engine_outputs(model_dir, graph, device="cuda", overlap=True):
    """Outputs of 12 requests (prefill and decode mixed, some sampled), overlapped unless told. On
    the CPU ``graph`` runs decode steps through the graphs' static buffers without capturing them."""
    runner = ModelRunner(RunnerConfig(model_dir, device=device, dtype="float32", page_size=16, kv_tokens=4096,
                                      cuda_graph=graph, max_prefill_tokens=64, kv_host_size=0))
    if graph and device == "cpu":
        cfg = runner.model_config
        runner.graphs = DecodeGraphs(runner.model, create_backend("triton", runner.kv_pool, cfg.head_dim ** -0.5),
                                     runner.kv_pool, cfg.max_context, runner.config.cuda_graph_max_batch,
                                     use_graphs=False)
    engine = Engine(runner, EngineConfig(overlap=overlap))
    gen = torch.Generator().manual_seed(2)
    reqs = [Request(str(i), torch.randint(0, 127, (int(torch.randint(3, 50, (1,), generator=gen)),),
                                          generator=gen).tolist(),
                    sampling_of(i), int(torch.randint(4, 30, (1,), generator=gen)),
                    frozenset({127})) for i in range(12)]
    out = {r.rid: [] for r in reqs}
    for r in reqs:
        assert engine.submit(r) is None
    while engine.has_work:
        for u in engine.step():
            out[u.rid] += u.token_ids
    engine.check_pages()
    return out, runner


def test_engine_with_overlap_same_outputs_through_the_static_step_on_cpu(tmp_path):
    """The engine reads a step's tokens after launching the next one: the static step's outputs,
    which the next step overwrites, must be copied first (on the CPU too)."""
    write_tiny(tmp_path, "qwen3_moe", seed=8, layers=2, experts=8, top_k=2)
    static, runner = engine_outputs(str(tmp_path), True, "cpu")
    assert set(runner.graphs.captured) >= {1, 4}  # decode steps of several buckets went through it
    eager, _ = engine_outputs(str(tmp_path), False, "cpu")
    assert static == eager, first_difference(static, eager)


def first_difference(got: dict[str, list[int]], want: dict[str, list[int]]) -> str:
    """Where two runs' outputs part: the request, its sampling, the token index and both tokens."""
    for rid in want:
        a, b = got[rid], want[rid]
        i = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        if a != b:
            kind = "sampled" if int(rid) % 4 == 3 else "greedy"
            return f"request {rid} ({kind}) parts at token {i}: {a[i:i + 3]} vs {b[i:i + 3]} ({len(a)} vs {len(b)})"
    return "same"


@pytest.mark.cuda
def test_engine_with_overlap_same_outputs_as_without_through_graphs_and_eagerly(tmp_path):
    """Overlap reads a step's tokens after launching the next one; through the graphs and eagerly
    its outputs equal those of runs that wait for every step. Across the two paths only the greedy
    requests must agree: on the GPU the graphs' decode kernels differ from the eager path's in the
    last fp32 bits (logits within 1e-4, ``test_graph_decode_matches_eager``), and a sampled draw of
    this near-uniform tiny model moves when a token sits on the top-k/top-p boundary (measured on an
    H200: request 3 at token 4, with and without overlap alike)."""
    write_tiny(tmp_path, "qwen3_moe", seed=8, layers=2, experts=8, top_k=2)
    graphs, runner = engine_outputs(str(tmp_path), True)
    assert runner.graphs.captured  # decode steps went through graphs
    waited, _ = engine_outputs(str(tmp_path), True, overlap=False)
    assert graphs == waited, first_difference(graphs, waited)
    eager, _ = engine_outputs(str(tmp_path), False)
    eager_waited, _ = engine_outputs(str(tmp_path), False, overlap=False)
    assert eager == eager_waited, first_difference(eager, eager_waited)
    greedy = [rid for rid in eager if sampling_of(int(rid)) is GREEDY]
    assert [graphs[r] for r in greedy] == [eager[r] for r in greedy]
