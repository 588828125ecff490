"""A decode batch over 4-bit (nvfp4, mxfp4) experts copies an expert-cache lookup's misses in as
its gate_up launch runs (moe_offload/kernels/grouped_gemm_w4_decode.py, a ``SlotFill``), as the
bf16 and fp8 decode paths do: the planned experts' scale banks are gathered first, then the packed
words of each planned slot land before its program reads them (one token's per-pair kernel, more
tokens' per-slot one) and copy programs move the w2 words. Checked against a gather followed by
the eager twin: the slot pools after the call, byte for byte, and the output; interpreted on the
CPU, and on a GPU from pinned host banks under the sync check. Larger batches gather first,
through the public op."""
from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():  # the interpreter is chosen when the kernel module is imported
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")

from moe_offload.expert_scales import ExpertScales  # noqa: E402
from moe_offload.formats.expert_format import ScaleBlock  # noqa: E402
from moe_offload.kernels.grouped_gemm_w4_banks import GROUP, grouped_swiglu_w4_eager  # noqa: E402
from moe_offload.kernels.lookup_admit import CopyPlan  # noqa: E402
from moe_offload.slot_fill import SlotFill  # noqa: E402
from tests.launch_count import sync_errors  # noqa: E402
from tests.record_banks import as_records  # noqa: E402
from tests.test_grouped_gemm_w4 import (FORMATS, TOLERANCE, Banks, decode, kernels, make_extras,  # noqa: E402
                                        random_banks, rel_err)

interpreted = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs TRITON_INTERPRET=1")
FILL_CASES = ["none", "some", "all"]
# (slots, hidden, inter, top-k) at interpreter sizes: K a multiple of the group, not of 128
CPU_SHAPES = {"nvfp4": (9, 80, 48, 3), "mxfp4": (9, 96, 64, 3)}
# one token's tiles, the fill's copy step (words) and w2 rows a copy program: three configurations
CPU_TILES = [dict(pair_n=16, pair_k=32, gate_up_n=16, gate_up_k=32, fill_k=4, fill_rows=4),
             dict(pair_n=32, pair_k=64, gate_up_n=32, gate_up_k=64, fill_k=8, fill_rows=8),
             dict(pair_n=16, pair_k=64, gate_up_n=16, gate_up_k=32, fill_k=16, fill_rows=16)]
# tokens a trial, in turn: one (the per-pair gate_up) and more (the per-slot one, both downs)
TOKENS = [1, 3, 6]


def scales_of(banks: Banks, fmt: str) -> ExpertScales:
    """The banks' scales as a cache holds them (channel scales ``[S, N, 1]``)."""
    channels = (None, None)
    if banks.w13_channel_scale is not None:
        channels = (banks.w13_channel_scale.unsqueeze(-1), banks.w2_channel_scale.unsqueeze(-1))
    return ExpertScales(banks.w13_scale, banks.w2_scale, ScaleBlock(1, GROUP[fmt]), *channels, kind=fmt)


def tensors(banks: Banks) -> list[torch.Tensor]:
    return [t for t in banks if t is not None]


def fill_case(banks: Banks, host: Banks, fmt: str, slots: torch.Tensor, trial: int, gen: torch.Generator):
    """A plan missing none, some or all of the routed slots (each from a distinct host expert), and
    the banks it must leave (``Banks``, a gather's result)."""
    num_slots = banks.w13.shape[0]
    routed = slots[(slots >= 0) & (slots < num_slots)].unique().cpu()
    count = {"none": 0, "some": max(1, len(routed) // 2), "all": len(routed)}[FILL_CASES[trial % 3]]
    missed = routed[torch.randperm(len(routed), generator=gen)[:count]]
    src = torch.full((slots.numel(),), -1, dtype=torch.int32)
    dst = src.clone()
    src[:count] = torch.randperm(host.w13.shape[0], generator=gen)[:count].int()
    dst[:count] = missed.int()
    want = [None if t is None else t.clone() for t in banks]
    for pool, bank in zip(want, host):
        if pool is not None:
            pool[missed.to(pool.device)] = bank[src[:count].long()].to(pool.device)
    dev = banks.w13.device
    plan = CopyPlan(src.to(dev), dst.to(dev), torch.tensor([count], dtype=torch.int32, device=dev))
    return SlotFill(plan, host.w13, host.w2, scales_of(host, fmt)), Banks(*want)


def pinned(banks: Banks) -> Banks:
    return Banks(*(None if t is None else t.cpu().pin_memory() for t in banks))


def in_records(banks: Banks, pin: bool = False) -> Banks:
    """``banks`` as views into expert records (the store's and the cache's layout), pinned with ``pin``."""
    views = iter(as_records([t for t in banks if t is not None], pin))
    return Banks(*(None if t is None else next(views) for t in banks))


def run_trials(fmt, shape, device, trials, config=None, host_device=None, sync_free=False, records=False):
    """``trials`` calls of 1, 3 or 6 tokens (slots shared between tokens), each with its own banks and
    a fill of none, some or all of its routed slots (every fourth trial a slot out of range; every
    other one gpt-oss's biases and clamped activation): pools and output against a gather and the
    twin. ``records``: the pools and the host banks as expert records."""
    num_slots, dim, inter, top_k = shape
    for trial in range(trials):  # one trial's banks at a time: a GPU run pins them in host memory
        gen = torch.Generator().manual_seed(trial)
        banks = random_banks(num_slots, dim, inter, fmt, device, seed=trial, gain=3.0)
        host = random_banks(num_slots + 6, dim, inter, fmt, device, seed=trial + 50, gain=3.0)
        if records:
            banks, host = in_records(banks), in_records(host, pin=host_device == "cpu")
        elif host_device == "cpu":
            host = pinned(host)
        tokens = TOKENS[trial % len(TOKENS)]
        slots = torch.stack([torch.randperm(num_slots, generator=gen)[:top_k] for _ in range(tokens)])
        if trial % 4 == 3:
            slots[-1, 0] = -1 if trial % 8 == 3 else num_slots
        weights, slots = torch.rand(tokens, top_k, generator=gen).to(device), slots.to(device)
        extras = make_extras(gen, banks, slots, with_bias=trial % 2 == 1, gpt_oss=trial % 2 == 1)
        dtype = torch.float32 if device == "cpu" else torch.bfloat16
        hidden = torch.randn(tokens, dim, generator=gen).to(device, dtype)
        fill, want = fill_case(banks, host, fmt, slots, trial, gen)
        with sync_errors(sync_free):
            out = decode().decode_grouped_swiglu_w4(hidden, weights, slots, *banks.w4(extras), fmt=fmt, config=config,
                                                    fill=fill, **extras.kwargs())
        assert all(torch.equal(got, w) for got, w in zip(tensors(banks), tensors(want))), trial
        ref = grouped_swiglu_w4_eager(hidden, weights, slots, *want.w4(extras), fmt=fmt, **extras.kwargs())
        assert rel_err(out, ref) < TOLERANCE[hidden.dtype], (trial, rel_err(out, ref))


@interpreted
@pytest.mark.parametrize("case", range(3))
@pytest.mark.parametrize("fmt", FORMATS)
def test_fill_matches_a_gather_interpreted(fmt, case):
    """3 configurations x 6 trials: 1, 3 and 6 tokens, none, some or all of the routed slots
    filled, out-of-range slots; the third configuration over expert records."""
    config = decode().W4_DECODE_TILES._replace(**CPU_TILES[case])
    run_trials(fmt, CPU_SHAPES[fmt], "cpu", trials=6, config=config, records=case == 2)


@interpreted
@pytest.mark.parametrize("fmt", FORMATS)
def test_public_op_fills_decode_batches_and_gathers_larger_ones(fmt, monkeypatch):
    """``grouped_swiglu`` over 4-bit slots: a decode batch hands its fill to the GEMM (no whole
    gather), a larger one gathers first; both leave the pools a gather leaves and the twin's output."""
    from moe_offload.kernels.grouped_gemm_decode import DECODE_MAX_PAIRS

    from moe_offload.grouped import grouped_swiglu

    gathers = []
    real = SlotFill.gather
    monkeypatch.setattr(SlotFill, "gather", lambda self, *a, **k: gathers.append(1) or real(self, *a, **k))
    num_slots, dim, inter, top_k = CPU_SHAPES[fmt]
    for tokens in (1, 2, DECODE_MAX_PAIRS // top_k + 1):
        gen = torch.Generator().manual_seed(tokens)
        banks = random_banks(num_slots, dim, inter, fmt, seed=tokens, gain=3.0)
        host = random_banks(num_slots + 6, dim, inter, fmt, seed=tokens + 50, gain=3.0)
        slots = torch.stack([torch.randperm(num_slots, generator=gen)[:top_k] for _ in range(tokens)])
        weights, hidden = torch.rand(tokens, top_k, generator=gen), torch.randn(tokens, dim, generator=gen)
        fill, want = fill_case(banks, host, fmt, slots[:1], 2, gen)  # every slot of the first token missed
        out = grouped_swiglu(hidden, weights, slots, banks.w13, banks.w2, scales=scales_of(banks, fmt), fill=fill,
                             backend="triton")
        assert all(torch.equal(got, w) for got, w in zip(tensors(banks), tensors(want)))
        ref = grouped_swiglu_w4_eager(hidden, weights, slots, *want.w4(), fmt=fmt)
        assert rel_err(out, ref) < TOLERANCE[torch.float32]
    assert gathers == [1]  # the call past the decode path only


def test_refuses_a_fill_it_cannot_ride():
    fmt, (num_slots, dim, inter, top_k) = "mxfp4", CPU_SHAPES["mxfp4"]
    banks, host = random_banks(num_slots, dim, inter, fmt), random_banks(num_slots, dim, inter, fmt, seed=1)
    plan = CopyPlan(*(torch.full((2 * top_k,), -1, dtype=torch.int32) for _ in range(2)),
                    torch.zeros(1, dtype=torch.int32))
    slots = torch.arange(2 * top_k).view(2, top_k) % num_slots
    with pytest.raises(ValueError, match="cannot fill as it computes"):
        many = torch.zeros(33, top_k, dtype=torch.long)
        kernels().grouped_swiglu_w4(torch.randn(33, dim), torch.rand(33, top_k), many, *banks.w4(), fmt=fmt,
                                    backend="triton", fill=SlotFill(plan, host.w13, host.w2, scales_of(host, fmt)))
    nvfp4_host = random_banks(num_slots, dim, inter, "nvfp4")
    with pytest.raises(ValueError, match="host's mxfp4 scales"):
        decode().decode_grouped_swiglu_w4(torch.randn(1, dim), torch.rand(1, top_k), slots[:1], *banks.w4(), fmt=fmt,
                                          fill=SlotFill(plan, host.w13, host.w2, scales_of(nvfp4_host, "nvfp4")))


# ==== GPU ====

@pytest.mark.cuda
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("shape", [(128, 2048, 768, 8), (64, 2880, 2880, 4)], ids=["qwen3-30b", "gpt-oss"])
def test_cuda_fill_from_pinned_host_banks_sync_free(fmt, shape):
    """qwen3-30b's and gpt-oss-120b's shapes, default tiles: 20 fills of 1, 3 and 6 tokens from
    pinned host banks, each call under the sync check once compiled."""
    run_trials(fmt, shape, "cuda", trials=3, host_device="cpu")  # compiles every variant
    run_trials(fmt, shape, "cuda", trials=20, host_device="cpu", sync_free=True)
    run_trials(fmt, shape, "cuda", trials=4, host_device="cpu", sync_free=True, records=True)
