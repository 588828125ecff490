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
    runs under ``set_sync_debug_mode("error")`` (the inputs, the twin and the comparison outside it)."""
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    cases = list(trial_inputs(num_tokens, top_k, num_slots, dim, inter, dtype, device, trials))
    if sync_free:
        torch.cuda.set_sync_debug_mode("error")
    try:
        outs = [decode().decode_grouped_swiglu(*args, config) for args, _ in cases]
    finally:
        if sync_free:
            torch.cuda.set_sync_debug_mode("default")
    for trial, (out, (_, ref)) in enumerate(zip(outs, cases)):
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
def test_decode_path_graph_replay_with_new_routing():
    w13, w2 = make_banks(64, 512, 256, torch.bfloat16, "cuda")
    hidden = torch.randn(2, 512, device="cuda").bfloat16()
    weights, slots = make_routing("random", 2, 8, 64, "cuda", seed=0)
    run = decode().decode_grouped_swiglu
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        run(hidden, weights, slots, w13, w2)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run(hidden, weights, slots, w13, w2)
    for seed in range(1, 4):
        new_weights, new_slots = make_routing("duplicates" if seed % 2 else "random", 2, 8, 64, "cuda", seed)
        weights.copy_(new_weights)
        slots.copy_(new_slots)
        graph.replay()
        assert rel_err(out, grouped_swiglu_eager(hidden, weights, slots, w13, w2)) < 2e-2
