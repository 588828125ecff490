"""Expert parallelism on CPU: gloo ranks in spawned processes, tiny models. Greedy generation with
``--gpus 2`` equals one rank token for token (resident experts, offloaded behind the cache, and
through the prefill pipeline); a rank that dies ends the run with one clear error and no process
left behind."""
from __future__ import annotations

import multiprocessing
import os
import re
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from tests.tiny_models import write_tiny
from worker.distributed import step_message
from worker.distributed.expert_parallel import ExpertParallel, owned_banks
from worker.distributed.parallel_runner import ParallelRunner, start_runner
from worker.distributed.placement import Placement, make_placement, round_robin
from worker.routing_options import RoutingOptions
from worker.distributed.processes import RANK_DIED_EXIT
from worker.batch import SequenceChunk
from worker.expert_placement import ExpertOptions
from scheduler.generate import generate
from worker.runner import RunnerConfig
from scheduler.messages.to_scheduler import SamplingParams

REPO = Path(__file__).resolve().parents[1]
GENERATE = str(REPO / "scripts" / "generate.py")
PROMPTS = ([5, 9, 11, 3], list(range(1, 40)), [77] * 13)
WAIT_S = 300  # an upper bound on waits, never a measured duration


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-ep")
    write_tiny(path, "mixtral", seed=9, layers=4, experts=8, top_k=2)
    return str(path)


def config(model_dir: str, gpus: int = 1, placement: str = "round-robin", **experts) -> RunnerConfig:
    return RunnerConfig(model_dir, device="cpu", dtype="float32", page_size=4, kv_tokens=512,
                        experts=ExpertOptions(**experts), gpus=gpus, expert_placement=placement)


def greedy_runs(model_dir: str, placement: str = "round-robin",
                **experts) -> tuple[list[list[int]], list[list[int]], ParallelRunner]:
    """Every prompt's greedy tokens from one rank and from two; the 2-rank runner is closed."""
    one = start_runner(config(model_dir, **experts))
    two = start_runner(config(model_dir, 2, placement, **experts))
    try:
        want = [generate(one, p, SamplingParams(), 16).token_ids for p in PROMPTS]
        got = [generate(two, p, SamplingParams(), 16).token_ids for p in PROMPTS]
    finally:
        two.close()
    assert not multiprocessing.active_children()
    return want, got, two


def test_two_ranks_equal_one_resident(model_dir):
    want, got, two = greedy_runs(model_dir)
    assert isinstance(two.experts, ExpertParallel)
    assert two.experts.banks.w13.shape[1] == 4  # rank 0 holds experts 0, 2, 4, 6 of each layer
    assert got == want


@pytest.mark.parametrize("prefetch", [False, True], ids=["", "prefetch"])
def test_two_ranks_equal_one_offloaded(model_dir, prefetch):
    want, got, two = greedy_runs(model_dir, cache_fraction=0.25, prefetch=prefetch)
    assert got == want
    stats = two.experts.cache.stats()["total"]
    assert stats["misses"] > 0 and stats["hits"] > 0
    assert two.experts.pipeline is None
    assert_holds_only_own_experts(two)


def assert_holds_only_own_experts(runner: ParallelRunner) -> None:
    """Rank 0's cache never admitted an odd expert (rank 1's)."""
    held = runner.experts.cache.tables.id_of_slot
    held = held[held >= 0]
    assert held.numel() > 0 and bool((held % runner.model_config.num_experts % 2 == 0).all())


def test_two_ranks_equal_one_through_the_prefill_pipeline(model_dir):
    want, got, two = greedy_runs(model_dir, cache_size=28)  # >= 3E slots: 39 tokens x top 2 stream
    assert got == want
    stats = two.experts.pipeline.stats()
    assert stats["chunks_kernel"] + stats["chunks_memcpy"] + stats["chunks_mirror"] > 0


@pytest.fixture(scope="module")
def popularity(model_dir, tmp_path_factory) -> str:
    """``popularity:FILE`` of a routing record of the prompts, whose balanced placement is no
    round-robin one."""
    path = str(tmp_path_factory.mktemp("record") / "routing.pt")
    one = start_runner(replace(config(model_dir), routing=RoutingOptions(record=path)))
    for p in PROMPTS:
        generate(one, p, SamplingParams(), 16)
    one.save_routing_record()
    cfg = one.model_config
    assert make_placement(f"popularity:{path}", cfg.num_layers, cfg.num_experts, 2).strided(0) is None
    return f"popularity:{path}"


@pytest.mark.parametrize("experts", [{}, {"cache_fraction": 0.25, "prefetch": True}], ids=["resident", "offloaded"])
def test_two_ranks_with_popularity_placement_equal_one(model_dir, popularity, experts):
    want, got, two = greedy_runs(model_dir, popularity, **experts)
    assert got == want
    owned = make_placement(popularity, 4, 8, 2).owned(0)
    if "cache_fraction" in experts:  # rank 0's cache admitted only its own experts
        held = two.experts.cache.tables.id_of_slot
        held = held[held >= 0].long()
        assert held.numel() > 0 and all(int(e % 8) in owned[int(e // 8)].tolist() for e in held)
    else:
        assert torch.equal(two.experts.banks.w13[0, 0], two.weights.experts.w13[0, owned[0, 0]])


def test_popularity_placement_with_the_prefill_pipeline_is_refused(model_dir, popularity):
    with pytest.raises(ValueError, match="popularity:FILE needs --no-prefill-pipeline"):
        start_runner(config(model_dir, 2, popularity, cache_size=28))
    assert not multiprocessing.active_children()


def test_own_ids_mask_other_ranks_experts():
    ids = torch.tensor([[0, 3], [5, 2], [7, 6]])
    resident = ExpertParallel(None, 1, round_robin(1, 8, 2), lambda t: t, local_ids=True)
    assert resident.own_ids(0, ids).tolist() == [[-1, 1], [2, -1], [3, -1]]
    offloaded = ExpertParallel(None, 1, round_robin(1, 8, 2), lambda t: t, local_ids=False)
    assert offloaded.own_ids(0, ids).tolist() == [[-1, 3], [5, -1], [7, -1]]


def test_own_ids_follow_each_layers_placement():
    placement = Placement(torch.tensor([[0, 0, 0, 1, 1, 1, 1, 0], [1, 1, 1, 1, 0, 0, 0, 0]]), 2)
    ids = torch.tensor([[0, 7], [3, -1]])
    resident = ExpertParallel(None, 1, placement, lambda t: t, local_ids=True)
    assert resident.own_ids(0, ids).tolist() == [[-1, -1], [0, -1]]
    assert resident.own_ids(1, ids).tolist() == [[0, -1], [3, -1]]
    offloaded = ExpertParallel(None, 0, placement, lambda t: t, local_ids=False)
    assert offloaded.own_ids(1, ids).tolist() == [[-1, 7], [-1, -1]]


def test_owned_banks_take_every_nth_expert():
    from moe_offload.experts import ExpertBanks

    w13 = torch.arange(2 * 6).float().view(2, 6, 1, 1).expand(2, 6, 2, 1).contiguous()
    banks = owned_banks(ExpertBanks(w13, w13[:, :, :1, :1].contiguous()), round_robin(2, 6, 3).owned(2))
    assert banks.w13[:, :, 0, 0].tolist() == [[2, 5], [8, 11]] and banks.w13.is_contiguous()
    banks = owned_banks(ExpertBanks(w13, w13[:, :, :1, :1].contiguous()), torch.tensor([[0, 4], [1, 5]]))
    assert banks.w13[:, :, 0, 0].tolist() == [[0, 4], [7, 11]]


def test_step_message_round_trip():
    chunks = [SequenceChunk([4, 5, 6], 8, [1, 2, 3]), SequenceChunk([0], 17, [7, 9, 11, 12, 13], buffer_slot=3)]
    sampling = [SamplingParams(seed=0), SamplingParams(temperature=0.7, top_k=20, top_p=0.9, seed=2**40 + 5)]
    head, payload = step_message.encode(step_message.Step(chunks, sampling, [0, 6], 64))
    got = step_message.decode(head.tolist(), payload)
    assert got.chunks == chunks and got.steps == [0, 6] and got.buffer_len == 64
    assert got.sampling[0] == step_message.RankSampling(0.0, 0, 1.0, 0)  # the fields of sampling[0]
    assert got.sampling[1] == step_message.RankSampling(0.7, 20, 0.9, 5)  # sampling reads the seed's low 32 bits


def test_a_hybrid_model_on_two_ranks_is_refused(tmp_path):
    from tests.tiny_hybrid import write_tiny_hybrid

    write_tiny_hybrid(tmp_path, "qwen3_5_moe", seed=1, layer_types=("linear_attention", "full_attention"))
    with pytest.raises(ValueError, match="does not run hybrid models"):
        start_runner(config(str(tmp_path), 2))
    assert not multiprocessing.active_children()


def test_more_gpus_than_visible_is_refused(model_dir):
    if torch.cuda.device_count() >= 64:
        pytest.skip("64 GPUs visible")
    with pytest.raises(ValueError, match="--gpus 64 needs 64 CUDA devices"):
        start_runner(RunnerConfig(model_dir, device="cuda", gpus=64))
    with pytest.raises(ValueError, match="--gpus must be >= 1"):
        start_runner(config(model_dir, 0))


def _gone(pid: int) -> bool:
    """No such process, or a zombie (dead; its new parent has not reaped it yet)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return True
    return state in ("Z", "X")


@pytest.mark.slow
def test_a_killed_rank_ends_the_run_with_one_error_and_no_process_left(tmp_path):
    env = dict(os.environ, SLUICE_KILL_RANK="2:3", PYTHONPATH=str(REPO))
    out = subprocess.run([sys.executable, GENERATE, "--model", "tiny-geometry", "--dummy-weights",
                          "--device", "cpu", "--gpus", "3", "--kv-tokens", "256", "--prompt", "hello there",
                          "--max-tokens", "8"], cwd=REPO, env=env, capture_output=True, text=True, timeout=WAIT_S)
    assert out.returncode == RANK_DIED_EXIT, out.stderr[-3000:]
    errors = [line for line in out.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, out.stderr[-3000:]
    found = re.fullmatch(r"error: rank 2 \(pid (\d+)\) was killed by SIGKILL; .* rank 0 \(pid (\d+)\) exits and "
                         r"ends the other ranks: rank 1 \(pid (\d+)\)", errors[0])
    assert found, errors[0]
    assert all(_gone(int(pid)) for pid in found.groups())


def test_two_ranks_equal_one_staging_from_the_mirror(model_dir):
    """A rank's share is strided in the host banks, so its mirror copies one expert at a time."""
    want, got, two = greedy_runs(model_dir, cache_size=28, prefill_stage="mirror")
    assert got == want
    stats = two.experts.pipeline.stats()
    assert stats["chunks_mirror"] > 0 and stats["from_host"] + stats["in_place"] - stats["mirror_wasted"] == (
        4 * 4 * stats["chunks_mirror"])


def test_each_rank_stages_only_its_share_of_each_layer(model_dir):
    _, _, two = greedy_runs(model_dir, cache_size=28, lent_slots="reserve")  # decode starts past the lent slots
    pipeline = two.experts.pipeline
    assert pipeline.lent == 8 and two.experts.decode_start == 8  # 2 x 4 experts, not 2 x 8
    staged = pipeline.stats()
    chunks = staged["chunks_kernel"] + staged["chunks_memcpy"] + staged["chunks_mirror"]
    assert chunks and staged["from_cache"] + staged["from_host"] + staged["in_place"] == 4 * 4 * chunks


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="interpreted kernels run on the CPU only")
@pytest.mark.parametrize("first,stride", [(1, 2), (0, 3), (2, 4)])
def test_stage_kernel_stages_a_share_as_its_twin(first, stride):
    from tests.test_prefill_pipeline import stage_case
    from moe_offload.kernels import stage_experts as stage_mod

    gen = torch.Generator().manual_seed(first * 10 + stride)
    count = len(range(first, 6, stride))
    for trial in range(4):
        host, pools, slot_for_id, stats = stage_case(gen)
        layer, outs = trial % 3, []
        for backend in ("triton", "eager"):
            p, s = [t.clone() for t in pools], stats.clone()
            bufs = [t[count:2 * count] for t in p]
            stage_mod.stage_experts(layer, 6, 2 * count, slot_for_id, *p, *host, *bufs, s, backend=backend,
                                    programs=3, first=first, stride=stride)
            outs.append((p, s))
        (p_k, s_k), (p_e, s_e) = outs
        assert all(torch.equal(a, b) for a, b in zip(p_k, p_e)) and torch.equal(s_k, s_e)
        gids = layer * 6 + torch.arange(first, 6, stride)
        hit = slot_for_id[gids] >= 2 * count
        want = torch.where(hit[:, None, None], pools[0][slot_for_id[gids].long().clamp(min=0)], host[0][gids])
        assert torch.equal(p_e[0][count:2 * count], want)
        assert torch.equal(p_e[0][2 * count:], pools[0][2 * count:])  # nothing outside the buffer moved
        assert s_e[layer].tolist() == [int(hit.sum()), count - int(hit.sum())]


def test_a_share_outside_the_layer_is_refused():
    from tests.test_prefill_pipeline import stage_case
    from moe_offload.kernels import stage_experts as stage_mod

    host, pools, slot_for_id, stats = stage_case(torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match="share"):
        stage_mod.stage_experts(0, 6, 12, slot_for_id, *pools, *host, *[t[:3] for t in pools], stats, first=6,
                                stride=2)
    with pytest.raises(ValueError, match="one expert shape"):  # a buffer of 6 for a share of 3
        stage_mod.stage_experts(0, 6, 12, slot_for_id, *pools, *host, *[t[:6] for t in pools], stats, first=1,
                                stride=2)


@pytest.mark.parametrize("backend", ["eager", "triton"])
def test_ranks_float32_partials_sum_to_one_ranks_bf16_output(backend):
    """Top-2 in bf16: each rank's partial (others' experts -1) in float32, summed and rounded once,
    is bit for bit what one rank computes."""
    if backend == "triton" and not torch.cuda.is_available():
        pytest.skip("the Triton interpreter does not compute in bf16 (numpy has none): the kernel runs on a GPU")
    from moe_offload.grouped import grouped_swiglu

    device = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator().manual_seed(3)
    hidden = torch.randn(6, 32, generator=gen).bfloat16().to(device)
    w13 = (torch.randn(8, 32, 32, generator=gen) * 0.2).bfloat16().to(device)
    w2 = (torch.randn(8, 32, 16, generator=gen) * 0.2).bfloat16().to(device)
    ids = torch.rand(6, 8, generator=gen).topk(2, dim=-1).indices.to(device)
    weights = torch.rand(6, 2, generator=gen).to(device)
    want = grouped_swiglu(hidden, weights, ids, w13, w2, backend=backend)
    ranks = [ExpertParallel(None, r, round_robin(1, 8, 2), lambda t: t, local_ids=False, device=device)
             for r in range(2)]
    parts = [grouped_swiglu(hidden, weights, r.own_ids(0, ids), w13, w2, backend=backend, out_dtype=torch.float32)
             for r in ranks]
    assert parts[0].dtype == torch.float32 and not torch.equal(parts[0], parts[1])
    assert torch.equal((parts[0] + parts[1]).bfloat16(), want)


# ==== two GPUs (NCCL) ====

two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")


def _chat_ids(model: str) -> list[list[int]]:
    from frontend.tokenizer import ChatTokenizer

    tok = ChatTokenizer.from_dir(model)
    prompts = ["What is the capital of France?", "Write a haiku about rivers.", "List three prime numbers."]
    return [tok.encode_chat([{"role": "user", "content": p}]) for p in prompts]


@pytest.mark.cuda
@two_gpus
@pytest.mark.parametrize("experts", [{}, {"cache_fraction": 0.25}], ids=["resident", "offloaded"])
def test_default_model_on_two_gpus_equals_one(experts):
    from worker.default_model import default_model_dir

    model = str(default_model_dir())
    cfg = RunnerConfig(model, device="cuda", dtype="bfloat16", kv_tokens=2048, experts=ExpertOptions(**experts))
    one = start_runner(cfg)
    want = [generate(one, ids, SamplingParams(), 32).token_ids for ids in _chat_ids(model)]
    del one
    two = start_runner(replace(cfg, gpus=2))
    try:
        got = [generate(two, ids, SamplingParams(), 32).token_ids for ids in _chat_ids(model)]
    finally:
        two.close()
    assert got == want


@pytest.mark.cuda
@two_gpus
def test_two_gpu_steps_have_no_hidden_sync(model_dir):
    """Rank 0's prefill chunk (through the pipeline, its share only) and decode steps (graphs
    captured on both ranks, the token buffer broadcast) never read the device on the host."""
    cfg = RunnerConfig(model_dir, device="cuda", dtype="bfloat16", page_size=4, kv_tokens=512,
                       experts=ExpertOptions(cache_size=28))
    runner = start_runner(replace(cfg, gpus=2))
    try:
        pages = runner.kv_pool.allocate(runner.kv_pool.pages_for(64))
        greedy = SamplingParams()
        runner.forward([SequenceChunk(list(range(1, 33)), 0, pages)], [greedy], [0])  # compile, untimed
        runner.graphs.capture_all()
        buffer = torch.zeros(8, dtype=torch.int64, device=runner.device)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            out = runner.forward([SequenceChunk(list(range(33, 49)), 32, pages)], [greedy], [0], buffer)
            buffer[:1].copy_(out.next_tokens)
            for step in range(4):
                chunk = SequenceChunk([0], 48 + step, pages, buffer_slot=0)
                out = runner.forward([chunk], [greedy], [step + 1], buffer)
                buffer[:1].copy_(out.next_tokens)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        assert runner.experts.pipeline.stats()["from_cache"] + runner.experts.pipeline.stats()["from_host"] > 0
    finally:
        runner.close()


def test_stats_carry_every_ranks_counters(model_dir):
    two = start_runner(config(model_dir, 2, cache_fraction=0.25))
    try:
        for p in PROMPTS:
            generate(two, p, SamplingParams(), 8)
        stats = two.stats()
        two.reset_stats()
        after_reset = two.stats()
    finally:
        two.close()
    assert "ranks" not in two.stats()  # closed: rank 0's counters only, no rank asked
    assert stats["ranks"] == 2 and stats["moe_lookups"] == stats["rank0.moe_lookups"]
    for rank in (0, 1):
        assert stats[f"rank{rank}.moe_lookups"] > 0 and stats[f"rank{rank}.moe_bytes_h2d"] > 0
        assert 0 < stats[f"rank{rank}.moe_hit_rate"] <= 1 and isinstance(stats[f"rank{rank}.moe_hits"], int)
        assert stats[f"rank{rank}.all_reduces"] > 0 and stats[f"rank{rank}.all_reduce_s"] > 0
        assert after_reset[f"rank{rank}.moe_lookups"] == 0 and after_reset[f"rank{rank}.all_reduces"] == 0
