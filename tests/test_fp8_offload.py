"""FP8 experts through the whole offload path: the expert store in fp8 (identity, reuse, dummy
fill, quantize-at-fill of a float checkpoint), the cache / gather / stage kernels moving fp8 bytes
plus float32 scales (interpreted on the CPU against their eager twins, compiled and sync-free on a
GPU), cache sizing in real bytes, and offloaded fp8 generation equal to resident fp8 generation."""
from __future__ import annotations

import argparse
import contextlib
import os

import pytest
import torch

if not torch.cuda.is_available():  # interpreted kernels are chosen when first decorated, lazily
    os.environ.setdefault("TRITON_INTERPRET", "1")

from moe_offload.expert_cache import ExpertCache, slot_bytes  # noqa: E402
from moe_offload.expert_store import ExpertStore, remove_segment  # noqa: E402
from moe_offload.experts import ExpertBanks, ResidentExperts  # noqa: E402
from moe_offload.fp8 import BLOCK_128, FP8_DTYPE, PER_CHANNEL, ScaleBlock, quantize, quantize_w13  # noqa: E402
from moe_offload.formats import ExpertFormat  # noqa: E402
from moe_offload.kernels import gather_missing as gather_mod  # noqa: E402
from moe_offload.kernels import stage_experts as stage_mod  # noqa: E402
from moe_offload.offloaded import OffloadedExperts  # noqa: E402
from moe_offload.store_fill import open_checkpoint_experts, open_dummy_experts  # noqa: E402
from moe_offload.store_layout import ExpertGeometry, StoreIdentity  # noqa: E402
from moe_offload.store_quantize import fill_dummy_fp8, quantize_into  # noqa: E402
from moe_offload.store_layout import BankLayout  # noqa: E402
from tests.launch_count import sync_errors  # noqa: E402
from tests.test_expert_cache import make_banks, skewed_routing  # noqa: E402
from tests.tiny_models import write_tiny  # noqa: E402
from worker.batch import SequenceChunk  # noqa: E402
from worker.expert_placement import ExpertOptions  # noqa: E402
from scheduler.generate import generate  # noqa: E402
from worker.memory_plan import expert_slots  # noqa: E402
from worker.runner import ModelRunner, RunnerConfig  # noqa: E402
from scheduler.messages.to_scheduler import SamplingParams  # noqa: E402

FP8 = ExpertFormat(FP8_DTYPE, BLOCK_128)
interpreted = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="interpreted kernels run on the CPU")


def raw(t: torch.Tensor) -> torch.Tensor:
    """fp8 compared bit for bit."""
    return t.view(torch.uint8) if t.dtype == FP8_DTYPE else t


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and torch.equal(raw(a), raw(b))


def quantized_banks(banks: ExpertBanks, block: ScaleBlock = BLOCK_128) -> ExpertBanks:
    (q13, s13), (q2, s2) = quantize_w13(banks.w13, block), quantize(banks.w2, block)
    return ExpertBanks(q13, q2, s13, s2, block)


# ==== the store ====

def test_fp8_store_identity_reuse_and_bf16_twin(tmp_path):
    geometry = ExpertGeometry(2, 3, 256, 192)  # I = 192: w13's halves do not fill whole 128-row blocks
    fp8 = open_dummy_experts(geometry, 5, FP8, tmp_path)
    bf16 = open_dummy_experts(geometry, 5, torch.bfloat16, tmp_path)
    try:
        assert fp8.name != bf16.name and "fp8-b128x128" in fp8.identity.label
        assert StoreIdentity.dummy(geometry, 5, ExpertFormat(FP8_DTYPE, PER_CHANNEL)).name != fp8.name
        banks = fp8.host_banks()
        assert banks.scale_block == BLOCK_128 and banks.w13.dtype == banks.w2.dtype == FP8_DTYPE
        assert banks.w13_scale.shape == (2, 3, 4, 2) and banks.w2_scale.shape == (2, 3, 2, 2)
        assert fp8.nbytes < 0.6 * bf16.nbytes and bf16.host_banks().w13_scale is None
        calls = []
        again = ExpertStore.open_or_create(fp8.identity, BankLayout.experts(geometry, FP8), calls.append, tmp_path)
        assert calls == [] and again.layout.scale_block == BLOCK_128  # reused, not filled again
        assert all(same(a, b) for a, b in zip(again.host_banks().tensors(), banks.tensors()))
    finally:
        for store in (fp8, bf16):
            remove_segment(store.name, tmp_path)
    assert not list(tmp_path.glob("sluice-experts-*"))


@pytest.mark.parametrize("geometry", [ExpertGeometry(2, 3, 256, 128), ExpertGeometry(1, 2, 96, 40)], ids=str)
def test_fp8_dummy_fill_is_the_quantized_float_draw(tmp_path, geometry):
    """Whole 128-blocks take the in-place path, the others ``fp8.quantize``: both bit for bit."""
    layout = BankLayout.experts(geometry, FP8)
    a = ExpertStore.open_or_create(StoreIdentity("a", "a"), layout, lambda s: fill_dummy_fp8(s, 3, threads=1), tmp_path)
    b = ExpertStore.open_or_create(StoreIdentity("b", "b"), layout, lambda s: fill_dummy_fp8(s, 3, threads=3), tmp_path)
    banks, count = a.host_banks(), geometry.num_layers * geometry.num_experts
    assert all(same(x, y) for x, y in zip(banks.tensors(), b.host_banks().tensors()))
    for i in (0, count - 1):
        layer, e = divmod(i, geometry.num_experts)
        seed = 3 * 2 * count + i  # fill_dummy's seed of the same matrix
        w13 = torch.empty(banks.w13.shape[2:]).normal_(0, 0.02, generator=torch.Generator().manual_seed(seed))
        w2 = torch.empty(banks.w2.shape[2:]).normal_(0, 0.02, generator=torch.Generator().manual_seed(seed + count))
        q13, s13 = quantize_w13(w13)
        q2, s2 = quantize(w2)
        assert same(banks.w13[layer, e], q13) and same(banks.w13_scale[layer, e], s13)
        assert same(banks.w2[layer, e], q2) and same(banks.w2_scale[layer, e], s2)


@pytest.mark.parametrize("shape,block", [((256, 384), BLOCK_128), ((200, 130), BLOCK_128), ((64, 48), PER_CHANNEL)])
def test_quantize_into_equals_quantize(shape, block):
    w = torch.randn(shape) * torch.logspace(-3, 1, shape[1])  # columns of very different magnitude
    w[:shape[0] // 3] = 0.0  # zero blocks get scale 1
    q, s = quantize(w, block)
    got_q, got_s = torch.empty_like(q), torch.empty_like(s)
    quantize_into(w.clone(), got_q, got_s, block)
    assert same(got_q, q) and same(got_s, s)


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_float_checkpoint_is_quantized_once_at_fill(tmp_path, family):
    ckpt = tmp_path / "ckpt"
    write_tiny(ckpt, family, seed=2, layers=2, experts=4, hidden=64, inter=40)
    geometry = ExpertGeometry(2, 4, 64, 40)
    float_store = open_checkpoint_experts(ckpt, geometry, torch.float32, shm_dir=tmp_path)
    fp8_store = open_checkpoint_experts(ckpt, geometry, FP8, shm_dir=tmp_path)
    assert fp8_store.name != float_store.name
    want = quantized_banks(float_store.host_banks())
    got = fp8_store.host_banks()
    assert all(same(a, b) for a, b in zip(got.tensors(), want.tensors()))
    calls = []  # a second open maps the quantized segment: no fill
    again = ExpertStore.open_or_create(fp8_store.identity, fp8_store.layout, calls.append, tmp_path)
    assert calls == [] and same(again.host_banks().w2_scale, want.w2_scale)


# ==== the kernels: gather and stage move fp8 bytes and float32 scales ====

def fp8_bank(gen: torch.Generator, *shape: int) -> torch.Tensor:
    return (torch.randn(*shape, generator=gen) * 100).to(FP8_DTYPE)


def gather_case(gen: torch.Generator, ids: int, slots: int, hidden: int, inter: int):
    host = [fp8_bank(gen, ids, 2 * inter, hidden), fp8_bank(gen, ids, hidden, inter)]
    pools = [fp8_bank(gen, slots, *h.shape[1:]) for h in host]
    host_scales = [torch.rand(ids, 4, 3, generator=gen), torch.rand(ids, 2, 5, generator=gen)]
    slot_scales = [torch.rand(slots, *s.shape[1:], generator=gen) for s in host_scales]
    count = int(torch.randint(0, slots + 1, (1,), generator=gen))
    src = torch.full((slots + 2,), -1, dtype=torch.int32)
    dst = torch.full((slots + 2,), -1, dtype=torch.int32)
    src[:count] = torch.randint(ids, (count,), generator=gen).int()
    dst[:count] = torch.randperm(slots, generator=gen)[:count].int()
    return (src, dst, torch.tensor([count], dtype=torch.int32)), host, pools, host_scales, slot_scales


def run_gather_fp8(seed: int, shape: tuple[int, int, int, int], device: str, guard=contextlib.nullcontext):
    plan, host, pools, host_scales, slot_scales = gather_case(torch.Generator().manual_seed(seed), *shape)
    want = [t.clone() for t in (*pools, *slot_scales)]
    gather_mod.gather_missing(*plan, *host, *want[:2], backend="eager", host_scales=host_scales,
                              slot_scales=want[2:])
    got = [t.clone().to(device) for t in (*pools, *slot_scales)]
    pinned = (lambda t: t) if device == "cpu" else (lambda t: t.pin_memory())
    plan_d, host_p, scales_p = [t.to(device) for t in plan], list(map(pinned, host)), [pinned(t) for t in host_scales]
    with guard():  # inputs are built first: only the gather itself must not synchronise
        gather_mod.gather_missing(*plan_d, *host_p, *got[:2], backend="triton",
                                  host_scales=scales_p, slot_scales=got[2:])
    assert all(same(a.cpu(), b) for a, b in zip(got, want))
    assert int(plan[2]) == 0 or not all(same(a, b) for a, b in zip(want, (*pools, *slot_scales)))


@interpreted
@pytest.mark.parametrize("shape", [(6, 4, 10, 3), (5, 3, 7, 5)], ids=["even-rows", "odd-rows"])  # int16 / uint8 views
def test_gather_fp8_and_scales_interpreted(shape):
    for trial in range(8):
        run_gather_fp8(trial, shape, "cpu")


def test_gather_refuses_scales_on_one_side_only():
    plan, host, pools, host_scales, _ = gather_case(torch.Generator().manual_seed(0), 6, 4, 10, 3)
    with pytest.raises(ValueError, match="or for neither"):
        gather_mod.gather_missing(*plan, *host, *pools, host_scales=host_scales)
    with pytest.raises(ValueError, match="does not match"):
        gather_mod.gather_missing(*plan, *host, *pools, host_scales=host_scales,
                                  slot_scales=[torch.zeros(4, 4, 2), torch.zeros(4, 2, 5)])


def stage_case_fp8(gen: torch.Generator, layers=3, experts=6, slots=20, lent=12, shape=(5, 7)):
    host = [fp8_bank(gen, layers * experts, *shape), fp8_bank(gen, layers * experts, shape[1], shape[0]),
            torch.rand(layers * experts, 2, 1, generator=gen), torch.rand(layers * experts, 1, 3, generator=gen)]
    pools = [fp8_bank(gen, slots, *h.shape[1:]) if h.dtype == FP8_DTYPE else torch.rand(slots, *h.shape[1:], generator=gen)
             for h in host]
    slot_for_id = torch.full((layers * experts,), -1, dtype=torch.int32)
    resident = torch.randperm(layers * experts, generator=gen)[:slots]
    slot_for_id[resident] = torch.randperm(slots, generator=gen)[:len(resident)].int()
    return host, pools, slot_for_id, torch.zeros(layers, 2, dtype=torch.int64)


def run_stage_fp8(gen: torch.Generator, layer: int, backend: str, case, device: str = "cpu", lent: int = 12,
                  experts: int = 6, guard=contextlib.nullcontext):
    host, pools, slot_for_id, stats = case
    pools, stats, table = [t.clone().to(device) for t in pools], stats.clone().to(device), slot_for_id.to(device)
    bufs = [t[experts:2 * experts] for t in pools]
    with guard():
        stage_mod.stage_experts(layer, experts, lent, table, *pools[:2], *host[:2], *bufs[:2], stats, backend=backend,
                                programs=4, scales=list(zip(pools[2:], host[2:], bufs[2:])))
    return [t.cpu() for t in pools], stats.cpu()


@interpreted
def test_stage_fp8_and_scales_interpreted():
    gen = torch.Generator().manual_seed(3)
    for trial in range(6):
        case = stage_case_fp8(gen, shape=(5, 7) if trial % 2 else (4, 6))
        layer = trial % 3
        (p_k, s_k), (p_e, s_e) = (run_stage_fp8(gen, layer, b, case) for b in ("triton", "eager"))
        assert all(same(a, b) for a, b in zip(p_k, p_e)) and torch.equal(s_k, s_e)
        host, pools, slot_for_id, _ = case
        gids = layer * 6 + torch.arange(6)
        hit = slot_for_id[gids] >= 12
        for bank in range(4):  # every bank, the scales included, follows the same hit/miss rule
            want = torch.where(hit.view(-1, 1, 1), pools[bank][slot_for_id[gids].long().clamp(min=0)], host[bank][gids])
            assert same(p_e[bank][6:12], want)


# ==== the cache: sizing and the offloaded backend ====

def test_fp8_cache_slot_holds_weights_and_scales_and_doubles_the_slots():
    w13, w2 = (1536, 2048), (2048, 768)  # qwen3-30b-geometry
    bf16, fp8 = slot_bytes(w13, w2, torch.bfloat16), slot_bytes(w13, w2, FP8_DTYPE, BLOCK_128)
    cache = ExpertCache(1, 4, w13, w2, 4, FP8_DTYPE, "cpu", scale_block=BLOCK_128)
    assert cache.slot_bytes == fp8 == sum(t[0].nbytes for t in (cache.w13, cache.w2, *cache.scales[:2]))
    assert bf16 == 2 * 3 * 2048 * 768
    budget = 10**10
    auto = ExpertOptions(cache_auto=True)
    ratio = expert_slots(auto, 10**6, fp8, budget) / expert_slots(auto, 10**6, bf16, budget)
    assert 1.99 < ratio <= 2.0
    with pytest.raises(ValueError, match="scale block"):
        ExpertCache(1, 4, w13, w2, 4, FP8_DTYPE, "cpu")


LAYERS, EXPERTS, HIDDEN, INTER, TOP_K = 4, 8, 16, 8, 2


@pytest.mark.parametrize("pipeline", [False, True])
def test_offloaded_fp8_layers_equal_resident_fp8(pipeline):
    banks = quantized_banks(make_banks(LAYERS, EXPERTS, HIDDEN, INTER), ScaleBlock(4, 8))
    resident = ResidentExperts(banks)
    offloaded = OffloadedExperts.create(banks, 3 * EXPERTS, "cpu", pipeline=pipeline)
    assert offloaded.cache.scales is not None and offloaded.cache.w13.dtype == FP8_DTYPE
    gen = torch.Generator().manual_seed(0)
    bias = 2 * torch.randn(LAYERS, EXPERTS, generator=gen)
    for tokens in (24, 2, 2, 24, 2):
        for layer in range(LAYERS):
            hidden = torch.randn(tokens, HIDDEN, generator=gen)
            weights, ids = skewed_routing(gen, tokens, EXPERTS, TOP_K, bias[layer])
            torch.testing.assert_close(offloaded.forward(layer, hidden, weights, ids),
                                       resident.forward(layer, hidden, weights, ids), rtol=1e-5, atol=1e-6)
    assert offloaded.cache.stats()["total"]["misses"] > 0
    if pipeline:
        assert offloaded.pipeline.stats()["bytes_h2d"] == offloaded.pipeline.stats()["from_host"] * \
            offloaded.cache.slot_bytes > 0


def test_offloaded_refuses_banks_of_another_format():
    banks = make_banks(1, 4, 16, 8)
    cache = ExpertCache.for_banks(quantized_banks(banks), 4, "cpu")
    with pytest.raises(ValueError, match="do not fit a cache"):
        OffloadedExperts(banks, cache)


# ==== the runner ====

@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-fp8")
    write_tiny(path, "qwen3_moe", seed=4, layers=4, experts=8, top_k=2, inter=40)
    return str(path)


def runner(model_dir, **experts) -> ModelRunner:
    return ModelRunner(RunnerConfig(model_dir, device="cpu", dtype="float32", page_size=4, kv_tokens=512,
                                    experts=ExpertOptions(**experts)))


def test_offloaded_fp8_generation_equals_resident_fp8(model_dir):
    resident = runner(model_dir, expert_dtype="fp8")
    assert resident.expert_format == FP8 and resident.experts.banks.w13.dtype == FP8_DTYPE
    runs = {"piped": runner(model_dir, expert_dtype="fp8", cache_size=24),
            "plain": runner(model_dir, expert_dtype="fp8", cache_size=24, prefill_pipeline=False),
            "small": runner(model_dir, expert_dtype="fp8", cache_fraction=0.25)}
    assert runs["piped"].experts.pipeline is not None and runs["plain"].experts.pipeline is None
    assert all(r.experts.cache.w13.dtype == FP8_DTYPE for r in runs.values())
    for prompt in (list(range(1, 50)), [5, 9, 11]):  # chunks of 20, 20 and 9 tokens; a decode-sized prompt
        want = generate(resident, prompt, SamplingParams(), 8, max_prefill_tokens=20).token_ids
        for name, r in runs.items():
            assert generate(r, prompt, SamplingParams(), 8, max_prefill_tokens=20).token_ids == want, name
    assert runs["piped"].experts.pipeline.stats()["from_host"] > 0
    assert runs["small"].experts.cache.stats()["total"]["misses"] > 0


def test_fp8_logits_stay_close_to_float(model_dir):
    prompt = list(range(3, 40))

    def logits(r: ModelRunner) -> torch.Tensor:
        pages = r.kv_pool.allocate(r.kv_pool.pages_for(len(prompt)))
        out = r.forward([SequenceChunk(prompt, 0, pages)], [SamplingParams()], [0]).logits
        r.kv_pool.free(pages)
        return out

    want, got = logits(runner(model_dir)), logits(runner(model_dir, expert_dtype="fp8", cache_size=24))
    error = ((got - want).norm() / want.norm()).item()
    assert 0 < error < 5e-2  # fp8 really ran, and stayed close


def test_expert_dtype_option_reaches_the_runner():
    from worker.cli_options import add_runner_args, runner_config

    p = argparse.ArgumentParser()
    add_runner_args(p)
    assert runner_config(p.parse_args([]), "m").experts.expert_dtype == "auto"
    assert runner_config(p.parse_args(["--expert-dtype", "fp8"]), "m").experts.expert_dtype == "fp8"
    with pytest.raises(SystemExit):
        p.parse_args(["--expert-dtype", "int4"])


def test_dummy_geometry_runs_in_fp8():
    r = ModelRunner(RunnerConfig("tiny-geometry", device="cpu", dtype="float32", page_size=4, kv_tokens=256,
                                 experts=ExpertOptions(cache_fraction=0.5, dummy_weights=True, expert_dtype="fp8")))
    try:
        assert r.experts.cache.scales is not None and "fp8" in r.experts.store.identity.label
        assert len(generate(r, [1, 2, 3, 4, 5], SamplingParams(), 4).token_ids) == 4
    finally:
        remove_segment(r.experts.store.name)


# ==== GPU ====

@pytest.mark.cuda
@pytest.mark.parametrize("shape", [(6, 4, 10, 3), (5, 3, 7, 5), (40, 16, 256, 96)], ids=str)
def test_cuda_gather_fp8_and_scales_matches_twin(shape):
    for trial in range(10):
        run_gather_fp8(trial, shape, "cuda", guard=sync_errors if trial else contextlib.nullcontext)


@pytest.mark.cuda
def test_cuda_stage_fp8_and_scales_matches_twin():
    gen = torch.Generator().manual_seed(1)
    case = stage_case_fp8(gen, layers=4, experts=16, slots=48, lent=32, shape=(128, 96))
    case = ([t.pin_memory() for t in case[0]], *case[1:])
    run_stage_fp8(gen, 2, "triton", case, "cuda", lent=32, experts=16)  # compiles
    kernel = run_stage_fp8(gen, 2, "triton", case, "cuda", lent=32, experts=16, guard=sync_errors)
    twin = run_stage_fp8(gen, 2, "eager", case, "cuda", lent=32, experts=16)
    assert all(same(a, b) for a, b in zip(kernel[0], twin[0])) and torch.equal(kernel[1], twin[1])


@pytest.mark.cuda
def test_cuda_fp8_pipeline_and_cache_match_resident_without_sync():
    """Needs the Triton fp8 grouped GEMM (fp8-kernel)."""
    banks = quantized_banks(make_banks(LAYERS, 16, 256, 128))
    host = ExpertBanks(*(t.pin_memory() for t in banks.tensors()), banks.scale_block)
    piped = OffloadedExperts.create(host, 48, "cuda", pipeline=True)
    resident = ResidentExperts(banks.to("cuda"))
    gen = torch.Generator().manual_seed(0)
    bias = torch.randn(LAYERS, 16, generator=gen)
    for checked in (False, True, True):  # the first round compiles
        for tokens in (256, 4, 4, 256):
            inputs = [(torch.randn(tokens, 256, generator=gen).bfloat16().cuda(),
                       *skewed_routing(gen, tokens, 16, 4, bias[layer], "cuda")) for layer in range(LAYERS)]
            with sync_errors() if checked else contextlib.nullcontext():
                outs = [piped.forward(layer, *inputs[layer]) for layer in range(LAYERS)]
            for layer in range(LAYERS):
                torch.testing.assert_close(outs[layer], resident.forward(layer, *inputs[layer]), rtol=2e-2, atol=2e-2)
    stats = piped.pipeline.stats()
    # hits staged from the cache (the kernel) or read in place (the mirror, "auto" on a GPU)
    assert stats["from_cache"] + stats["in_place"] > 0 and stats["from_host"] > 0
    assert piped.cache.stats()["total"]["misses"] > 0


def prefill_then_decode(r: ModelRunner, prompt: list[int], chunk: int, decode: int) -> torch.Tensor:
    """Prefill ``prompt`` in chunks, then ``decode`` steps of fixed tokens; the last logits. Reads
    nothing on the host, so it can run under the sync check."""
    pages = r.kv_pool.allocate(r.kv_pool.pages_for(len(prompt) + decode))
    try:
        for pos in range(0, len(prompt), chunk):
            out = r.forward([SequenceChunk(prompt[pos:pos + chunk], pos, pages)], [SamplingParams()], [0])
        for step in range(decode):
            out = r.forward([SequenceChunk([7 + step], len(prompt) + step, pages)], [SamplingParams()], [step + 1])
        return out.logits
    finally:
        r.kv_pool.free(pages)


def check_sync_free_offload_near_resident(r: ModelRunner, resident: ModelRunner) -> None:
    """A 1400-token prompt through ``r`` (experts behind a cache) with no hidden sync, after a warm-up
    that compiles: its logits within 2e-2 of ``resident``'s, and experts came from the host."""
    prompt = torch.randint(0, 512, (1400,), generator=torch.Generator().manual_seed(0)).tolist()
    prefill_then_decode(r, prompt[:600], 512, 2)  # compiles every kernel outside the check
    with sync_errors():
        logits = prefill_then_decode(r, prompt, 512, 4)  # chunks of 512, 512, 376, then 4 decode steps
    torch.cuda.synchronize()
    want = prefill_then_decode(resident, prompt, 512, 4)
    assert ((logits - want).norm() / want.norm()).item() < 2e-2
    assert r.experts.pipeline.stats()["from_host"] > 0 and r.experts.cache.stats()["total"]["misses"] > 0


@pytest.mark.cuda
def test_cuda_fp8_small_geometry_prefill_and_decode_without_sync():
    """Needs the Triton fp8 grouped GEMM (fp8-kernel). small-geometry's fp8 store behind a 25%
    cache: a multi-chunk prefill through the pipeline and decode steps through the cache with no
    hidden sync, close to the same fp8 experts fully resident."""
    def make(**experts) -> ModelRunner:
        return ModelRunner(RunnerConfig("small-geometry", device="cuda", dtype="bfloat16", page_size=16,
                                        kv_tokens=4096, max_prefill_tokens=512, cuda_graph=False,
                                        experts=ExpertOptions(dummy_weights=True, expert_dtype="fp8", **experts)))

    r, resident = make(cache_fraction=0.25), make()
    assert r.experts.pipeline is not None and r.experts.cache.w13.dtype == FP8_DTYPE
    assert r.experts.cache.num_slots == 48  # 25% of 12 x 16: 3E, the pipeline's minimum
    check_sync_free_offload_near_resident(r, resident)
