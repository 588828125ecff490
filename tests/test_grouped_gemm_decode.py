"""The decode path of the grouped SwiGLU GEMM (moe_offload/kernels/grouped_gemm_decode.py: no
align launch; up to DECODE_MAX_TOKENS tokens no sum launch either) against the eager twin: interpreted on the CPU in float32 (the interpreter's
``tl.dot`` multiplies bfloat16 as raw uint16 bits), compiled in bfloat16, sync-free and
graph-captured on a GPU."""
from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")

from moe_offload.grouped import grouped_swiglu, grouped_swiglu_eager  # noqa: E402
from tests.launch_count import sync_errors  # noqa: E402
from tests.test_grouped_gemm import make_banks, make_routing, rel_err  # noqa: E402

interpreted = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs TRITON_INTERPRET=1")
TRIALS = 20
CASES = ["random", "duplicates", "one_slot", "zero_weights"]


def decode():
    from moe_offload.kernels import grouped_gemm_decode

    return grouped_gemm_decode


def trial_inputs(num_tokens, top_k, num_slots, dim, inter, dtype, device, trials):
    """``trials`` routings (every case in turn) of random banks, each with the eager twin's output."""
    for trial in range(trials):
        w13, w2 = make_banks(num_slots, dim, inter, dtype, device, seed=trial)
        gen = torch.Generator(device=device).manual_seed(trial + 100)
        hidden = torch.randn(num_tokens, dim, generator=gen, device=device).to(dtype)
        weights, slots = make_routing(CASES[trial % len(CASES)], num_tokens, top_k, num_slots, device, trial)
        yield (hidden, weights, slots, w13, w2), grouped_swiglu_eager(hidden, weights, slots, w13, w2)


def check_trials(num_tokens, top_k, num_slots, dim, inter, dtype, device, config=None, trials=TRIALS,
                 sync_free=False):
    """The decode path against the twin over ``trials`` routings; with ``sync_free`` the decode path
    runs under ``set_sync_debug_mode("error")`` (the inputs, the twin and the comparison outside it).
    One trial's banks at a time (qwen3-30b's shapes are 1.2 GB of GPU memory a trial)."""
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    inputs = trial_inputs(num_tokens, top_k, num_slots, dim, inter, dtype, device, trials)
    for trial, (args, ref) in enumerate(inputs):
        with sync_errors(sync_free):
            out = decode().decode_grouped_swiglu(*args, config)
        assert rel_err(out, ref) < tol, (trial, CASES[trial % len(CASES)])


# T, k, slots, hidden, inter: one token (the batch-1 step; on and off the tiles), slots shared by tokens, shapes off
# every tile (hidden and inter not multiples, more slots than pairs); the last two take the
# per-slot down (more than DECODE_MAX_TOKENS tokens; test_public_op_takes_each_path_at_its_batch
# runs it at DECODE_MAX_PAIRS)
CONFIGS = [(1, 4, 16, 64, 32), (1, 3, 10, 40, 24), (4, 3, 5, 48, 40), (3, 2, 40, 33, 17), (7, 2, 6, 40, 24), (8, 4, 24, 32, 16)]
SMALL_TILES = dict(gate_up_n=16, gate_up_k=16, down_n=16, down_k=16, slot_down_n=16, slot_down_k=16, pair_n=16,
                   pair_k=16)


@interpreted
@pytest.mark.parametrize("shape", CONFIGS, ids=lambda c: "T{}k{}N{}H{}I{}".format(*c))
def test_decode_path_matches_twin_interpreted(shape):
    check_trials(*shape, torch.float32, "cpu", decode().DecodeConfig(**SMALL_TILES))


@interpreted
@pytest.mark.parametrize("tokens", [3, 6])
def test_decode_path_out_of_range_slots_contribute_zero(tokens):
    w13, w2 = make_banks(4, 32, 16)
    hidden = torch.randn(tokens, 32)
    weights, slots = make_routing("random", tokens, 3, 4)
    bad = torch.zeros(tokens, 3, dtype=torch.bool)
    bad[0, 0] = True
    bad[2] = True
    out = decode().decode_grouped_swiglu(hidden, weights, slots.masked_fill(bad, -1).masked_fill(bad.roll(1, 1), 4),
                                         w13, w2, decode().DecodeConfig(**SMALL_TILES))
    bad = bad | bad.roll(1, 1)
    ref = grouped_swiglu_eager(hidden, weights.masked_fill(bad, 0.0), slots.masked_fill(bad, 0), w13, w2)
    assert rel_err(out, ref) < 1e-5
    assert torch.all(out[2] == 0)


@interpreted
def test_one_token_out_of_range_slots_contribute_zero():
    """One token takes the per-pair gate_up: its programs of slots -1 and N store nothing."""
    w13, w2 = make_banks(4, 32, 16)
    hidden = torch.randn(1, 32)
    weights, slots = make_routing("random", 1, 4, 4)
    bad = torch.tensor([[True, False, False, False]])  # pair 0 on slot -1, pair 1 on slot N
    out = decode().decode_grouped_swiglu(hidden, weights, slots.masked_fill(bad, -1).masked_fill(bad.roll(1, 1), 4),
                                         w13, w2, decode().DecodeConfig(**SMALL_TILES))
    ref = grouped_swiglu_eager(hidden, weights.masked_fill(bad | bad.roll(1, 1), 0.0), slots, w13, w2)
    assert rel_err(out, ref) < 1e-5
    bad = torch.ones(1, 4, dtype=torch.bool)
    out = decode().decode_grouped_swiglu(hidden, weights, slots.masked_fill(bad, -1), w13, w2,
                                         decode().DecodeConfig(**SMALL_TILES))
    assert torch.all(out == 0)


@interpreted
def test_public_op_takes_each_path_at_its_batch():
    """``grouped_swiglu`` sends a few tokens to the per-token down, up to DECODE_MAX_PAIRS pairs to
    the per-slot down, larger batches to the align path."""
    from tests.launch_count import count_launches

    max_tokens, max_pairs = decode().DECODE_MAX_TOKENS, decode().DECODE_MAX_PAIRS
    w13, w2 = make_banks(6, 16, 16)
    paths = {1: "_decode_down_kernel", max_tokens: "_decode_down_kernel",
             max_tokens + 1: "_decode_slot_down_kernel", max_pairs // 2: "_decode_slot_down_kernel",
             max_pairs // 2 + 1: "_align_kernel"}
    for tokens, kernel in paths.items():
        weights, slots = make_routing("random", tokens, 2, 6)
        hidden = torch.randn(tokens, 16)
        with count_launches() as counter:
            out = grouped_swiglu(hidden, weights, slots, w13, w2, backend="triton")
        assert rel_err(out, grouped_swiglu_eager(hidden, weights, slots, w13, w2)) < 1e-5
        assert f"triton.{kernel}" in counter.launches, (tokens, dict(counter.launches))
        assert sum(counter.launches[k] for k in counter.launches if k.startswith("triton.")) == (
            2 if tokens <= max_tokens else 3 if tokens * 2 <= max_pairs else 4)


# ---- the fill: the gate_up launch copies the lookup's misses into their slots as it reads them ----

FILL_CASES = ["some", "none", "all"]


def fill_trial(num_tokens, top_k, num_slots, dim, inter, dtype, device, trial, host_device=None):
    """Inputs of a decode GEMM with a fill (``FILL_CASES[trial % 3]`` of the routed slots missed,
    each from a distinct host expert) and what it must give: the output and slot pools of a gather
    first and the eager twin after."""
    from moe_offload.grouped import SlotFill
    from moe_offload.kernels.lookup_admit import CopyPlan

    w13, w2 = make_banks(num_slots, dim, inter, dtype, device, seed=trial)
    host_w13, host_w2 = (t.to(host_device or device) for t in make_banks(num_slots + 8, dim, inter, dtype, device,
                                                                       seed=trial + 50))
    if host_device == "cpu" and device != "cpu":
        host_w13, host_w2 = host_w13.pin_memory(), host_w2.pin_memory()
    gen = torch.Generator().manual_seed(trial)
    weights, slots = make_routing(CASES[trial % len(CASES)], num_tokens, top_k, num_slots, device, trial)
    routed = slots.unique().cpu()
    case = FILL_CASES[trial % len(FILL_CASES)]
    count = {"some": max(1, len(routed) // 2), "none": 0, "all": len(routed)}[case]
    missed = routed[torch.randperm(len(routed), generator=gen)[:count]]
    src = torch.full((slots.numel(),), -1, dtype=torch.int32)
    dst = src.clone()
    src[:count] = torch.randperm(num_slots + 8, generator=gen)[:count].int()
    dst[:count] = missed.int()
    plan = CopyPlan(src.to(device), dst.to(device), torch.tensor([count], dtype=torch.int32, device=device))
    want13, want2 = w13.clone(), w2.clone()
    want13[missed.to(device)] = host_w13[src[:count].long()].to(device)
    want2[missed.to(device)] = host_w2[src[:count].long()].to(device)
    hidden = torch.randn(num_tokens, dim, generator=gen).to(dtype).to(device)
    ref = grouped_swiglu_eager(hidden, weights, slots, want13, want2)
    return (hidden, weights, slots, w13, w2), SlotFill(plan, host_w13, host_w2), (ref, want13, want2)


@interpreted
@pytest.mark.parametrize("shape", CONFIGS, ids=lambda c: "T{}k{}N{}H{}I{}".format(*c))
def test_fill_copies_the_plan_and_matches_the_twin_interpreted(shape):
    """Over 20 routings (some, none or all routed slots missed): the output is the twin's over the
    gathered pools, and the pools are the gathered ones bit for bit (hits and other slots untouched)."""
    config = decode().DecodeConfig(**SMALL_TILES, fill_k=16, fill_rows=4)
    for trial in range(TRIALS):
        args, fill, (ref, want13, want2) = fill_trial(*shape, torch.float32, "cpu", trial)
        out = decode().decode_grouped_swiglu(*args, config, fill=fill)
        assert rel_err(out, ref) < 1e-5, trial
        assert torch.equal(args[3], want13) and torch.equal(args[4], want2), trial


@interpreted
def test_public_op_fills_in_the_gemm_only_on_the_decode_path():
    """``grouped_swiglu(fill=...)``: the decode path's gate_up copies (no gather launch); larger
    batches and the eager twin gather first; every way leaves the same pools and output."""
    from tests.launch_count import count_launches

    for tokens, backend, gathers in [(1, "triton", 0), (4, "triton", 0), (40, "triton", 1), (4, "eager", 0)]:
        args, fill, (ref, want13, want2) = fill_trial(tokens, 2, 48, 16, 16, torch.float32, "cpu", 0)
        with count_launches() as counter:
            out = grouped_swiglu(*args, backend=backend, fill=fill)
        assert counter.launches.get("triton.gather_missing_few_kernel", 0) == gathers, (tokens, backend)
        assert rel_err(out, ref) < 1e-5, (tokens, backend)
        assert torch.equal(args[3], want13) and torch.equal(args[4], want2), (tokens, backend)


def test_fill_refuses_banks_it_cannot_copy_by_offset():
    args, fill, _ = fill_trial(1, 2, 4, 16, 8, torch.float32, "cpu", 0)
    with pytest.raises(ValueError, match="does not match the slots"):
        decode().decode_grouped_swiglu(*args, fill=fill._replace(host_w2=fill.host_w2[:, :8]))
    with pytest.raises(ValueError, match="contiguous"):
        decode().decode_grouped_swiglu(*args, fill=fill._replace(host_w13=fill.host_w13.transpose(1, 2).contiguous()
                                                                  .transpose(1, 2)))


def test_decode_path_refuses_too_many_pairs():
    w13, w2 = make_banks(4, 16, 8)
    tokens = decode().DECODE_MAX_PAIRS // 2 + 1
    weights, slots = make_routing("random", tokens, 2, 4)
    with pytest.raises(ValueError):
        decode().decode_grouped_swiglu(torch.randn(tokens, 16), weights, slots, w13, w2)


# ==== GPU ====

@pytest.mark.cuda
@pytest.mark.parametrize("shape", [(1, 8, 128, 2048, 768), (4, 8, 128, 2048, 768), (8, 8, 128, 2048, 768),
                                   (2, 2, 8, 576, 1536), (24, 2, 8, 576, 1536)],
                         ids=lambda c: "T{}k{}N{}H{}I{}".format(*c))
def test_decode_path_bf16_sync_free(shape):
    """qwen3-30b's shapes (batch 1, 4 and 8) and the default model's, without a sync."""
    check_trials(*shape, torch.bfloat16, "cuda", trials=1)  # compiles outside the sync check
    check_trials(*shape, torch.bfloat16, "cuda", sync_free=True)


@pytest.mark.cuda
@pytest.mark.parametrize("tokens", [1, 8])
def test_decode_path_float32_output(tokens):
    """``out_dtype=float32`` (expert parallelism's partials): the sum is not rounded to bf16."""
    w13, w2 = make_banks(128, 2048, 768, torch.bfloat16, "cuda")
    hidden = torch.randn(tokens, 2048, device="cuda").bfloat16()
    weights, slots = make_routing("random", tokens, 8, 128, "cuda")
    out = grouped_swiglu(hidden, weights, slots, w13, w2, out_dtype=torch.float32)
    assert out.dtype == torch.float32
    ref = grouped_swiglu_eager(hidden, weights, slots, w13, w2, out_dtype=torch.float32)
    assert rel_err(out, ref) < 2e-2


@pytest.mark.cuda
@pytest.mark.parametrize("shape", [(1, 8, 128, 2048, 768), (8, 8, 128, 2048, 768), (3, 2, 40, 576, 1536)],
                         ids=lambda c: "T{}k{}N{}H{}I{}".format(*c))
def test_fill_from_pinned_host_banks_sync_free(shape):
    """The fill reads mapped (pinned) host memory as serving does: 20 routings under the sync check,
    each the twin's output over the gathered pools, the pools gathered bit for bit. One trial's
    banks at a time: held all at once, qwen3-30b's shapes took 20-25 GiB of the GPU a process (and
    pinned host memory to match), and six processes side by side ran the H200 out of memory."""
    args, fill, _ = fill_trial(*shape, torch.bfloat16, "cuda", 0, host_device="cpu")
    decode().decode_grouped_swiglu(*args, fill=fill)  # compiles outside the sync check
    for trial in range(TRIALS):
        args, fill, (ref, want13, want2) = fill_trial(*shape, torch.bfloat16, "cuda", trial, host_device="cpu")
        with sync_errors():
            out = decode().decode_grouped_swiglu(*args, fill=fill)
        assert rel_err(out, ref) < 2e-2, trial
        assert torch.equal(args[3], want13) and torch.equal(args[4], want2), trial


@pytest.mark.cuda
def test_decode_path_graph_replay_with_new_routing(capture_graph):
    w13, w2 = make_banks(64, 512, 256, torch.bfloat16, "cuda")
    hidden = torch.randn(2, 512, device="cuda").bfloat16()
    weights, slots = make_routing("random", 2, 8, 64, "cuda", seed=0)
    run = decode().decode_grouped_swiglu
    graph, out = capture_graph(lambda: run(hidden, weights, slots, w13, w2))
    for seed in range(1, 4):
        new_weights, new_slots = make_routing("duplicates" if seed % 2 else "random", 2, 8, 64, "cuda", seed)
        weights.copy_(new_weights)
        slots.copy_(new_slots)
        graph.replay()
        assert rel_err(out, grouped_swiglu_eager(hidden, weights, slots, w13, w2)) < 2e-2


@pytest.mark.cuda
@pytest.mark.parametrize("regs", [128, 96, 64])
def test_one_token_gate_up_under_a_register_cap(regs):
    """``pair_regs`` (ptxas' maxnreg, tried by the decode sweep) changes where values live, not
    what is computed: qwen3-30b's shapes, one token, against the eager twin."""
    w13, w2 = make_banks(64, 2048, 768, torch.bfloat16, "cuda")
    config = decode().DecodeConfig(pair_regs=regs)
    for seed in range(3):
        hidden = torch.randn(1, 2048, generator=torch.Generator().manual_seed(seed)).bfloat16().cuda()
        weights, slots = make_routing("random", 1, 8, 64, "cuda", seed=seed)
        out = decode().decode_grouped_swiglu(hidden, weights, slots, w13, w2, config)
        assert rel_err(out, grouped_swiglu_eager(hidden, weights, slots, w13, w2)) < 2e-2, seed
