"""The prefill-overlap pipeline: same results as resident experts and as the cache path, the
lent slots left empty and consistent, the event order (with recording fakes on the CPU), the stage
kernel against its eager twin (interpreted), the options; on a GPU a bf16 parity run and a whole
multi-chunk prefill with no hidden sync (and the eager invalidation caught by the same check)."""
from __future__ import annotations

import contextlib
import os
import shutil

import pytest
import torch

if not torch.cuda.is_available():  # interpreted kernels are chosen when first decorated, lazily
    os.environ.setdefault("TRITON_INTERPRET", "1")

from moe_offload.expert_cache import ExpertCache  # noqa: E402
from moe_offload.experts import ExpertBanks, ResidentExperts  # noqa: E402
from moe_offload.kernels import stage_experts as stage_mod  # noqa: E402
from moe_offload.offloaded import OffloadedExperts  # noqa: E402
from moe_offload import prefill_pipeline  # noqa: E402
from moe_offload.mirrored_misses import bridges  # noqa: E402
from moe_offload.prefill_pipeline import AUTO_COPY_ENGINE_FLOPS_PER_BYTE, AUTO_MIRROR_MAX_COPIES, HostStreams  # noqa: E402
from tests.launch_count import sync_errors  # noqa: E402
from tests.test_expert_cache import assert_consistent, make_banks, skewed_routing  # noqa: E402
from tests.tiny_models import write_tiny  # noqa: E402
from worker.batch import SequenceChunk  # noqa: E402
from worker.expert_placement import ExpertOptions  # noqa: E402
from scheduler.generate import generate  # noqa: E402
from worker.runner import ModelRunner, RunnerConfig  # noqa: E402
from scheduler.messages.to_scheduler import SamplingParams  # noqa: E402

LAYERS, EXPERTS, HIDDEN, INTER, TOP_K = 4, 8, 16, 8, 2
PREFILL, DECODE = 24, 2  # tokens: 24 * 2 >= 4E pairs takes the pipeline, 2 * 2 does not


def setup(pipeline: bool = True, invalidate: str = "fixed", slots: int = 3 * EXPERTS, log: list | None = None,
          stage: str = "auto"):
    banks = make_banks(LAYERS, EXPERTS, HIDDEN, INTER)
    offloaded = OffloadedExperts.create(banks, slots, "cpu", "lfru", pipeline=pipeline, invalidate=invalidate,
                                        stage=stage)
    if log is not None:
        offloaded.pipeline.streams = HostStreams(log)
    return banks, offloaded


def batches(seed: int, rounds: int = 4):
    """Prefill chunks with decode steps between them, skewed so that decode warms the cache."""
    gen = torch.Generator().manual_seed(seed)
    bias = 2 * torch.randn(LAYERS, EXPERTS, generator=gen)
    for round_ in range(rounds):
        for tokens in (PREFILL, DECODE, DECODE, DECODE):
            yield [(torch.randn(tokens, HIDDEN, generator=gen),
                    *skewed_routing(gen, tokens, EXPERTS, TOP_K, bias[layer])) for layer in range(LAYERS)]


def lent_slots_are_empty(cache: ExpertCache) -> bool:
    tables, lent = cache.tables, 2 * cache.num_experts
    pointing_in = ((tables.slot_for_id >= 0) & (tables.slot_for_id < lent)).any()
    return bool((tables.id_of_slot[:lent] == -1).all()) and not bool(pointing_in)


# ==== results ====

def test_pipeline_equals_resident_and_leaves_lent_slots_empty():
    banks, offloaded = setup()
    resident = ResidentExperts(banks)
    for step in batches(0):
        for layer, (x, weights, ids) in enumerate(step):
            out, want = offloaded.forward(layer, x, weights, ids), resident.forward(layer, x, weights, ids)
            if offloaded.pipelines(*ids.shape):  # experts indexed by id as in the resident banks: same arithmetic
                assert torch.equal(out, want)
            else:
                torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
        if len(step[0][0]) == PREFILL:
            assert lent_slots_are_empty(offloaded.cache)
        assert_consistent(offloaded.cache)
    stats = offloaded.pipeline.stats()
    assert stats["from_cache"] > 0 and stats["from_host"] > 0  # decode left experts that the chunks reused
    assert stats["from_cache"] + stats["from_host"] == 4 * LAYERS * EXPERTS
    assert stats["bytes_h2d"] == stats["from_host"] * offloaded.cache.slot_bytes


@pytest.mark.parametrize("invalidate", ["fixed", "eager"])
def test_pipeline_equals_cache_path(invalidate):
    _, piped = setup(invalidate=invalidate)
    _, plain = setup(pipeline=False)
    for step in batches(1):
        for layer, args in enumerate(step):
            torch.testing.assert_close(piped.forward(layer, *args), plain.forward(layer, *args), rtol=1e-5, atol=1e-5)
    assert piped.cache.stats()["total"]["lookups"] < plain.cache.stats()["total"]["lookups"]


@pytest.mark.parametrize("stage,flops_per_byte,max_copies", [
    ("kernel", 0.0, 1), ("kernel", 0.99 * AUTO_COPY_ENGINE_FLOPS_PER_BYTE, 1), ("mirror", AUTO_COPY_ENGINE_FLOPS_PER_BYTE, 1),
    ("mirror", 0.0, AUTO_MIRROR_MAX_COPIES)])
def test_auto_stage_follows_the_chunks_compute(stage, flops_per_byte, max_copies, monkeypatch):
    """Where a run of misses takes more copies than ``max_copies`` (these float banks take two: as
    4-bit's take four, below), chunks that compute little stage through the kernel (hits on the
    GPU), heavy ones by the copy engine from the mirror (the misses alone, hits read in place);
    where it takes no more, every chunk takes the mirror. The results are the resident ones."""
    monkeypatch.setattr(prefill_pipeline, "AUTO_MIRROR_MAX_COPIES", max_copies)
    banks, offloaded = setup()
    assert offloaded.pipeline.mirrored.copies_per_run == 2
    resident = ResidentExperts(banks)
    cache = offloaded.cache
    flops = flops_per_byte * cache.num_layers * cache.num_experts * cache.slot_bytes
    for step in batches(3, rounds=3):
        offloaded.begin(offloaded.pipelines(len(step[0][0]), TOP_K), flops)
        for layer, args in enumerate(step):
            torch.testing.assert_close(offloaded.forward(layer, *args), resident.forward(layer, *args),
                                       rtol=1e-5, atol=1e-5)
    stats = offloaded.pipeline.stats()
    chunks = {mode: stats[f"chunks_{mode}"] for mode in ("kernel", "memcpy", "misses", "mirror")}
    assert chunks == {mode: 3 if mode == stage else 0 for mode in chunks}
    assert (stats["from_cache"] > 0) == (stage == "kernel") and (stats["in_place"] > 0) == (stage == "mirror")


@pytest.mark.parametrize("stage", ["kernel", "memcpy", "misses", "mirror"])
def test_every_stage_mode_equals_resident_and_moves_its_bytes(stage):
    """Each stage mode gives the resident results and leaves the lent slots empty and the tables
    consistent; the kernel, "misses" and "mirror" (its mirror exact here: refreshed in program
    order) read only the misses from the host (the same count: all take hits from slots ``>= 2E``),
    "memcpy" every expert."""
    banks, offloaded = setup(stage=stage)
    resident = ResidentExperts(banks)
    chunks = 0
    for step in batches(0):
        for layer, (x, weights, ids) in enumerate(step):
            torch.testing.assert_close(offloaded.forward(layer, x, weights, ids), resident.forward(layer, x, weights, ids),
                                       rtol=1e-5, atol=1e-5)
        if len(step[0][0]) == PREFILL:
            chunks += 1
            assert lent_slots_are_empty(offloaded.cache)
        assert_consistent(offloaded.cache)
    stats = offloaded.pipeline.stats()
    staged = stats["from_cache"] + stats["from_host"] + stats["in_place"]
    assert stats[f"chunks_{stage}"] == chunks and staged == chunks * LAYERS * EXPERTS
    if stage == "memcpy":
        assert stats["from_host"] == staged
    else:
        assert 0 < stats["from_host"] < staged  # decode left experts that the chunks reused
    assert (stats["in_place"] > 0) == (stage in ("misses", "mirror")) and (stats["from_cache"] > 0) == (stage == "kernel")
    if stage == "mirror":
        assert stats["mirror_wasted"] == stats["mirror_repaired"] == 0 and stats["mirror_copies"] > 0
    if stage != "memcpy":  # the same routing and tables: the same misses
        _, kernel = setup(stage="kernel")
        for step in batches(0):
            for layer, args in enumerate(step):
                kernel.forward(layer, *args)
        assert kernel.pipeline.stats()["from_host"] == stats["from_host"]


def test_mirror_follows_decode_and_chunks_and_runs_coalesce_copies():
    """The mirror is -1 before anything ran, so a first chunk copies every expert, one copy per
    bank per layer (a single run); after a decode step's last lookup, and after a chunk, it equals
    the table."""
    _, offloaded = setup(stage="mirror")
    mirrored = offloaded.pipeline.mirrored
    assert bool((mirrored.mirror == -1).all())
    steps = iter(batches(2))
    for layer, args in enumerate(next(steps)):  # a chunk on an empty cache
        offloaded.forward(layer, *args)
    stats = offloaded.pipeline.stats()
    assert stats["mirror_copies"] == LAYERS * 2 and stats["from_host"] == LAYERS * EXPERTS
    decode = next(steps)
    for layer, args in enumerate(decode):
        offloaded.forward(layer, *args)
        if layer < LAYERS - 1:  # the step's lookups are not done: the mirror still shows the chunk's end
            assert not torch.equal(mirrored.mirror, offloaded.cache.tables.slot_for_id)
    assert torch.equal(mirrored.mirror, offloaded.cache.tables.slot_for_id)


def test_a_small_bank_is_copied_across_the_hits_and_the_weights_are_not():
    """fp8's scales are 768 bytes of a 4.7 MB expert: one copy per layer moves them (hits' rows
    too, into buffer slots nobody reads), while the weights' copies stop at every hit."""
    from moe_offload.copy_runs import bridge_gaps
    from moe_offload.mirrored_misses import MirroredMisses

    assert bridge_gaps([(10, 0, 2), (13, 3, 1), (20, 10, 2)], 1) == [(10, 0, 4), (20, 10, 2)]
    assert bridge_gaps([(0, 0, 1), (2, 1, 1)], 5) == [(0, 0, 1), (2, 1, 1)]  # offsets differ: a strided share
    gen = torch.Generator().manual_seed(6)
    layers, experts, lent = 2, 8, 16
    host = [torch.randn(layers * experts, 256, 64, generator=gen), torch.randn(layers * experts, 1, 4, generator=gen)]
    pools = [torch.zeros(24, *h.shape[1:]) for h in host]
    table = torch.full((layers * experts,), -1, dtype=torch.int32)
    table[[1, 4, 6]] = torch.tensor([16, 17, 18], dtype=torch.int32)  # layer 0's hits
    mirrored = MirroredMisses(table, list(zip(host, pools)), layers, experts, torch.arange(experts), lent)
    mirrored.refresh()
    mirrored.plan(torch.zeros(layers, 2, dtype=torch.int64))
    mirrored.stage(0)
    assert mirrored.copies == 4 + 1  # weights: misses {0}, {2, 3}, {5}, {7}; scales: 0..7 at once
    misses = [0, 2, 3, 5, 7]
    assert all(torch.equal(pools[0][j], host[0][j]) and torch.equal(pools[1][j], host[1][j]) for j in misses)
    assert not pools[0][[1, 4, 6]].any()  # the hits' weights stay where they are
    assert mirrored.slots(0, torch.arange(experts)).tolist() == [0, 16, 2, 3, 17, 5, 18, 7]


def test_a_stale_mirror_stages_exactly_and_counts_its_errors():
    """Whatever the host's mirror says (scrambled before every chunk here, as a torn or old copy
    could be), chunks give the resident results and leave the lent slots empty: experts it thought
    resident and are not are repaired by the gather, those it thought missing and are resident
    were copied for nothing; both are counted, and the repairs are moved bytes."""
    banks, offloaded = setup(stage="mirror")
    resident = ResidentExperts(banks)
    mirrored = offloaded.pipeline.mirrored
    gen = torch.Generator().manual_seed(5)
    for step in batches(1):
        if len(step[0][0]) == PREFILL:
            mirrored.mirror.copy_(torch.randint(-1, 3 * EXPERTS, mirrored.mirror.shape, generator=gen))
        for layer, (x, weights, ids) in enumerate(step):
            torch.testing.assert_close(offloaded.forward(layer, x, weights, ids), resident.forward(layer, x, weights, ids),
                                       rtol=1e-5, atol=1e-5)
        if len(step[0][0]) == PREFILL:
            assert lent_slots_are_empty(offloaded.cache)
        assert_consistent(offloaded.cache)
    stats = offloaded.pipeline.stats()
    assert stats["mirror_wasted"] > 0 and stats["mirror_repaired"] > 0
    moved = stats["from_host"] + stats["in_place"] - stats["mirror_wasted"]
    assert moved == stats["chunks_mirror"] * LAYERS * EXPERTS  # each expert of a layer: a hit, or moved once


def test_forward_flops_add_up_by_rows_and_count_prefix_keys():
    from worker.config import ModelConfig

    cfg = ModelConfig.from_dir("qwen3-30b-geometry")
    one = cfg.forward_flops([8192], [0])
    assert cfg.forward_flops([8192, 100], [0, 5000]) == pytest.approx(one + cfg.forward_flops([100], [5000]))
    assert cfg.forward_flops([8192], [1000]) - one == pytest.approx(cfg.num_layers * 4 * cfg.q_size * 8192 * 1000)
    expert_bytes = cfg.num_layers * cfg.num_experts * 3 * cfg.hidden_size * cfg.expert_intermediate_size * 2
    # where the H200 measurements behind "auto" fall (prefill_pipeline.AUTO_COPY_ENGINE_FLOPS_PER_BYTE):
    # the kernel won nvfp4's fresh 2k chunk, the mirror every chunk over 131k, the hybrid's 2k included
    assert cfg.forward_flops([2048], [0]) < AUTO_COPY_ENGINE_FLOPS_PER_BYTE * expert_bytes * 2.67 / 9.44  # nvfp4's
    assert cfg.forward_flops([2048], [131072]) > AUTO_COPY_ENGINE_FLOPS_PER_BYTE * expert_bytes / 2  # fp8's
    hybrid = ModelConfig.from_dir("qwen3.5-35b-a3b-geometry")
    hybrid_fp8 = hybrid.num_layers * hybrid.num_experts * 3 * hybrid.hidden_size * hybrid.expert_intermediate_size
    assert hybrid.forward_flops([2048], [131072]) > AUTO_COPY_ENGINE_FLOPS_PER_BYTE * hybrid_fp8


@pytest.mark.parametrize("fmt,copies", [("bf16", 2), ("fp8", 2), ("nvfp4", 4), ("mxfp4", 4)])
def test_runs_of_misses_take_a_copy_per_weight_and_group_scale_bank(fmt, copies):
    """qwen3-30b's experts (w13 [1536, 2048], w2 [2048, 768]): fp8's 128x128 block scales ride in
    the weights' copies (bridged), 4-bit's group scales do not, so "auto" keeps the stage kernel's
    choice by intensity for 4-bit only."""
    w13, w2 = 1536 * 2048, 2048 * 768
    rows = {"bf16": [2 * w13, 2 * w2], "fp8": [w13, w2, 12 * 16 * 4, 16 * 6 * 4],
            "nvfp4": [w13 // 2, w2 // 2, w13 // 16, w2 // 16, 4, 4], "mxfp4": [w13 // 2, w2 // 2, w13 // 32, w2 // 32]}
    assert sum(1 for b in bridges(rows[fmt], count=128) if not b) == copies
    assert (copies <= AUTO_MIRROR_MAX_COPIES) == (fmt in ("bf16", "fp8"))


def test_cache_below_three_layers_of_experts_is_refused():
    with pytest.raises(ValueError, match="needs a cache of 24 slots"):
        setup(slots=3 * EXPERTS - 1)
    with pytest.raises(ValueError, match="invalidate mode"):
        setup(invalidate="lazy")


def test_layers_must_come_in_order():
    _, offloaded = setup()
    step = next(batches(2))
    offloaded.forward(0, *step[0])
    with pytest.raises(RuntimeError, match="layer 2 called, layer 1 was staged"):
        offloaded.forward(2, *step[2])


# ==== event order ====

def happens_before_checker(log: list[tuple[str, ...]]):
    """Vector clocks over the logged calls: returns the operations (stream, name, stamp) and
    ``hb(a, b)``, whether ``a`` is ordered before ``b`` by stream order and event waits."""
    clocks = {"copy": {"copy": 0, "compute": 0}, "compute": {"copy": 0, "compute": 0}}
    events, ops = {}, []
    for entry in log:
        if entry[0] == "record":
            events[entry[1]] = dict(clocks[entry[2]])
        elif entry[0] == "wait":
            clock, seen = clocks[entry[1]], events.get(entry[2], {})
            for stream in clock:
                clock[stream] = max(clock[stream], seen.get(stream, 0))
        else:
            clocks[entry[0]][entry[0]] += 1
            ops.append((entry[0], entry[1], dict(clocks[entry[0]])))

    def hb(a, b) -> bool:
        return a[2][a[0]] <= b[2][a[0]]

    return ops, hb


def check_order(log: list[tuple[str, ...]]) -> None:
    ops, hb = happens_before_checker(log)
    for i, op in enumerate(ops):
        stream, name, _ = op
        if name in ("decode", "attention"):
            continue
        layer, buf, earlier = int(name.split()[1]), int(name.split()[-1]), ops[:i]
        if stream == "copy":  # after every decode before it, and every compute that read its buffer
            for prev in earlier:
                if prev[0] == "compute" and (prev[1] == "decode" or prev[1].endswith(f"buffer {buf}")):
                    assert hb(prev, op), f"{name} may overwrite buffer {buf} while {prev[1]} reads it"
        else:  # after the copy that staged its layer
            staged = [p for p in earlier if p[1] == f"layer {layer} to buffer {buf}"]
            assert staged and hb(staged[-1], op), f"{name} may run before its layer is staged"


@pytest.mark.parametrize("early_begin", [False, True])  # True: the model calls begin() before layer 0's attention
def test_event_order_with_recording_streams(early_begin):
    log: list[tuple[str, ...]] = []
    _, offloaded = setup(log=log, stage="kernel")
    streams = offloaded.pipeline.streams
    for step in batches(3, rounds=2):
        if len(step[0][0]) == DECODE:
            with streams.on_compute("decode"):  # a decode step reading the cache, lent slots included
                for layer, args in enumerate(step):
                    offloaded.forward(layer, *args)
            continue
        if early_begin:
            offloaded.begin(offloaded.pipelines(len(step[0][0]), TOP_K))
            with streams.on_compute("attention"):  # overlaps staging of layer 0
                pass
        for layer, args in enumerate(step):
            offloaded.forward(layer, *args)
    check_order(log)
    begin = log.index(("record", "begin", "compute"))
    assert log[begin + 1] == ("wait", "copy", "begin")
    assert next(i for i, e in enumerate(log) if e[0] == "copy") > begin
    assert sum(e == ("copy", "layer 2 to buffer 0") for e in log) == 2


def test_order_checker_catches_a_missing_wait():
    log: list[tuple[str, ...]] = []
    _, offloaded = setup(log=log, stage="kernel")
    step = next(batches(4))
    for layer, args in enumerate(step):
        offloaded.forward(layer, *args)
    check_order(log)
    for dropped in (("wait", "copy", "release0"), ("wait", "copy", "begin"), ("wait", "compute", "ready1")):
        broken = [("compute", "decode")] + [e for e in log if e != dropped]
        with pytest.raises(AssertionError):
            check_order(broken)


# ==== the stage kernel ====

def stage_case(gen: torch.Generator, layers=3, experts=6, slots=20, lent=12, shape=(5, 7)):
    host = [torch.randn(layers * experts, *shape, generator=gen),
            torch.randn(layers * experts, shape[1], shape[0], generator=gen)]
    pools = [torch.randn(slots, *h.shape[1:], generator=gen) for h in host]
    slot_for_id = torch.full((layers * experts,), -1, dtype=torch.int32)
    resident = torch.randperm(layers * experts, generator=gen)[:slots]
    slot_for_id[resident] = torch.randperm(slots, generator=gen)[:len(resident)].int()  # lent-range ones miss
    stats = torch.zeros(layers, 2, dtype=torch.int64)
    return host, pools, slot_for_id, stats


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="interpreted kernels run on the CPU only")
@pytest.mark.parametrize("buf_start", [0, 6])
def test_stage_kernel_matches_twin(buf_start):
    gen = torch.Generator().manual_seed(buf_start)
    for trial in range(6):
        host, pools, slot_for_id, stats = stage_case(gen)
        layer, outs = trial % 3, []
        for backend in ("triton", "eager"):
            p, s = [t.clone() for t in pools], stats.clone()
            bufs = [t[buf_start:buf_start + 6] for t in p]
            stage_mod.stage_experts(layer, 6, 12, slot_for_id, *p, *host, *bufs, s, backend=backend, programs=4)
            outs.append((p, s))
        (p_k, s_k), (p_e, s_e) = outs
        assert all(torch.equal(a, b) for a, b in zip(p_k, p_e)) and torch.equal(s_k, s_e)
        gids = layer * 6 + torch.arange(6)
        hit = slot_for_id[gids] >= 12
        want = torch.where(hit[:, None, None], pools[0][slot_for_id[gids].long().clamp(min=0)], host[0][gids])
        assert torch.equal(p_e[0][buf_start:buf_start + 6], want)
        assert s_e[layer].tolist() == [int(hit.sum()), 6 - int(hit.sum())]


def test_stage_bounds_are_checked_on_the_host():
    host, pools, slot_for_id, stats = stage_case(torch.Generator().manual_seed(0))
    bufs = [t[0:6] for t in pools]
    with pytest.raises(ValueError, match="layer 3"):
        stage_mod.stage_experts(3, 6, 12, slot_for_id, *pools, *host, *bufs, stats)
    with pytest.raises(ValueError, match="inside its lent range"):
        stage_mod.stage_experts(0, 6, 12, slot_for_id, *pools, *host, *[t[7:13] for t in pools], stats)
    with pytest.raises(ValueError, match="lent range"):
        stage_mod.stage_experts(0, 6, 21, slot_for_id, *pools, *host, *bufs, stats)
    with pytest.raises(ValueError, match="one expert shape"):
        stage_mod.stage_experts(0, 6, 12, slot_for_id, *pools, *host, bufs[0][:5], bufs[1], stats)
    with pytest.raises(ValueError, match="stats"):
        stage_mod.stage_experts(0, 6, 12, slot_for_id, *pools, *host, *bufs, stats[:2])


# ==== the runner ====

@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-pipeline")
    write_tiny(path, "mixtral", seed=5, layers=4, experts=8, top_k=2)
    return str(path)


def runner(model_dir, **experts) -> ModelRunner:
    return ModelRunner(RunnerConfig(model_dir, device="cpu", dtype="float32", page_size=4, kv_tokens=512,
                                    experts=ExpertOptions(**experts)))


def test_generation_through_the_pipeline_equals_resident(model_dir):
    resident = runner(model_dir)
    piped = runner(model_dir, cache_size=24)
    plain = runner(model_dir, cache_size=24, prefill_pipeline=False)
    assert piped.experts.pipeline is not None and plain.experts.pipeline is None
    for prompt in (list(range(1, 50)), [7, 3] * 20):  # chunks of 20, 20 and a short one through the cache
        want = generate(resident, prompt, SamplingParams(), 12, max_prefill_tokens=20).token_ids
        assert generate(piped, prompt, SamplingParams(), 12, max_prefill_tokens=20).token_ids == want
        assert generate(plain, prompt, SamplingParams(), 12, max_prefill_tokens=20).token_ids == want
    stats = piped.experts.pipeline.stats()
    assert stats["from_host"] > 0 and stats["from_cache"] + stats["in_place"] > 0  # hits: staged or read in place


def test_small_cache_runs_without_the_pipeline(model_dir, caplog):
    r = runner(model_dir, cache_size=16)
    assert r.experts.pipeline is None and "below the 24" in caplog.text
    assert runner(model_dir, cache_size=24, prefill_invalidate="eager").experts.pipeline.invalidate == "eager"


def test_cli_options_reach_the_pipeline():
    import argparse

    from worker.cli_options import add_runner_args, runner_config

    p = argparse.ArgumentParser()
    add_runner_args(p)
    default = runner_config(p.parse_args([]), "m")
    assert default.experts.prefill_pipeline and default.experts.prefill_invalidate == "fixed"
    assert default.experts.prefill_stage == "auto"
    assert default.max_prefill_tokens == 0  # auto
    args = p.parse_args(["--no-prefill-pipeline", "--prefill-invalidate", "eager", "--max-prefill-tokens", "4096",
                         "--prefill-stage", "memcpy"])
    config = runner_config(args, "m")
    assert not config.experts.prefill_pipeline and config.experts.prefill_invalidate == "eager"
    assert config.experts.prefill_stage == "memcpy"
    assert config.max_prefill_tokens == 4096


def test_auto_prefill_tokens_on_cpu(model_dir):
    assert runner(model_dir).plan.prefill_tokens == 2048


# ==== GPU ====

def cuda_rounds_match(piped: OffloadedExperts, resident: ResidentExperts) -> None:
    """Three rounds of chunks (256 tokens) and decode steps (4) through ``piped`` (16 experts of
    hidden 128, top-4), the first compiling, the others under sync-debug mode: every layer's
    output equals ``resident``'s."""
    gen = torch.Generator().manual_seed(0)
    bias = torch.randn(LAYERS, 16, generator=gen)
    for checked in (False, True, True):
        for tokens in (256, 4, 4, 256):
            inputs = [(torch.randn(tokens, 128, generator=gen).bfloat16().cuda(),
                       *skewed_routing(gen, tokens, 16, 4, bias[layer], "cuda")) for layer in range(LAYERS)]
            torch.cuda.set_sync_debug_mode("error" if checked else "default")
            try:
                outs = [piped.forward(layer, *inputs[layer]) for layer in range(LAYERS)]
            finally:
                torch.cuda.set_sync_debug_mode("default")
            for layer in range(LAYERS):
                torch.testing.assert_close(outs[layer], resident.forward(layer, *inputs[layer]), rtol=2e-2, atol=2e-2)


@pytest.mark.cuda
def test_cuda_pipeline_bf16_matches_resident_without_sync():
    banks = make_banks(LAYERS, 16, 128, 64)
    banks = ExpertBanks(banks.w13.bfloat16(), banks.w2.bfloat16())
    host = ExpertBanks(banks.w13.pin_memory(), banks.w2.pin_memory())
    piped = OffloadedExperts.create(host, 48, "cuda", pipeline=True)
    cuda_rounds_match(piped, ResidentExperts(ExpertBanks(banks.w13.cuda(), banks.w2.cuda())))
    stats = piped.pipeline.stats()  # hits from the cache (the kernel) or in place (the mirror: "auto" on a GPU)
    assert stats["from_cache"] + stats["in_place"] > 0 and stats["from_host"] > 0
    assert lent_slots_are_empty(piped.cache)  # the last batch was a chunk


@pytest.mark.cuda
def test_cuda_stage_kernel_matches_twin():
    gen = torch.Generator().manual_seed(1)
    host, pools, slot_for_id, stats = stage_case(gen, layers=4, experts=16, slots=48, lent=32, shape=(128, 96))
    host = [h.bfloat16().pin_memory() for h in host]
    outs = []
    for backend in ("triton", "eager"):  # the twin copies from the host with a sync: checked for the kernel only
        p = [t.bfloat16().cuda() for t in pools]
        s, table = stats.cuda(), slot_for_id.cuda()
        with sync_errors() if backend == "triton" else contextlib.nullcontext():
            stage_mod.stage_experts(2, 16, 32, table, *p, *host, *[t[16:32] for t in p], s,
                                    backend=backend)
        outs.append((p, s))
    assert all(torch.equal(a, b) for a, b in zip(outs[0][0], outs[1][0])) and torch.equal(outs[0][1], outs[1][1])


def small_runner(invalidate: str = "fixed", pipeline: bool = True, stage: str = "auto",
                 expert_dtype: str = "auto") -> ModelRunner:
    return ModelRunner(RunnerConfig("small-geometry", device="cuda", dtype="bfloat16", page_size=16, kv_tokens=4096,
                                    max_prefill_tokens=512,
                                    experts=ExpertOptions(cache_fraction=0.25, dummy_weights=True,
                                                          prefill_pipeline=pipeline, prefill_invalidate=invalidate,
                                                          prefill_stage=stage, expert_dtype=expert_dtype)))


def prefill(r: ModelRunner, prompt: list[int], chunk: int) -> torch.Tensor:
    pages = r.kv_pool.allocate(r.kv_pool.pages_for(len(prompt)))
    try:
        for pos in range(0, len(prompt), chunk):
            out = r.forward([SequenceChunk(prompt[pos:pos + chunk], pos, pages)], [SamplingParams()], [0])
        return out.logits
    finally:
        r.kv_pool.free(pages)


@pytest.mark.cuda
@pytest.mark.parametrize("stage,expert_dtype", [("kernel", "auto"), ("misses", "auto"), ("misses", "fp8"),
                                                ("mirror", "auto"), ("mirror", "fp8"), ("mirror", "nvfp4")])
def test_cuda_multichunk_prefill_stage_modes_equal_the_cache_path(stage, expert_dtype):
    """Chunks staged by the kernel, by the misses' conditional copies or by the copy engine from the
    mirror (from the mapped host store, bf16 and fp8 or nvfp4 with their scale banks) give the
    logits of the plain cache path, under sync debug."""
    from moe_offload.miss_copies import conditional_graphs

    if stage == "misses" and not conditional_graphs():
        with pytest.raises(ValueError, match="conditional nodes"):
            small_runner(stage=stage, expert_dtype=expert_dtype)
        return
    r = small_runner(stage=stage, expert_dtype=expert_dtype)
    prompt = torch.randint(0, 512, (1400,), generator=torch.Generator().manual_seed(0)).tolist()
    prefill(r, prompt[:600], 512)  # compile every kernel outside the check
    with sync_errors():
        logits = prefill(r, prompt, 512)
    torch.cuda.synchronize()
    want = prefill(small_runner(pipeline=False, expert_dtype=expert_dtype), prompt, 512)
    assert ((logits - want).norm() / want.norm()).item() < 2e-2
    stats = r.experts.pipeline.stats()
    assert stats[f"chunks_{stage}"] > 0 and stats["from_host"] > 0
    assert stage in ("misses", "mirror") or stats["in_place"] == 0  # no decode ran: no hit to read in place


@pytest.mark.cuda
def test_cuda_misses_graphs_copy_the_flagged_experts_only():
    """The captured conditional copies against the eager twin: random tables, each layer staged
    twice (a different buffer's slot map each time), every byte of the pools equal."""
    from moe_offload.miss_copies import MissCopies, conditional_graphs

    if not conditional_graphs():
        pytest.skip(f"torch {torch.__version__} captures no conditional graph nodes")
    gen = torch.Generator().manual_seed(4)
    layers, experts, lent, slots = 4, 16, 32, 64
    host = [torch.randn(layers * experts, *shape, generator=gen).bfloat16().pin_memory() for shape in ((8, 6), (6, 4))]
    table = torch.full((layers * experts,), -1, dtype=torch.int32)
    held = torch.randperm(layers * experts, generator=gen)[:slots - lent]
    table[held] = torch.arange(lent, slots, dtype=torch.int32)
    table[held[:3]] = torch.tensor([0, 5, 20], dtype=torch.int32)  # entries in lent slots are not hits
    results = []
    for stream in (torch.cuda.Stream(), None):
        pools = [torch.zeros(slots, *h.shape[1:], dtype=h.dtype, device="cuda") for h in host]
        copies = MissCopies(table.cuda(), [(h, p) for h, p in zip(host, pools)], layers, experts,
                            torch.arange(experts), lent, stream)
        staged = torch.zeros(layers, 2, dtype=torch.int64, device="cuda")
        with sync_errors() if stream is not None else contextlib.nullcontext():
            for layer in (0, 1, 2, 3, 2):
                copies.stage(layer, staged)
        torch.cuda.synchronize()
        results.append((pools, staged, copies.slot_map.clone(), copies.in_place.clone()))
    (pools, staged, slot_map, in_place), (want_pools, *want) = results
    assert all(torch.equal(a, b) for a, b in zip(pools, want_pools))
    assert torch.equal(staged, want[0]) and torch.equal(slot_map, want[1]) and torch.equal(in_place, want[2])
    assert 0 < int(staged[:, 1].sum()) < 5 * experts and int(in_place.sum()) > 0


@pytest.mark.cuda
def test_cuda_multichunk_prefill_has_no_hidden_sync():
    r = small_runner()
    assert r.experts.pipeline is not None and r.experts.cache.num_slots == 48
    prompt = torch.randint(0, 512, (1400,), generator=torch.Generator().manual_seed(0)).tolist()
    prefill(r, prompt[:600], 512)  # compile every kernel outside the check
    with sync_errors():
        logits = prefill(r, prompt, 512)  # chunks of 512, 512 and 376 tokens
    torch.cuda.synchronize()
    want = prefill(small_runner(pipeline=False), prompt, 512)
    assert ((logits - want).norm() / want.norm()).item() < 2e-2
    assert r.experts.pipeline.stats()["from_host"] > 0

    eager = small_runner("eager")
    prefill(eager, prompt[:600], 512)
    with pytest.raises(RuntimeError, match="synchroniz"), sync_errors():
        prefill(eager, prompt, 512)
    torch.cuda.synchronize()


QWEN3_STORE_BYTES = 58 * 10**9  # qwen3-30b-geometry's experts in the shared-memory store


@pytest.mark.cuda
@pytest.mark.skipif(not os.path.isdir("/dev/shm") or shutil.disk_usage("/dev/shm").total < QWEN3_STORE_BYTES + 2**30,
                    reason="needs a /dev/shm that can hold the 58 GB qwen3-30b-geometry expert store")
def test_cuda_qwen3_geometry_multichunk_prefill_at_quarter_cache_has_no_hidden_sync():
    """The benchmark workload itself: three 8k chunks (the last two over a cached prefix) through
    the pipeline at 25% cache, every launch under sync-debug "error"."""
    r = ModelRunner(RunnerConfig("qwen3-30b-geometry", device="cuda", dtype="bfloat16", kv_tokens=3 * 8192 + 64,
                                 max_prefill_tokens=8192,
                                 experts=ExpertOptions(cache_fraction=0.25, dummy_weights=True)))
    assert r.experts.pipeline is not None and r.experts.pipeline.invalidate == "fixed"
    prompt = torch.randint(0, r.model_config.vocab_size, (3 * 8192,), generator=torch.Generator().manual_seed(0))
    prefill(r, prompt[:1024].tolist(), 1024)  # compile every kernel outside the check
    before = r.experts.pipeline.stats()["from_host"]
    with sync_errors():
        logits = prefill(r, prompt.tolist(), 8192)
    torch.cuda.synchronize()
    assert torch.isfinite(logits).all()
    assert r.experts.pipeline.stats()["from_host"] > before


@pytest.mark.cuda
def test_cuda_mirror_follows_graph_decode_and_chunks():
    """Under "mirror" a decode step's captured graph copies the table into the host's mirror (a copy
    forked inside the graph and joined back) and so does each chunk's copy stream: after prefill
    chunks and greedy decoding from graphs the mirror equals the table; the chunks after the first
    planned from it, so they moved the misses, not every expert."""
    r = small_runner(stage="mirror")
    prompt = torch.randint(0, 512, (1400,), generator=torch.Generator().manual_seed(1)).tolist()
    generate(r, prompt[:600], SamplingParams(), 24, max_prefill_tokens=512)
    r.experts.reset_stats()
    generate(r, prompt, SamplingParams(), 24, max_prefill_tokens=512)
    torch.cuda.synchronize()
    assert r.graphs is not None and r.graphs.captured and all(s.forward is not None for s in r.graphs.captured.values())
    mirrored = r.experts.pipeline.mirrored
    assert torch.equal(mirrored.mirror.cuda(), r.experts.cache.tables.slot_for_id)
    stats = r.experts.pipeline.stats()
    assert stats["chunks_mirror"] >= 2 and stats["in_place"] > 0
    assert stats["from_host"] + stats["in_place"] - stats["mirror_wasted"] == stats["chunks_mirror"] * (
        r.experts.cache.num_layers * r.experts.cache.num_experts)
