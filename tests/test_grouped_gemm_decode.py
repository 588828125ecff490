"""The decode path of the grouped SwiGLU GEMM (moe_offload/kernels/grouped_gemm_decode.py: no
align, no sum launch) against the eager twin: interpreted on the CPU in float32 (the interpreter's
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


def check_trials(num_tokens, top_k, num_slots, dim, inter, dtype, device, config=None, trials=TRIALS):
    """``trials`` routings (every case in turn) of random banks: the decode path against the twin."""
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for trial in range(trials):
        w13, w2 = make_banks(num_slots, dim, inter, dtype, device, seed=trial)
        gen = torch.Generator(device=device).manual_seed(trial + 100)
        hidden = torch.randn(num_tokens, dim, generator=gen, device=device).to(dtype)
        weights, slots = make_routing(CASES[trial % len(CASES)], num_tokens, top_k, num_slots, device, trial)
        ref = grouped_swiglu_eager(hidden, weights, slots, w13, w2)
        out = decode().decode_grouped_swiglu(hidden, weights, slots, w13, w2, config)
        assert rel_err(out, ref) < tol, (trial, CASES[trial % len(CASES)])


# T, k, slots, hidden, inter: one token (the batch-1 step), a full batch with slots shared by
# tokens, and shapes off every tile (hidden and inter not multiples, more slots than pairs)
CONFIGS = [(1, 4, 16, 64, 32), (4, 3, 5, 48, 40), (3, 2, 40, 33, 17)]
SMALL_TILES = dict(gate_up_n=16, gate_up_k=16, down_n=16, down_k=16)


@interpreted
@pytest.mark.parametrize("shape", CONFIGS, ids=lambda c: "T{}k{}N{}H{}I{}".format(*c))
def test_decode_path_matches_twin_interpreted(shape):
    check_trials(*shape, torch.float32, "cpu", decode().DecodeConfig(**SMALL_TILES))


@interpreted
def test_decode_path_out_of_range_slots_contribute_zero():
    w13, w2 = make_banks(4, 32, 16)
    hidden = torch.randn(3, 32)
    weights, slots = make_routing("random", 3, 3, 4)
    bad = torch.tensor([[True, False, False], [False, False, False], [True, True, True]])
    out = decode().decode_grouped_swiglu(hidden, weights, slots.masked_fill(bad, -1).masked_fill(bad.roll(1, 1), 4),
                                         w13, w2, decode().DecodeConfig(**SMALL_TILES))
    bad = bad | bad.roll(1, 1)
    ref = grouped_swiglu_eager(hidden, weights.masked_fill(bad, 0.0), slots.masked_fill(bad, 0), w13, w2)
    assert rel_err(out, ref) < 1e-5
    assert torch.all(out[2] == 0)


@interpreted
def test_public_op_takes_the_decode_path_up_to_its_batch():
    """``grouped_swiglu`` sends decode batches here and larger ones to the align path."""
    from tests.launch_count import count_launches

    limit = decode().DECODE_MAX_TOKENS
    w13, w2 = make_banks(6, 16, 16)
    for tokens in (1, limit, limit + 1):
        weights, slots = make_routing("random", tokens, 2, 6)
        hidden = torch.randn(tokens, 16)
        with count_launches() as counter:
            out = grouped_swiglu(hidden, weights, slots, w13, w2, backend="triton")
        assert rel_err(out, grouped_swiglu_eager(hidden, weights, slots, w13, w2)) < 1e-5
        kernels = {name for name in counter.launches if name.startswith("triton.")}
        assert ("triton._decode_down_kernel" in kernels) == (tokens <= limit), kernels


def test_decode_path_refuses_a_large_batch():
    w13, w2 = make_banks(4, 16, 8)
    tokens = decode().DECODE_MAX_TOKENS + 1
    weights, slots = make_routing("random", tokens, 2, 4)
    with pytest.raises(ValueError):
        decode().decode_grouped_swiglu(torch.randn(tokens, 16), weights, slots, w13, w2)


# ==== GPU ====

@pytest.mark.cuda
@pytest.mark.parametrize("shape", [(1, 8, 128, 2048, 768), (4, 8, 128, 2048, 768), (2, 2, 8, 576, 1536)],
                         ids=lambda c: "T{}k{}N{}H{}I{}".format(*c))
def test_decode_path_bf16_sync_free(shape):
    """qwen3-30b's shapes (batch 1 and 4) and the default model's, without a sync."""
    check_trials(*shape, torch.bfloat16, "cuda", trials=1)  # compiles outside the sync check
    torch.cuda.set_sync_debug_mode("error")
    try:
        check_trials(*shape, torch.bfloat16, "cuda", trials=TRIALS)
    finally:
        torch.cuda.set_sync_debug_mode("default")


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
