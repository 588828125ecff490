"""The memory plan (worker/memory_plan.py): one split of the GPU memory free after the weights and
of the host RAM, made once. On CPU, from given numbers (qwen3-30b-geometry on a simulated H200)
and from a tiny runner that allocates what its plan says."""
from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from moe_offload.expert_store import remove_segment
from moe_offload.store_layout import StoreIdentity
from tests.test_device_memory import CUDA, card  # noqa: F401 (fixture)
from worker.config import ModelConfig
from worker.device_memory import GIB, DeviceMemory
from worker.expert_placement import expert_geometry
from worker.memory_plan import (AUTO_PREFILL_RESERVE, CPU_KV_TOKENS, CPU_PREFILL_TOKENS, PlanInputs,
                                activation_bytes, expert_slots, plan_memory)
from worker.runner import ModelRunner
from worker.runner_config import ExpertOptions, RunnerConfig

from tests.fresh_process import run_fresh

MODEL = "qwen3-30b-geometry"
CFG = ModelConfig.from_dir(MODEL)
TOTAL = CFG.num_layers * CFG.num_experts
SLOT = 3 * CFG.hidden_size * CFG.expert_intermediate_size * 2  # one bf16 expert
KV_TOKEN = 2 * CFG.num_layers * CFG.kv_size * 2  # bf16 K and V of a token, every layer
PAGE = RunnerConfig.page_size
ROWS = RunnerConfig.state_slots  # the sequences running at once: a chunk's logits rows at most
QUARTER = ExpertOptions(cache_fraction=0.25, dummy_weights=True)


def gpu(free_gib: float = 40, reusable: int = 0, host_gib: float = 400) -> PlanInputs:
    return PlanInputs(int(free_gib * GIB), reusable, int(host_gib * GIB), SLOT, KV_TOKEN, torch_attention=False)


def plan(inputs: PlanInputs | None = None, **config):
    return plan_memory(inputs or gpu(), CFG, RunnerConfig(MODEL, **{"experts": QUARTER, **config}))


@pytest.mark.parametrize("limit", [24, 32, 48])
def test_cache_auto_kv_pool_and_prefill_chunk_fit_under_the_limit(card, limit):  # noqa: F811
    """Allocated in the runner's order, expert cache then KV pool, the prefill chunk's activations
    peak under the limit; and it is the limit that bounds them all."""
    memory = DeviceMemory.of(CUDA, limit)
    options = ExpertOptions(cache_auto=True, dummy_weights=True)
    p = plan(PlanInputs(memory.free(), memory.reusable(), 0, SLOT, KV_TOKEN, False), experts=options)
    card.reserve(p.expert_bytes)
    card.reserve(p.kv_bytes)
    # the chunk's activations reuse the blocks torch holds unused first, then reserve more
    peak = card.reserved + max(p.activation_bytes - memory.reusable(), 0)
    assert peak <= limit * GIB
    reserve = activation_bytes(CFG, AUTO_PREFILL_RESERVE, CFG.max_context, False, ROWS)
    assert p.expert_bytes == p.expert_slots * SLOT > (limit - 3 - 6) * GIB - reserve  # the cache takes most
    assert p.kv_pages * PAGE >= options.kv_reserve_tokens  # the KV pool its floor
    assert p.prefill_tokens >= AUTO_PREFILL_RESERVE  # the KV pool left the chunk the activations the cache left it


def test_without_a_limit_the_whole_card_is_used(card):  # noqa: F811
    memory = DeviceMemory.of(CUDA, None)
    p = plan(PlanInputs(memory.free(), memory.reusable(), 0, SLOT, KV_TOKEN, False),
             experts=ExpertOptions(cache_auto=True, dummy_weights=True))
    assert p.expert_slots == TOTAL  # 137 GiB free hold every expert (about 54 GiB) ...
    assert p.kv_bytes > 40 * GIB  # ... and a KV pool of most of the rest


@pytest.mark.parametrize("config", [{}, {"kv_tokens": 4096}, {"max_prefill_tokens": 4096}, {"kv_host_size": 3},
                                    {"experts": ExpertOptions(cache_auto=True, dummy_weights=True)},
                                    {"experts": ExpertOptions(cache_size=1000, dummy_weights=True)}])
@pytest.mark.parametrize("free_gib", [24, 40, 120])
def test_the_parts_add_up_to_what_was_free(config, free_gib):
    p = plan(gpu(free_gib, reusable=GIB // 2), **config)
    assert p.expert_bytes == p.expert_slots * SLOT and p.kv_bytes == p.kv_pages * PAGE * KV_TOKEN
    assert p.activation_bytes == activation_bytes(CFG, p.prefill_tokens, min(CFG.max_context, (p.kv_pages - 1) * PAGE),
                                                  False, ROWS)
    if "max_prefill_tokens" not in config:  # a chunk given by hand may not fit: the user's call
        assert p.expert_bytes + p.kv_bytes + p.activation_bytes <= free_gib * GIB + GIB // 2
    assert p.host_kv_bytes == (3 * GIB if "kv_host_size" in config else 100 * GIB)  # default: 25% of 400 GiB


def test_each_option_changes_what_it_should():
    base = plan()
    assert base.expert_slots == TOTAL // 4 and base.host_kv_bytes == 100 * GIB
    kv = plan(kv_tokens=4096)
    assert kv.kv_pages == 1 + 4096 // PAGE and kv.expert_slots == base.expert_slots
    assert kv.prefill_tokens > base.prefill_tokens  # a smaller pool leaves the chunk more
    chunk = plan(max_prefill_tokens=4096)
    assert chunk.prefill_tokens == 4096 and chunk.expert_slots == base.expert_slots
    tight, tight_chunk = plan(gpu(free_gib=24)), plan(gpu(free_gib=24), max_prefill_tokens=4096)
    assert tight_chunk.kv_pages > tight.kv_pages  # a pool bound by the activations keeps back 4096 tokens', not 8192's
    bigger = plan(experts=replace(QUARTER, cache_fraction=0.5))
    assert bigger.expert_slots == TOTAL // 2 and bigger.kv_pages < base.kv_pages
    host = plan(kv_host_size=2.5)
    assert host.host_kv_bytes == int(2.5 * GIB) and replace(host, host_kv_bytes=base.host_kv_bytes) == base
    assert plan(gpus=2).host_kv_bytes == 0  # the tier would move rank 0's pages only
    limited = plan(gpu(free_gib=24))
    assert limited.kv_pages < base.kv_pages and limited.expert_slots == base.expert_slots
    auto = ExpertOptions(cache_auto=True, dummy_weights=True)
    floor = plan(experts=auto), plan(experts=replace(auto, kv_reserve_tokens=4 * 32768))
    assert floor[1].expert_slots < floor[0].expert_slots  # a bigger KV floor leaves the cache less
    assert abs((floor[0].expert_slots - floor[1].expert_slots) * SLOT - 3 * 32768 * KV_TOKEN) < SLOT


def test_cpu_plan_and_its_refusals():
    cpu = PlanInputs(None, 0, 400 * GIB, SLOT, KV_TOKEN, torch_attention=True)
    p = plan(cpu)
    assert (p.kv_pages, p.prefill_tokens, p.host_kv_bytes) == (1 + CPU_KV_TOKENS // PAGE, CPU_PREFILL_TOKENS, 0)
    assert p.activation_bytes > activation_bytes(CFG, CPU_PREFILL_TOKENS, CPU_KV_TOKENS, False, ROWS)  # the torch mask
    with pytest.raises(ValueError, match="--moe-cache-auto sizes the cache from free GPU memory"):
        plan(cpu, experts=ExpertOptions(cache_auto=True, dummy_weights=True))
    with pytest.raises(ValueError, match="needs at least one layer's 128"):
        plan(experts=ExpertOptions(cache_size=100, dummy_weights=True))
    with pytest.raises(ValueError, match="at least one layer's"):  # 1 GiB free: auto fits no expert
        plan(gpu(free_gib=1), experts=ExpertOptions(cache_auto=True, dummy_weights=True))
    with pytest.raises(ValueError, match="do not fit in the GPU memory free"):  # 28 GB of experts in 24 GiB
        plan(gpu(free_gib=24), experts=ExpertOptions(cache_size=3000, dummy_weights=True))
    with pytest.raises(ValueError, match="do not fit in the GPU memory free"):
        plan(gpu(free_gib=24), kv_tokens=200_000)
    with pytest.raises(ValueError, match="--kv-tokens must be 0 or more"):
        RunnerConfig(MODEL, kv_tokens=-1)


def test_expert_slots_from_exactly_one_size():
    """What resolve_cache_slots checked: one place for each rule."""
    assert expert_slots(ExpertOptions(cache_size=30), 100, 10, None) == 30
    assert expert_slots(ExpertOptions(cache_size=300), 100, 10, None) == 100  # never more than there are
    assert expert_slots(ExpertOptions(cache_fraction=0.25), 100, 10, None) == 25
    assert expert_slots(ExpertOptions(cache_auto=True), 100, 10, 555) == 55
    assert expert_slots(ExpertOptions(cache_auto=True), 100, 10, 9) == 0  # the plan refuses it (above)
    assert expert_slots(ExpertOptions(), 100, 10, None) == 100  # none given: resident, or dummy weights alone
    with pytest.raises(ValueError, match="--moe-cache-size and --moe-cache-fraction are mutually exclusive"):
        ExpertOptions(cache_size=3, cache_fraction=0.5)
    with pytest.raises(ValueError, match="--moe-cache-fraction and --moe-cache-auto are mutually exclusive"):
        ExpertOptions(cache_fraction=0.5, cache_auto=True)
    with pytest.raises(ValueError, match="fraction must be in"):
        ExpertOptions(cache_fraction=1.5)


def test_the_table_shows_each_part():
    p = plan()
    table = p.table(TOTAL)
    for part in (f"{p.expert_slots} of {TOTAL} experts", f"{p.kv_pages} pages of {PAGE} tokens",
                 f"{p.prefill_tokens} tokens", f"{p.host_kv_bytes / GIB:.2f} GiB", "40.00 GiB GPU free"):
        assert part in table


def test_a_runner_allocates_what_its_plan_says():
    r = ModelRunner(RunnerConfig("tiny-geometry", device="cpu", dtype="float32", page_size=4, kv_tokens=256,
                                 experts=ExpertOptions(cache_fraction=0.5, dummy_weights=True)))
    try:
        cfg = r.model_config
        assert r.plan.expert_slots == cfg.num_layers * cfg.num_experts // 2 == r.experts.cache.num_slots
        assert r.plan.expert_bytes == r.plan.expert_slots * r.experts.cache.slot_bytes  # the plan's unit is a slot's
        assert r.plan.kv_pages == r.kv_pool.num_pages == 1 + 256 // 4
        assert r.plan.kv_bytes == r.kv_pool.num_pages * r.kv_pool.page_bytes
    finally:
        remove_segment(r.experts.store.name)


def test_attention_choices_are_the_registered_backends():
    from worker.attention import BACKENDS
    from worker.runner_config import ATTENTION_BACKENDS

    assert sorted(ATTENTION_BACKENDS) == sorted(BACKENDS)


@pytest.mark.cuda
def test_a_cuda_runner_reserves_what_its_plan_says():
    """The plan is arithmetic on the memory free after the weights: on a real card the cache and the
    KV pool must take what it counted (within allocator rounding), under a limit. In a fresh process
    (tests/fresh_process.py): memory an earlier test left reserved would shift both sides."""
    run_fresh("tests.test_memory_plan:runner_reserves_its_plan")


def runner_reserves_its_plan() -> None:
    r = ModelRunner(RunnerConfig("small-geometry", device="cuda", gpu_memory_limit=6, cuda_graph=False,
                                 experts=ExpertOptions(cache_auto=True, dummy_weights=True, kv_reserve_tokens=4096)))
    left = r.plan.gpu_free - r.plan.expert_bytes - r.plan.kv_bytes
    assert r.plan.expert_slots > 0 and r.plan.kv_bytes > 0, r.plan
    free = r.memory.free()
    assert abs(free - left) < 64 * 2**20, f"free {free} bytes, the plan left {left}"  # the cache and the pool took it


def test_activations_count_the_cudnn_paths_parts_where_a_layer_can_take_it():
    """A prefill over 128k keys may merge up to seven parts (six pieces and the causal one): their
    outputs stacked and the one being computed count, for head dims cuDNN fuses and no sinks."""
    tokens, context = 8192, 131072
    part = tokens * CFG.num_heads * CFG.head_dim * 2
    assert activation_bytes(CFG, tokens, context, False, ROWS) - activation_bytes(CFG, tokens, 4095, False, ROWS) == (
        (6 + 2) * part - 2 * part + 2 * (context - 4095) * CFG.num_kv_heads * CFG.head_dim * 2)
    for other in (replace(CFG, head_dim=256), replace(CFG, attention_sinks=True)):
        parts_free = activation_bytes(other, tokens, context, False, ROWS) - activation_bytes(other, tokens, 4095, False, ROWS)
        assert parts_free == 2 * (context - 4095) * other.num_kv_heads * other.head_dim * 2  # the gather only


def test_a_float8_pools_cast_prefix_counts_a_quarter_more_gather():
    """``--kv-cache-dtype fp8``: the cuDNN path casts the prefix as it gathers it, so V's float8 copy
    sits beside K's and V's bf16 ones; the plan's estimate and its reserve count it."""
    tokens, context = 8192, 131072
    gathered = 2 * context * CFG.num_kv_heads * CFG.head_dim * 2
    fp8 = activation_bytes(CFG, tokens, context, False, ROWS, kv_fp8=True)
    assert fp8 - activation_bytes(CFG, tokens, context, False, ROWS) == gathered // 4
    auto, fp8 = (plan(max_prefill_tokens=tokens, kv_tokens=context, kv_cache_dtype=kv) for kv in ("auto", "fp8"))
    assert fp8.activation_bytes - auto.activation_bytes == gathered // 4


def test_a_chunks_logits_are_its_rows_not_its_tokens():
    """The lm_head runs on each sequence's last token only: a chunk of 8k tokens holds at most its
    running sequences' logits (float32, 4 copies for the sampler), not 8k rows of them."""
    logits_row = 4 * 4 * CFG.vocab_size
    one, many = (activation_bytes(CFG, 8192, 4095, False, rows) for rows in (1, 64))
    assert many - one == 63 * logits_row
    assert activation_bytes(CFG, 16, 4095, False, 64) - activation_bytes(CFG, 16, 4095, False, 16) == 0  # rows <= tokens


# a geometry of each family, its experts in a format whose store fills fast
PEAK_MODELS = [("qwen3-30b-geometry", "fp8"), ("qwen3.5-35b-a3b-geometry", "fp8"), ("gpt-oss-20b-geometry", "mxfp4")]


@pytest.mark.cuda
@pytest.mark.parametrize("model", PEAK_MODELS, ids=lambda m: m[0])
def test_two_full_chunks_fit_under_the_limit_beside_the_decode_graphs(model, monkeypatch):
    """What the plan keeps back for a prefill chunk's activations (``activation_bytes``) holds them:
    a runner sized from a 24 GiB limit (expert cache auto, KV pool auto) captures its decode graphs
    and prefills a prompt of two of its chunks, the second over the first, with torch's peak under
    the limit. In a fresh process that reads the card's free memory as the whole card (as
    ``test_device_memory``'s small-limit test does)."""
    monkeypatch.setenv("SLUICE_PEAK_MODEL", ":".join(model))
    run_fresh("tests.test_memory_plan:full_chunks_under_the_limit", timeout=600)


def full_chunks_under_the_limit() -> None:
    import torch

    from scheduler.generate import generate
    from scheduler.messages.to_scheduler import SamplingParams

    model, experts = os.environ["SLUICE_PEAK_MODEL"].split(":")
    limit, total = 24, torch.cuda.mem_get_info()[1]
    torch.cuda.mem_get_info = lambda device=None: (total, total)  # this process only
    runner = ModelRunner(RunnerConfig(model, device="cuda", gpu_memory_limit=limit,
                                      experts=ExpertOptions(cache_auto=True, dummy_weights=True, expert_dtype=experts,
                                                            kv_reserve_tokens=32768)))
    try:
        if runner.graphs is not None:
            runner.graphs.capture_all()
        tokens = runner.plan.prefill_tokens
        torch.cuda.synchronize()
        held = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        generate(runner, [10 + (7 * i) % 1000 for i in range(2 * tokens)], SamplingParams(), 2)
        torch.cuda.synchronize()
        peak, reserved = torch.cuda.max_memory_allocated() - held, torch.cuda.max_memory_reserved()
        print(f"{model} {experts}: two {tokens}-token chunks peaked {peak / GIB:.2f} GiB past the "
              f"{held / GIB:.2f} held; the plan kept back {runner.plan.activation_bytes / GIB:.2f}; "
              f"reserved at most {reserved / GIB:.2f} of {limit}")
        assert reserved <= limit * GIB
    finally:  # by its identity: a fully resident runner keeps no store, but its fill made the segment
        geometry = expert_geometry(runner.model_config)
        remove_segment(StoreIdentity.dummy(geometry, runner.config.experts.seed, runner.expert_format).name)


def test_the_plan_script_prints_the_plan_a_runner_would_make():
    """``scripts/memory_plan.py`` parses the scheduler's own options (``--max-running`` reaching the
    plan as the logits' rows) and prints ``plan_memory``'s table for the free memory given."""
    import torch

    from worker.runner import expert_format, plan_inputs

    args = ["--gpu-free", "29.13", "--model", MODEL, "--dummy-weights", "--moe-cache-auto", "--kv-reserve-tokens",
            "140000", "--expert-dtype", "nvfp4", "--max-running", "8"]
    out = subprocess.run([sys.executable, "scripts/memory_plan.py", *args], capture_output=True, text=True,
                         check=True, cwd=Path(__file__).resolve().parents[1]).stdout
    config = RunnerConfig(MODEL, state_slots=8, experts=ExpertOptions(cache_auto=True, dummy_weights=True,
                                                                      kv_reserve_tokens=140000, expert_dtype="nvfp4"))
    fmt, cuda = expert_format(CFG, config, torch.bfloat16), torch.device("cuda")
    want = plan_memory(plan_inputs(CFG, config, fmt, torch.bfloat16, cuda, int(29.13 * GIB), 0), CFG, config)
    assert f"{want.expert_slots} of {TOTAL} nvfp4 experts" in out and "--max-running 8" in out
    assert f"{want.prefill_tokens} tokens (activations)" in out
