"""The fp8 weight format: quantize / dequantize round trips for both checkpoint layouts."""
import pytest
import torch

from moe_offload.fp8 import BLOCK_128, FP8_DTYPE, PER_CHANNEL, ScaleBlock, dequantize, expand_scale, quantize


@pytest.mark.parametrize("block", [BLOCK_128, PER_CHANNEL, ScaleBlock(16, 32)])
@pytest.mark.parametrize("shape", [(200, 130), (2, 3, 128, 256), (1, 1)])
def test_quantize_round_trip_is_within_fp8_precision(block, shape):
    w = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    q, scale = quantize(w, block)
    assert q.dtype == FP8_DTYPE and q.shape == w.shape and scale.dtype == torch.float32
    assert scale.shape[-2:] == block.scale_shape(*shape[-2:])
    err = (dequantize(q, scale, block) - w).abs()
    # e4m3 rounds to 3 mantissa bits (half an ulp: 2^-4 relative), subnormals to steps of 2^-9 x scale
    bound = w.abs() * 2 ** -4 + expand_scale(scale, block, *shape[-2:]) * 2 ** -9
    assert (err <= bound * 1.0001).all()


def test_each_block_uses_its_own_amax():
    w = torch.ones(256, 256)
    w[:128, :128] *= 100.0
    w[200, 3] = 0.0
    q, scale = quantize(w, BLOCK_128)
    assert torch.allclose(scale, torch.tensor([[100.0, 1.0], [1.0, 1.0]]) / 448)
    assert torch.equal(dequantize(q, scale, BLOCK_128), w)


def test_zero_block_gets_unit_scale():
    _, scale = quantize(torch.zeros(4, 8), PER_CHANNEL)
    assert torch.equal(scale, torch.ones(4, 1))


def test_mismatched_scale_is_refused():
    q, scale = quantize(torch.randn(256, 256), BLOCK_128)
    with pytest.raises(ValueError, match="does not fit"):
        dequantize(q, scale[:1], BLOCK_128)


def test_w13_halves_keep_their_own_grids_when_inter_is_not_a_block_multiple():
    from moe_offload.fp8 import dequantize_w13, quantize_w13, w13_scale_shape

    w13 = torch.randn(2, 2 * 96, 200, generator=torch.Generator().manual_seed(1))
    w13[:, 96:] *= 50.0  # the up half alone sets its blocks' amax
    q, scale = quantize_w13(w13, BLOCK_128)
    assert scale.shape == (2, *w13_scale_shape(BLOCK_128, 96, 200)) == (2, 2, 2)
    gate_q, gate_s = quantize(w13[:, :96], BLOCK_128)
    assert torch.equal(scale[:, :1], gate_s) and torch.equal(q[:, :96].float(), gate_q.float())
    back = dequantize_w13(q, scale, BLOCK_128)
    assert ((back - w13).abs() <= w13.abs() / 16 + 50 * 2 ** -9 * 4).all()


def test_eager_grouped_swiglu_on_fp8_experts_equals_dequantized_bf16_run():
    from moe_offload.fp8 import dequantize_w13, quantize_w13
    from moe_offload.grouped import ExpertScales, grouped_swiglu

    gen = torch.Generator().manual_seed(2)
    n, inter, dim, tokens = 4, 96, 160, 7
    w13, w2 = torch.randn(n, 2 * inter, dim, generator=gen), torch.randn(n, dim, inter, generator=gen)
    q13, s13 = quantize_w13(w13, BLOCK_128)
    q2, s2 = quantize(w2, BLOCK_128)
    hidden = torch.randn(tokens, dim, generator=gen)
    weights = torch.rand(tokens, 2, generator=gen)
    slots = torch.randint(0, n, (tokens, 2), generator=gen)
    got = grouped_swiglu(hidden, weights, slots, q13, q2, scales=ExpertScales(s13, s2, BLOCK_128))
    ref = grouped_swiglu(hidden, weights, slots, dequantize_w13(q13, s13, BLOCK_128), dequantize(q2, s2, BLOCK_128))
    torch.testing.assert_close(got, ref)
    with pytest.raises(ValueError, match="float8"):
        grouped_swiglu(hidden, weights, slots, q13, q2)


def test_expert_dtype_resolution():
    from moe_offload.formats import ExpertFormat, resolve_expert_format

    bf16, fp8_ch = ExpertFormat(torch.bfloat16), ExpertFormat(FP8_DTYPE, PER_CHANNEL)
    assert resolve_expert_format("auto", bf16, torch.float32) == ExpertFormat(torch.float32)
    assert resolve_expert_format("auto", fp8_ch, torch.bfloat16) == fp8_ch
    assert resolve_expert_format("fp8", bf16, torch.bfloat16) == ExpertFormat(FP8_DTYPE, BLOCK_128)
    assert resolve_expert_format("fp8", fp8_ch, torch.bfloat16) == fp8_ch
    assert resolve_expert_format("bf16", fp8_ch, torch.bfloat16) == ExpertFormat(torch.bfloat16)
    assert [f.name for f in (bf16, fp8_ch, ExpertFormat(FP8_DTYPE, BLOCK_128))] == ["bf16", "fp8-ch", "fp8-b128x128"]
    with pytest.raises(ValueError, match="expert-dtype"):
        resolve_expert_format("int4", bf16, torch.bfloat16)
