"""The fp8 decode path (moe_offload/kernels/grouped_gemm_decode_fp8.py: one token's per-pair
kernels, more tokens' per-slot gate_up, the per-token and per-slot downs) against the eager twin:
interpreted on the CPU in float32 (the interpreter loads e4m3 and widens it exactly), with scale
blocks of several shapes, slots out of range, slots shared by tokens and fills from host banks;
compiled in bf16, sync-free, from pinned host banks and graph-captured on a GPU."""
from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")

from moe_offload.fp8 import BLOCK_128, PER_CHANNEL, ScaleBlock  # noqa: E402
from moe_offload.grouped import ExpertScales, SlotFill, grouped_swiglu, grouped_swiglu_eager  # noqa: E402
from moe_offload.kernels.lookup_admit import CopyPlan  # noqa: E402
from tests.launch_count import sync_errors  # noqa: E402
from tests.record_banks import as_records  # noqa: E402
from tests.test_grouped_gemm_fp8 import make_fp8_banks, rel_err  # noqa: E402

interpreted = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs TRITON_INTERPRET=1")
TRIALS = 20  # on a GPU; interpreted, 6 a configuration (each fill case and a bad slot, twice)
INTERPRETED_TRIALS = 6
FILL_CASES = ["none", "some", "all"]
# scale blocks: several rows and columns at interpreter sizes, columns that are no power of two
# (the k step shrinks to 16), per channel; the kernel's scale modes: "k" (a block's rows span a
# tile's 8 columns), "kn" (4 rows: a tile spans two blocks), "n" (per channel)
BLOCKS = [ScaleBlock(16, 16), ScaleBlock(8, 48), ScaleBlock(4, 16), PER_CHANNEL]
# slots, hidden, inter, top-k, tiles: on the tiles, and off them (hidden and inter not multiples)
SHAPES = [(12, 96, 32, 4), (9, 80, 24, 3)]
SMALL = dict(pair_n=8, pair_k=32, down_n=8, down_k=32, fill_k=16, fill_rows=4, gate_up_n=16, gate_up_k=32,
             slot_down_n=16, slot_down_k=16)
# tokens a trial, in turn: one (per-pair gate_up), the per-token down (<= 4), the per-slot down
TOKENS = [1, 3, 6, 1, 2, 5]


def decode_fp8():
    from moe_offload.kernels import grouped_gemm_decode_fp8

    return grouped_gemm_decode_fp8


def routing(gen: torch.Generator, tokens: int, top_k: int, num_slots: int, device: str, trial: int):
    """Distinct slots a token as a router picks them, tokens sharing slots; every fourth trial one
    slot out of range (-1 or N), which contributes zero."""
    slots = torch.stack([torch.randperm(num_slots, generator=gen)[:top_k] for _ in range(tokens)])
    if trial % 4 == 3:
        slots[-1, 0] = -1 if trial % 8 == 3 else num_slots
    return torch.rand(tokens, top_k, generator=gen).to(device), slots.to(device)


def fill_case(banks, host, slots: torch.Tensor, trial: int, gen: torch.Generator):
    """A plan that misses none, some or all of the routed slots (each from a distinct host
    expert), and the pools and scales it must leave."""
    (w13, w2, scales), (h13, h2, hscales) = banks, host
    routed = slots[(slots >= 0) & (slots < w13.shape[0])].unique().cpu()
    count = {"none": 0, "some": max(1, len(routed) // 2), "all": len(routed)}[FILL_CASES[trial % 3]]
    missed = routed[torch.randperm(len(routed), generator=gen)[:count]]
    src = torch.full((slots.numel(),), -1, dtype=torch.int32)
    dst = src.clone()
    src[:count] = torch.randperm(h13.shape[0], generator=gen)[:count].int()
    dst[:count] = missed.int()
    want = [t.clone() for t in (w13, w2, scales.w13, scales.w2)]
    for pool, bank in zip(want, (h13, h2, hscales.w13, hscales.w2)):
        pool[missed.to(pool.device)] = bank[src[:count].long()].to(pool.device)
    dev = w13.device
    plan = CopyPlan(src.to(dev), dst.to(dev), torch.tensor([count], dtype=torch.int32, device=dev))
    return SlotFill(plan, h13, h2, hscales), want


def in_records(banks, block, pin: bool = False):
    """fp8 banks ``(w13, w2, scales)`` as views into expert records (the store's and the cache's)."""
    w13, w2, s13, s2 = as_records([banks[0], banks[1], banks[2].w13, banks[2].w2], pin)
    return w13, w2, ExpertScales(s13, s2, block)


def run_trials(shape, block, dtype, device, trials=TRIALS, config=None, host_device=None, sync_free=False,
               records=False):
    """``records``: the pools and the host banks as expert records."""
    num_slots, dim, inter, top_k = shape
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for trial in range(trials):  # one trial's banks at a time: a GPU run pins them in host memory
        gen = torch.Generator().manual_seed(trial)
        banks = make_fp8_banks(num_slots, dim, inter, block, device, seed=trial)
        host = make_fp8_banks(num_slots + 6, dim, inter, block, device, seed=trial + 50)
        if records:
            banks, host = in_records(banks, block), in_records(host, block, pin=host_device == "cpu")
        elif host_device == "cpu":
            host = (host[0].cpu().pin_memory(), host[1].cpu().pin_memory(),
                    ExpertScales(host[2].w13.cpu().pin_memory(), host[2].w2.cpu().pin_memory(), block))
        tokens = TOKENS[trial % len(TOKENS)]
        weights, slots = routing(gen, tokens, top_k, num_slots, device, trial)
        hidden = torch.randn(tokens, dim, generator=gen).to(device, dtype)
        fill, want = fill_case(banks, host, slots, trial, gen) if trial % 2 else (None, None)
        with sync_errors(sync_free):
            out = decode_fp8().decode_grouped_swiglu_fp8(hidden, weights, slots, *banks, config, fill=fill)
        if want is not None:
            assert all(torch.equal(got, w) for got, w in zip((banks[0], banks[1], banks[2].w13, banks[2].w2), want))
        ok = (slots >= 0) & (slots < num_slots)
        ref = grouped_swiglu_eager(hidden, weights * ok, slots.clamp(0, num_slots - 1), *banks[:2], banks[2])
        assert rel_err(out, ref) < tol, (trial, block)


@interpreted
@pytest.mark.parametrize("block", BLOCKS, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("records", [False, True], ids=["banks", "records"])
def test_parity_with_fills_interpreted(shape, block, records):
    run_trials(shape, block, torch.float32, "cpu", trials=INTERPRETED_TRIALS,
               config=decode_fp8().FP8_DECODE_TILES._replace(**SMALL), records=records)


@interpreted
def test_public_op_takes_the_decode_path_up_to_its_pairs(monkeypatch):
    """``grouped_swiglu`` over fp8 banks: without a fill, batches of up to RESIDENT_MAX_PAIRS pairs
    take this path and larger ones the general fp8 kernels; with one, up to DECODE_MAX_PAIRS (the
    misses copied in the gate_up), past that the general kernels after a gather."""
    from moe_offload.kernels.grouped_gemm_decode import DECODE_MAX_PAIRS

    calls = []
    real = decode_fp8().decode_grouped_swiglu_fp8
    monkeypatch.setattr(decode_fp8(), "decode_grouped_swiglu_fp8", lambda *a, **k: calls.append(1) or real(*a, **k))
    block = ScaleBlock(16, 16)
    resident = decode_fp8().RESIDENT_MAX_PAIRS // 2
    expect = []
    for trial, (tokens, filled) in enumerate([(1, False), (resident, False), (resident + 1, False),
                                              (resident + 1, True), (DECODE_MAX_PAIRS // 2, True),
                                              (DECODE_MAX_PAIRS // 2 + 1, True), (DECODE_MAX_PAIRS // 2 + 1, False)]):
        gen = torch.Generator().manual_seed(trial)
        banks = make_fp8_banks(6, 64, 16, block, seed=trial)
        weights, slots = routing(gen, tokens, 2, 6, "cpu", 0)
        fill, want = fill_case(banks, make_fp8_banks(8, 64, 16, block, seed=trial + 50), slots, 1, gen) \
            if filled else (None, None)
        hidden = torch.randn(tokens, 64, generator=gen)
        calls.clear()
        out = grouped_swiglu(hidden, weights, slots, *banks[:2], scales=banks[2], backend="triton", fill=fill)
        if want is not None:
            assert all(torch.equal(got, w) for got, w in zip((banks[0], banks[1], banks[2].w13, banks[2].w2), want))
        assert rel_err(out, grouped_swiglu_eager(hidden, weights, slots, *banks[:2], banks[2])) < 1e-5
        expect.append((tokens, filled, bool(calls)))
    assert [taken for *_, taken in expect] == [True, True, False, True, True, False, False], expect


def test_refuses_what_it_cannot_read():
    w13, w2, scales = make_fp8_banks(4, 32, 16, ScaleBlock(16, 16))
    with pytest.raises(ValueError, match="contiguous tokens of at most"):
        decode_fp8().decode_grouped_swiglu_fp8(torch.randn(33, 32), torch.rand(33, 2),
                                              torch.zeros(33, 2, dtype=torch.long), w13, w2, scales)
    plan = CopyPlan(*(torch.zeros(2, dtype=torch.int32) for _ in range(2)), torch.zeros(1, dtype=torch.int32))
    with pytest.raises(ValueError, match="host's fp8 scales"):
        decode_fp8().decode_grouped_swiglu_fp8(torch.randn(1, 32), torch.rand(1, 2), torch.zeros(1, 2, dtype=torch.long),
                                              w13, w2, scales, fill=SlotFill(plan, w13, w2))


# ==== GPU ====

@pytest.mark.cuda
@pytest.mark.parametrize("block", [BLOCK_128, PER_CHANNEL], ids=str)
@pytest.mark.parametrize("shape", [(128, 2048, 768, 8), (64, 2048, 512, 8), (40, 576, 1536, 2)], ids=str)
def test_bf16_from_pinned_host_banks_sync_free(shape, block):
    """qwen3-30b's, qwen3.5-35b-a3b's and the default model's shapes: 20 routings with fills from
    pinned host banks under the sync check."""
    run_trials(shape, block, torch.bfloat16, "cuda", trials=2, host_device="cpu")  # compiles
    run_trials(shape, block, torch.bfloat16, "cuda", host_device="cpu", sync_free=True)
    run_trials(shape, block, torch.bfloat16, "cuda", trials=4, host_device="cpu", sync_free=True, records=True)


@pytest.mark.cuda
def test_graph_replay_with_new_routing():
    w13, w2, scales = make_fp8_banks(64, 2048, 512, BLOCK_128, "cuda")
    hidden = torch.randn(1, 2048, device="cuda").bfloat16()
    weights, slots = torch.rand(1, 8, device="cuda"), torch.randperm(64, device="cuda")[:8].view(1, 8)
    run = decode_fp8().decode_grouped_swiglu_fp8
    run(hidden, weights, slots, w13, w2, scales)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run(hidden, weights, slots, w13, w2, scales)
    for seed in range(5):
        slots.copy_(torch.randperm(64, generator=torch.Generator().manual_seed(seed))[:8].view(1, 8))
        hidden.copy_(torch.randn(1, 2048).bfloat16())
        graph.replay()
        ref = grouped_swiglu_eager(hidden, weights, slots, w13, w2, scales)
        assert rel_err(out, ref) < 2e-2, seed


@pytest.mark.cuda
@pytest.mark.parametrize("regs", [128, 96, 64])
def test_one_token_gate_up_under_a_register_cap(regs):
    """``pair_regs`` (ptxas' maxnreg, tried by the decode sweep) changes where values live, not
    what is computed: qwen3-30b's shapes, one token, against the eager twin."""
    w13, w2, scales = make_fp8_banks(64, 2048, 768, BLOCK_128, "cuda")
    config = decode_fp8().FP8_DECODE_TILES._replace(pair_regs=regs)
    for seed in range(3):
        gen = torch.Generator().manual_seed(seed)
        hidden = torch.randn(1, 2048, generator=gen).bfloat16().cuda()
        weights, slots = torch.rand(1, 8, generator=gen).cuda(), torch.randperm(64, generator=gen)[:8].view(1, 8).cuda()
        out = decode_fp8().decode_grouped_swiglu_fp8(hidden, weights, slots, w13, w2, scales, config)
        assert rel_err(out, grouped_swiglu_eager(hidden, weights, slots, w13, w2, scales)) < 2e-2, seed


# ==== the per-token down in one step longer than the intermediate size (masked) ====

@interpreted
@pytest.mark.parametrize("block", [ScaleBlock(16, 16), PER_CHANNEL], ids=str)
def test_a_down_step_past_the_intermediate_size_interpreted(block):
    config = decode_fp8().FP8_DECODE_TILES._replace(**SMALL)._replace(down_k=128)
    run_trials((12, 96, 32, 4), block, torch.float32, "cpu", trials=INTERPRETED_TRIALS, config=config)


@pytest.mark.cuda
@pytest.mark.parametrize("tiles", [(8, 1024, 8), (8, 1024, 16), (16, 1024, 16), (8, 1024, 4)], ids=str)
@pytest.mark.parametrize("block", [BLOCK_128, PER_CHANNEL], ids=str)
def test_cuda_long_down_steps_sync_free(tiles, block):
    """The one-step downs the decode sweep tries, at qwen3-30b's shapes (768 of a 1024 step)."""
    config = decode_fp8().FP8_DECODE_TILES._replace(down_n=tiles[0], down_k=tiles[1], down_warps=tiles[2])
    run_trials((128, 2048, 768, 8), block, torch.bfloat16, "cuda", trials=2, config=config)  # compiles
    run_trials((128, 2048, 768, 8), block, torch.bfloat16, "cuda", trials=8, config=config, sync_free=True)


def test_the_tiles_env_changes_the_default_tiles_and_refuses_what_is_not_a_field(monkeypatch):
    """SLUICE_FP8_DECODE_TILES: how a whole decode step (bench_decode.py) times other tiles."""
    module = decode_fp8()
    monkeypatch.delenv(module.TILES_ENV, raising=False)
    assert module.decode_tiles() == module.FP8_DECODE_TILES
    monkeypatch.setenv(module.TILES_ENV, "pair_regs=128, pair_n=32,down_warps=4")
    assert module.decode_tiles() == module.FP8_DECODE_TILES._replace(pair_regs=128, pair_n=32, down_warps=4)
    for bad in ("pair_m=32", "pair_n=wide", "pair_n", "pair_dot=1"):
        monkeypatch.setenv(module.TILES_ENV, bad)
        with pytest.raises(ValueError, match="SLUICE_FP8_DECODE_TILES"):
            module.decode_tiles()
