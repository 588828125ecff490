"""Parity of the fp8 grouped SwiGLU GEMM (weights dequantized inside the kernel, or fp8 x fp8
with activations quantized per token-group) with its eager twin, and its host-side checks.

On the CPU the kernels run interpreted (TRITON_INTERPRET=1), tiny shapes, fp32 and fp16
activations. The interpreter of triton 3.9 loads fp8 and widens it exactly, but (1) its ``tl.dot``
multiplies bf16 operands as the raw uint16 it stores them in (``interpreter.create_dot``), so bf16
runs on the GPU only, and (2) its fp32 -> fp8 cast drops the carry into the exponent
(``_convert_float``: 125.4 -> 64), so the activation quantization kernel is checked on the GPU
(the interpreted fp8 x fp8 parity quantizes activations with the twin). On a GPU the parity is
compiled, sync-free and CUDA-graph captured.

Weights get magnitudes that vary by 2^±3 across rows and 2^±2 across columns, so the scale grids
vary a lot and a wrong scale row or column (the up half's offset above all) shows.
"""
from __future__ import annotations

import math
import os

import pytest
import torch

if not torch.cuda.is_available():  # the interpreter is chosen when the kernel module is imported
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")

from moe_offload.fp8 import ACTIVATION_BLOCK, BLOCK_128, PER_CHANNEL, ScaleBlock, quantize, quantize_w13  # noqa: E402
from moe_offload.grouped import (ExpertScales, fp8_activations_for, grouped_swiglu,  # noqa: E402
                                 grouped_swiglu_eager)

interpreted = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs TRITON_INTERPRET=1")
BLOCK_16 = ScaleBlock(16, 16)  # several scale rows and columns at interpreter-sized shapes


def kernels():
    from moe_offload.kernels import grouped_gemm_fp8

    return grouped_gemm_fp8


def make_fp8_banks(num_slots, dim, inter, block, device="cpu", seed=0):
    """Quantized ``w13 [N, 2I, H]``, ``w2 [N, H, I]`` and their ``ExpertScales``."""
    gen = torch.Generator(device=device).manual_seed(seed)

    def weight(rows, cols):
        mag = 2.0 ** (torch.rand(num_slots, rows, 1, generator=gen, device=device) * 6 - 3)
        mag = mag * 2.0 ** (torch.rand(num_slots, 1, cols, generator=gen, device=device) * 4 - 2)
        return torch.randn(num_slots, rows, cols, generator=gen, device=device) * mag / math.sqrt(cols)

    q13, s13 = quantize_w13(weight(2 * inter, dim), block)
    q2, s2 = quantize(weight(dim, inter), block)
    return q13, q2, ExpertScales(s13, s2, block)


def make_routing(gen, num_tokens, top_k, num_slots, device="cpu"):
    """Ragged routing: a random subset of slots (the rest get no tokens; sometimes one slot takes
    every pair) with skewed popularity; about half the time a token repeats a slot."""
    num_used = 1 if torch.rand(1, generator=gen) < 0.15 else int(torch.randint(1, num_slots + 1, (1,), generator=gen))
    used = torch.randperm(num_slots, generator=gen)[:num_used]
    probs = torch.softmax(torch.randn(len(used), generator=gen) * 2, 0)
    slots = used[torch.multinomial(probs, num_tokens * top_k, replacement=True, generator=gen)]
    slots = slots.view(num_tokens, top_k)
    if torch.rand(1, generator=gen) < 0.5:
        slots[:, -1] = slots[:, 0]
    weights = torch.rand(num_tokens, top_k, generator=gen)
    return weights.to(device), slots.to(device)


def rel_err(out, ref):
    return ((out.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-12)).item()


TOLERANCE = {torch.float32: 1e-4, torch.float16: 3e-3, torch.bfloat16: 2e-2}
# fp8 activations: kernel and twin round slightly different intermediate activations to fp8, and
# now and then one lands on the other side of a rounding boundary (an e4m3 step is 6-12 %).
FP8_ACTS_TOLERANCE = {torch.float32: 2e-3, torch.float16: 1e-2, torch.bfloat16: 3e-2}


def check_trials(banks, dtype, trials, token_counts, config=None, seed=0, sync_free=False, fp8_acts=False):
    """``trials`` random routings over ``banks = (q13, q2, scales)``, Triton vs twin, top-k 1..8
    as the bank allows; with ``sync_free`` the op runs under sync-debug "error"."""
    q13, q2, scales = banks
    tolerance = (FP8_ACTS_TOLERANCE if fp8_acts else TOLERANCE)[dtype]
    num_slots, dim = q2.shape[:2]
    gen = torch.Generator().manual_seed(seed)
    for trial in range(trials):
        num_tokens = token_counts[trial % len(token_counts)]
        top_k = int(torch.randint(1, min(8, num_slots) + 1, (1,), generator=gen))
        weights, slots = make_routing(gen, num_tokens, top_k, num_slots, q2.device)
        hidden = torch.randn(num_tokens, dim, generator=gen).to(q2.device, dtype)
        out = run_kernel(hidden, weights, slots, banks, config, sync_free, fp8_acts)
        ref = grouped_swiglu_eager(hidden, weights, slots, q13, q2, scales, fp8_acts)
        assert out.dtype == dtype and rel_err(out, ref) < tolerance, (trial, num_tokens, top_k)


def run_kernel(hidden, weights, slots, banks, config, sync_free, fp8_acts):
    if not sync_free:
        return call_kernel(hidden, weights, slots, banks, config, fp8_acts)
    torch.cuda.set_sync_debug_mode("error")
    try:
        return call_kernel(hidden, weights, slots, banks, config, fp8_acts)
    finally:
        torch.cuda.set_sync_debug_mode("default")


def call_kernel(hidden, weights, slots, banks, config, fp8_acts):
    q13, q2, scales = banks
    if config is None:
        return grouped_swiglu(hidden, weights, slots, q13, q2, scales=scales, fp8_activations=fp8_acts,
                              backend="triton")
    return kernels().fused_grouped_swiglu_fp8(hidden, weights, slots, q13, q2, scales, config, fp8_acts)


# ==== parity, interpreted ====

CPU_CASES = [  # (slots, hidden, inter), block, tiles (block_m, block_n, block_k)
    ((6, 56, 40), BLOCK_16, (16, 32, 16)),
    ((5, 136, 72), BLOCK_128, (16, 64, 32)),  # I and H not multiples of 128: masked tails
    ((4, 40, 24), PER_CHANNEL, (32, 32, 16)),
]


@interpreted
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("shape,block,tiles", CPU_CASES, ids=["b16", "b128", "channel"])
def test_parity_interpreted(shape, block, tiles, dtype):
    config = kernels().BlockConfig(*tiles, 2, 4, 2)
    check_trials(make_fp8_banks(*shape, block), dtype, trials=3, token_counts=[1, 5, 24], config=config)


@interpreted
def test_a_bound_on_distinct_slots_changes_no_output():
    """As the bf16 GEMM's test: a few slots of a large bank, bounded by their count, the same outputs."""
    q13, q2, scales = make_fp8_banks(24, 56, 40, BLOCK_16)
    gen = torch.Generator().manual_seed(3)
    slots = torch.randperm(24, generator=gen)[:4][torch.randint(0, 4, (12, 2), generator=gen)]
    hidden, weights = torch.randn(12, 56, generator=gen), torch.rand(12, 2, generator=gen)
    config = kernels().BlockConfig(16, 32, 16, 2, 4, 2)
    free = kernels().fused_grouped_swiglu_fp8(hidden, weights, slots, q13, q2, scales, config)
    bound = kernels().fused_grouped_swiglu_fp8(hidden, weights, slots, q13, q2, scales, config, groups=4)
    assert torch.equal(bound, free)


@interpreted
def test_public_op_takes_the_fp8_kernel_with_default_tiles():
    check_trials(make_fp8_banks(4, 48, 40, BLOCK_16), torch.float32, trials=2, token_counts=[3, 9])


@interpreted
@pytest.mark.parametrize("shape,block,tiles", CPU_CASES, ids=["b16", "b128", "channel"])
def test_fp8_activations_parity_interpreted(shape, block, tiles, monkeypatch):
    """The fp8 x fp8 GEMMs; activations quantized by the twin, as the interpreter's fp32 -> fp8
    cast is wrong (see quant_fp8). BLOCK_K is at least 32 here: fp8 dots need it on a GPU."""
    config = kernels().BlockConfig(tiles[0], tiles[1], 32, 2, 4, 2)
    block = ScaleBlock(16, 32) if block == BLOCK_16 else block
    monkeypatch.setattr(kernels(), "quantize_activations", lambda x, total=None: quantize(x, ACTIVATION_BLOCK))
    check_trials(make_fp8_banks(*shape, block), torch.float32, trials=3, token_counts=[1, 5, 24], config=config,
                 fp8_acts=True)


@interpreted
def test_activation_scales_interpreted():
    """Scales only: the interpreter's fp32 -> fp8 cast is wrong, the GPU test checks ``q`` too."""
    from moe_offload.kernels.quant_fp8 import quantize_activations

    x = torch.randn(37, 333, generator=torch.Generator().manual_seed(4)) * torch.linspace(0, 100, 37)[:, None]
    _, ref_scale = quantize(x, ACTIVATION_BLOCK)
    _, scale = quantize_activations(x, backend="triton")
    assert torch.equal(scale, ref_scale) and torch.all(scale[0] == 1)
    _, scale = quantize_activations(x, total=torch.tensor([20], dtype=torch.int32), backend="triton")
    assert torch.equal(scale[:20], ref_scale[:20])


@interpreted
@pytest.mark.parametrize("block", [BLOCK_16, PER_CHANNEL], ids=["b16", "channel"])
def test_out_of_range_slots_contribute_zero(block):
    num_slots = 4
    q13, q2, scales = make_fp8_banks(num_slots, 48, 24, block)
    gen = torch.Generator().manual_seed(3)
    weights, slots = make_routing(gen, 5, 3, num_slots)
    hidden = torch.randn(5, 48, generator=gen)
    bad = torch.tensor([[True, False, False], [False, True, False], [False] * 3, [True] * 3, [False, False, True]])
    slots_bad = slots.masked_scatter(bad, torch.tensor([-1, num_slots, num_slots + 7, -5, 2**40, 1 << 33]))
    out = grouped_swiglu(hidden, weights, slots_bad, q13, q2, scales=scales, backend="triton")
    ref = grouped_swiglu_eager(hidden, weights.masked_fill(bad, 0.0), slots.masked_fill(bad, 0), q13, q2, scales)
    assert rel_err(out, ref) < 1e-4
    assert torch.all(out[3] == 0)


# ==== host checks ====

def test_activation_quantization_refuses_odd_groups():
    from moe_offload.kernels.quant_fp8 import quantize_activations

    with pytest.raises(ValueError, match="power-of-two group"):
        quantize_activations(torch.randn(4, 64), group=48)
    with pytest.raises(ValueError, match="unit column stride"):
        quantize_activations(torch.randn(64, 4).t())
    with pytest.raises(ValueError, match="needs fp8 experts"):
        grouped_swiglu(torch.randn(2, 8), torch.rand(2, 1), torch.zeros(2, 1, dtype=torch.long),
                       torch.randn(1, 8, 8), torch.randn(1, 8, 4), fp8_activations=True)


def test_prefill_sized_16bit_batches_multiply_fp8_activations():
    """By default a batch of ``FP8_ACTIVATION_TOKENS`` or more 16-bit tokens over fp8 experts takes
    the fp8 x fp8 path (the twin rounds its activations through fp8 as the kernel does); smaller
    batches, fp32 activations and scale blocks that split an activation group stay weight-only."""
    from moe_offload.grouped import FP8_ACTIVATION_TOKENS, fp8_activations_for

    _, _, scales = make_fp8_banks(3, 128, 64, BLOCK_128)
    big, small = torch.randn(FP8_ACTIVATION_TOKENS, 128), torch.randn(FP8_ACTIVATION_TOKENS - 1, 128)
    assert fp8_activations_for(big.bfloat16(), scales) and fp8_activations_for(big.half(), scales)
    assert not fp8_activations_for(small.bfloat16(), scales) and not fp8_activations_for(big, scales)
    assert fp8_activations_for(big.bfloat16(), scales._replace(block=PER_CHANNEL))
    assert not fp8_activations_for(big.bfloat16(), scales._replace(block=BLOCK_16))
    assert not fp8_activations_for(big.bfloat16(), None)
    q13, q2, scales = make_fp8_banks(3, 128, 64, BLOCK_128)
    weights, slots = make_routing(torch.Generator().manual_seed(1), FP8_ACTIVATION_TOKENS, 2, 3)
    hidden = big.bfloat16()
    out = grouped_swiglu(hidden, weights, slots, q13, q2, scales=scales, backend="eager")
    assert torch.equal(out, grouped_swiglu_eager(hidden, weights, slots, q13, q2, scales, fp8_activations=True))
    assert not torch.equal(out, grouped_swiglu_eager(hidden, weights, slots, q13, q2, scales))


def test_block_k_must_divide_the_scale_columns():
    grouped_gemm_fp8 = kernels()
    config = grouped_gemm_fp8.BlockConfig(16, 64, 128, 1, 4, 3)
    assert grouped_gemm_fp8.fit_block_k(config, BLOCK_128) == config
    assert grouped_gemm_fp8.fit_block_k(config, PER_CHANNEL) == config
    assert grouped_gemm_fp8.fit_block_k(config, ScaleBlock(64, 64)).block_k == 64
    assert grouped_gemm_fp8.fit_block_k(config, ScaleBlock(1, 48)).block_k == 16
    q13, q2, scales = make_fp8_banks(3, 64, 32, ScaleBlock(16, 48))
    hidden, weights, slots = torch.randn(2, 64), torch.rand(2, 1), torch.zeros(2, 1, dtype=torch.long)
    with pytest.raises(ValueError, match="BLOCK_K 32 must divide"):
        grouped_gemm_fp8.fused_grouped_swiglu_fp8(hidden, weights, slots, q13, q2, scales, config._replace(block_k=32))
    with pytest.raises(ValueError, match="below tl.dot"):
        grouped_gemm_fp8.check_config(config._replace(block_n=16), BLOCK_128)
    with pytest.raises(ValueError, match="below tl.dot"):
        grouped_gemm_fp8.check_config(grouped_gemm_fp8.fit_block_k(config, ScaleBlock(8, 8)), ScaleBlock(8, 8))


@pytest.mark.parametrize("bad", ["scale_shape", "scale_dtype", "scale_device", "no_scales", "bf16_with_scales"])
def test_inconsistent_fp8_arguments_raise(bad):
    q13, q2, scales = make_fp8_banks(4, 64, 32, BLOCK_16)
    hidden, weights, slots = torch.randn(3, 64), torch.rand(3, 2), torch.randint(0, 4, (3, 2))
    if bad == "scale_shape":
        scales = scales._replace(w2=scales.w2[:, :-1])
    elif bad == "scale_dtype":
        scales = scales._replace(w13=scales.w13.double())
    elif bad == "scale_device":
        scales = ExpertScales(scales.w13.to("meta"), scales.w2.to("meta"), scales.block)
    elif bad == "no_scales":
        scales = None
    else:
        q13, q2 = q13.bfloat16(), q2.bfloat16()
    with pytest.raises(ValueError):
        grouped_swiglu(hidden, weights, slots, q13, q2, scales=scales)


# ==== GPU ====

GPU_SHAPES = [  # (slots, hidden, inter)
    (128, 2048, 768),  # qwen3-30b geometry
    (40, 1000, 333),  # not multiples of 128 (nor of 16)
    (512, 384, 200),  # many cache slots, few used
]
DECODE_AND_PREFILL = [1, 2, 3, 5, 8, 64, 700, 2048]
# the weight-only parity on the GPU is in test_grouped_gemm_fp8_gpu.py: the GPU suite's --dist loadfile
# gives a file to one worker, and together they were its longest file (352 s on the H200)


@pytest.mark.cuda
@pytest.mark.parametrize("block", [BLOCK_128, PER_CHANNEL], ids=["b128", "channel"])
@pytest.mark.parametrize("shape", GPU_SHAPES, ids=lambda s: "N{}H{}I{}".format(*s))
def test_cuda_fp8_activations_parity_sync_free(shape, block):
    """The fp8 x fp8 variant: 3 shapes x 20 trials, bf16 activations quantized per token-group."""
    banks = make_fp8_banks(*shape, block, "cuda")
    check_trials(banks, torch.bfloat16, len(DECODE_AND_PREFILL), DECODE_AND_PREFILL, seed=99, fp8_acts=True)
    check_trials(banks, torch.bfloat16, 20, DECODE_AND_PREFILL, sync_free=True, fp8_acts=True)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("rows,cols", [(1, 2048), (37, 333), (700, 768)])
def test_cuda_quantize_activations_matches_its_twin(rows, cols, dtype):
    from moe_offload.kernels.quant_fp8 import quantize_activations

    x = (torch.randn(rows, cols, device="cuda") * torch.rand(rows, 1, device="cuda") * 100).to(dtype)
    x[rows // 2] = 0  # an all-zero token gets scale 1
    q, scale = quantize_activations(x)
    ref_q, ref_scale = quantize(x, ACTIVATION_BLOCK)
    assert torch.equal(q.view(torch.uint8), ref_q.view(torch.uint8)) and torch.equal(scale, ref_scale)
    total = torch.tensor([rows // 2 + 1], dtype=torch.int32, device="cuda")
    q, scale = quantize_activations(x, total=total)
    assert torch.equal(q[: rows // 2 + 1].view(torch.uint8), ref_q[: rows // 2 + 1].view(torch.uint8))


@pytest.mark.cuda
@pytest.mark.parametrize("tiles", [(16, 64, 64, 1, 4, 3), (32, 128, 128, 8, 4, 4), (64, 256, 64, 8, 8, 3),
                                   (128, 128, 128, 8, 8, 3), (16, 256, 128, 1, 8, 4)], ids=str)
def test_cuda_explicit_tiles(tiles):
    """The tiles the benchmark sweeps compute the same thing."""
    config = kernels().BlockConfig(*tiles)
    for block in (BLOCK_128, PER_CHANNEL):
        banks = make_fp8_banks(64, 1000, 333, block, "cuda")
        check_trials(banks, torch.bfloat16, 4, [1, 8, 300, 1024], config)
        check_trials(banks, torch.bfloat16, 4, [1, 8, 300, 1024], config, fp8_acts=True)


@pytest.mark.cuda
def test_cuda_out_of_range_slots_contribute_zero():
    q13, q2, scales = make_fp8_banks(16, 384, 200, BLOCK_128, "cuda")
    gen = torch.Generator().manual_seed(5)
    weights, slots = make_routing(gen, 8, 4, 16, "cuda")
    hidden = torch.randn(8, 384, device="cuda").bfloat16()
    bad = torch.rand(8, 4, generator=gen).cuda() < 0.3
    out = grouped_swiglu(hidden, weights, slots.masked_fill(bad, -1).masked_fill(bad.roll(1, 0), 16), q13, q2,
                         scales=scales)
    bad = bad | bad.roll(1, 0)
    ref = grouped_swiglu_eager(hidden, weights.masked_fill(bad, 0.0), slots.masked_fill(bad, 0), q13, q2, scales)
    assert rel_err(out, ref) < 2e-2


@pytest.mark.cuda
@pytest.mark.parametrize("num_tokens", [1, 64])
def test_cuda_graph_replay_with_new_routing(num_tokens, capture_graph):
    q13, q2, scales = make_fp8_banks(64, 512, 256, BLOCK_128, "cuda")
    gen = torch.Generator().manual_seed(0)
    weights, slots = make_routing(gen, num_tokens, 8, 64, "cuda")
    hidden = torch.randn(num_tokens, 512, device="cuda").bfloat16()
    graph, out = capture_graph(lambda: grouped_swiglu(hidden, weights, slots, q13, q2, scales=scales))
    for _ in range(4):
        new_weights, new_slots = make_routing(gen, num_tokens, 8, 64, "cuda")
        hidden.copy_(torch.randn_like(hidden))
        weights.copy_(new_weights)
        slots.copy_(new_slots)
        graph.replay()
        # the twin takes the batch's own choice: 64 bf16 tokens quantize their activations too
        acts = fp8_activations_for(hidden, scales)
        tolerance = (FP8_ACTS_TOLERANCE if acts else TOLERANCE)[torch.bfloat16]
        assert rel_err(out, grouped_swiglu_eager(hidden, weights, slots, q13, q2, scales, acts)) < tolerance
