"""nvfp4 tiles decoded as bf16 pairs for a bf16 dot (``grouped_gemm_w4_tiles.pair_dequant_tile``,
on with ``SLUICE_W4_BF16_PAIRS=1``): the codes put under bf16's exponent (e2m1 * 2^-126), times
the group's scale * 2^117 in one packed multiply, the dot's sum taken back by 2^9.

The interpreter computes bfloat16 as raw uint16 bits, so on the CPU the decode's bits are checked
in the kernel and the multiply's exactness in torch (which keeps bf16 subnormals); the kernel's
products, and the grouped GEMM on pairs against the twin, on a GPU."""
from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():  # the interpreter is chosen when the kernel module is imported
    os.environ.setdefault("TRITON_INTERPRET", "1")

triton = pytest.importorskip("triton")
tl = triton.language

from moe_offload import fp4  # noqa: E402
from moe_offload.kernels import grouped_gemm_w4_tiles as tiles  # noqa: E402

from tests.fresh_process import run_fresh  # noqa: E402

interpreted = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs TRITON_INTERPRET=1")
ROWS, K = 16, 128


def every_e4m3_scale() -> torch.Tensor:
    """The 126 finite positive e4m3 values (subnormals from 2^-9 up to 448), as float32."""
    bits = torch.arange(1, 127, dtype=torch.uint8)  # 0x7F is NaN
    return bits.view(torch.float8_e4m3fn).float()


def random_tile(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``[ROWS, K/2]`` packed codes (row 0 every code in order) and their e4m3 group scales, the
    extremes among them."""
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (ROWS, K), generator=gen)
    codes[0, :16] = torch.arange(16)
    scales = every_e4m3_scale()[torch.randint(0, 126, (ROWS, K // 16), generator=gen)]
    scales[0, :2] = torch.tensor([448.0, 2.0 ** -9])
    return fp4.pack_e2m1(codes.to(torch.uint8)), scales.to(torch.float8_e4m3fn)


@triton.jit
def _decoded_bits(q_ptr, out_ptr, R: tl.constexpr, W: tl.constexpr):
    """``e2m1_words(BF16=True)`` of ``[R, W]`` words, stored as their int16 bits ``[R, 8W]``."""
    rows, words = tl.arange(0, R), tl.arange(0, W)
    q = tl.load(q_ptr + rows[:, None, None] * W + words[None, :, None] + tl.zeros((1, 1, 1), tl.int32))
    bits = tl.reshape(tiles.e2m1_words(q, False, True), (R, W * 8)).to(tl.int16, bitcast=True)
    tl.store(out_ptr + rows[:, None] * (W * 8) + tl.arange(0, W * 8)[None, :], bits)


@triton.jit
def _pair_tiles(q_ptr, s_ptr, out_ptr, R: tl.constexpr, K: tl.constexpr, BLOCK_K: tl.constexpr):
    """``pair_dequant_tile`` over every K step of ``R`` rows, stored as ``out [R, K]``."""
    rows = tl.arange(0, R)
    for k0 in tl.static_range(0, K, BLOCK_K):
        w = tiles.pair_dequant_tile(q_ptr, s_ptr, rows, rows < R, k0, K, K // 8, K // 16, R, BLOCK_K, 16, True)
        tl.store(out_ptr + rows[None, :] * K + k0 + tl.arange(0, BLOCK_K)[:, None], w)


@interpreted
def test_the_decode_puts_every_code_under_bf16s_exponent_interpreted():
    """Each code becomes the bf16 number e2m1 * 2^-126 bit for bit (+-0.5 the subnormal 2^-127,
    -0 kept), eight a word in k order."""
    packed, _ = random_tile(0)
    out = torch.empty(ROWS, K, dtype=torch.int16)
    _decoded_bits[(1,)](packed.view(torch.int32), out, R=ROWS, W=K // 8)
    want = (fp4.e2m1_values(packed).double() * 2.0 ** -126).to(torch.bfloat16).view(torch.int16)
    assert torch.equal(out, want)


def test_the_pair_multiplier_keeps_every_product_exact_finite_and_normal():
    """Every code times every e4m3 scale, as the kernel computes it (bf16 times bf16, rounded once):
    the weight times 2^-9 exactly, no multiplier infinite, no nonzero product subnormal."""
    codes = fp4.e2m1_table().double()
    raw = (codes * 2.0 ** -126).to(torch.bfloat16)
    multiplier = (every_e4m3_scale() * tiles.PAIR_SCALE.value).to(torch.bfloat16)
    assert torch.isfinite(multiplier).all() and torch.equal(multiplier.double(),
                                                            every_e4m3_scale().double() * tiles.PAIR_SCALE.value)
    products = raw[:, None] * multiplier[None, :]
    exact = codes[:, None] * every_e4m3_scale().double()[None, :] / tiles.PAIR_UNSCALE.value
    assert torch.equal(products.double(), exact)
    nonzero = products[products != 0].float().abs()
    assert nonzero.min() >= torch.finfo(torch.bfloat16).tiny


@pytest.mark.cuda
def test_cuda_pair_tiles_are_the_exact_weights_sync_free():
    """On the GPU (the packed multiply of subnormal codes included): every weight times 2^-9, bit for
    bit, for every code and the extreme scales, under sync-debug mode."""
    for seed in range(3):
        packed, scales = random_tile(seed)
        q, s = packed.view(torch.int32).cuda(), scales.cuda()
        out = torch.empty(ROWS, K, dtype=torch.bfloat16, device="cuda")
        _pair_tiles[(1,)](q, s, out, R=ROWS, K=K, BLOCK_K=64)  # compiled outside the debug mode
        torch.cuda.set_sync_debug_mode("error")
        try:
            _pair_tiles[(1,)](q, s, out, R=ROWS, K=K, BLOCK_K=64)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        want = fp4.dequantize_nvfp4(packed, scales, torch.ones(ROWS), dtype=torch.float64) / tiles.PAIR_UNSCALE.value
        assert torch.equal(out.cpu().double(), want), seed


@pytest.mark.cuda
def test_cuda_grouped_gemm_on_bf16_pairs_matches_the_twin(monkeypatch):
    """The public op in bf16 with the pairs on (a fresh process: the switch is read at import), every
    path's sizes, ragged and empty slots, biases and the clamped activation, as the format's GPU
    parity test."""
    monkeypatch.setenv("SLUICE_W4_BF16_PAIRS", "1")
    run_fresh("tests.test_w4_bf16_pairs:pairs_parity", timeout=600)


def pairs_parity() -> None:
    from tests.test_grouped_gemm_w4 import DECODE_TOKENS, GPU_SHAPES, PREFILL_TOKENS, check_trials, random_banks

    assert tiles.BF16_PAIRS.value
    for (num_slots, dim, inter, top_k), extras in GPU_SHAPES.values():
        banks = random_banks(num_slots, dim, inter, "nvfp4", "cuda", gain=3.0)
        cases = dict(token_counts=DECODE_TOKENS + PREFILL_TOKENS, top_ks=[top_k], dtypes=[torch.bfloat16],
                     device="cuda", gpt_oss_every=3, extras=extras)
        check_trials("public", banks, "nvfp4", trials=len(DECODE_TOKENS + PREFILL_TOKENS), seed=99, **cases)
        check_trials("public", banks, "nvfp4", trials=20, seed=7, sync_free=True, **cases)  # compiled by now
