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
