"""The shared 4-bit pieces (``moe_offload/fp4.py``): packing, rounding and both scalings."""
from __future__ import annotations

import pytest
import torch

from moe_offload import fp4


def test_pack_puts_the_even_index_in_the_low_nibble():
    codes = torch.tensor([[1, 2, 15, 0]], dtype=torch.uint8)
    assert fp4.pack_e2m1(codes).tolist() == [[0x21, 0x0F]]
    rand = torch.randint(0, 16, (3, 7, 64), dtype=torch.uint8)
    assert torch.equal(fp4.unpack_e2m1(fp4.pack_e2m1(rand)), rand)


def test_rounding_is_to_nearest_with_ties_to_even_codes():
    x = torch.tensor([0.24, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 9.0, -0.3, -0.1])
    got = fp4.e2m1_table()[fp4.encode_e2m1(x).long()].tolist()
    assert got == [0.0, 0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 6.0, -0.5, 0.0]


@pytest.mark.parametrize("shape", [(40, 96), (2, 8, 48), (3, 6, 160)])
def test_nvfp4_round_trip_is_close_and_exact_on_its_own_grid(shape):
    torch.manual_seed(0)
    w = torch.randn(shape) * 0.05
    packed, scale, channel = fp4.quantize_nvfp4(w)
    assert packed.shape == (*shape[:-1], shape[-1] // 2) and scale.shape == (*shape[:-1], shape[-1] // 16)
    assert channel.shape == shape[:-1] and scale.dtype == torch.float8_e4m3fn
    back = fp4.dequantize_nvfp4(packed, scale, channel)
    assert (back - w).norm() / w.norm() < 0.12
    again = fp4.dequantize_nvfp4(*fp4.quantize_nvfp4(back, channel[..., 0]))
    assert torch.equal(again, back)


@pytest.mark.parametrize("shape", [(40, 96), (2, 8, 64), (3, 6, 160)])
def test_mxfp4_round_trip_never_clips_and_is_exact_on_its_own_grid(shape):
    torch.manual_seed(1)
    w = torch.randn(shape) * 0.05
    packed, scale = fp4.quantize_mxfp4(w)
    assert scale.shape == (*shape[:-1], shape[-1] // 32) and scale.dtype == torch.uint8
    back = fp4.dequantize_mxfp4(packed, scale)
    group_max = w.abs().reshape(*shape[:-1], -1, 32).amax(-1)
    assert (back.abs().reshape(*shape[:-1], -1, 32).amax(-1) >= group_max * 0.74).all()
    assert (back - w).norm() / w.norm() < 0.15
    assert torch.equal(fp4.dequantize_mxfp4(*fp4.quantize_mxfp4(back)), back)


def test_zeros_and_bad_shapes():
    zero = torch.zeros(4, 32)
    assert fp4.dequantize_nvfp4(*fp4.quantize_nvfp4(zero)).abs().max() == 0
    assert fp4.dequantize_mxfp4(*fp4.quantize_mxfp4(zero)).abs().max() == 0
    with pytest.raises(ValueError, match="multiple of the 4-bit group"):
        fp4.quantize_mxfp4(torch.zeros(4, 48))
    packed, scale = fp4.quantize_mxfp4(torch.ones(4, 64))
    with pytest.raises(ValueError, match="does not fit"):
        fp4.dequantize_mxfp4(packed, scale[:, :1])
