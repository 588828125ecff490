"""4-bit (e2m1) expert weights: packing, and the NVFP4 and MXFP4 scalings with their inverses.

The bank layout every 4-bit path shares (the store, the cache, the W4A16 GEMMs and their twins), for
a weight ``[N, K]`` (output rows, input columns; ``w13`` is the gate's rows then the up's):

```
 packed         uint8          [..., N, K/2]    (n, 2j) in the low nibble of packed[n, j], (n, 2j+1) in the high
 NVFP4 scale    float8_e4m3fn  [..., N, K/16]   value = e2m1 * float(scale) * channel_scale[n]
 NVFP4 channel  float32        [..., N]         the tensor's global scale, one per output row
 MXFP4 scale    uint8 (e8m0)   [..., N, K/32]   value = e2m1 * 2^(scale - 127)
```

An e2m1 code is a sign (bit 3) and a magnitude index (bits 0-2) into ``E2M1_MAGNITUDES``. The
NVFP4 product is taken in that order in float32: ``e2m1 * scale`` is exact, so one rounding.
``channel_scale`` is per row so that ``w13``'s gate and up rows keep their own global scales.
K must be a multiple of the group (16 or 32), not of 128.
"""
from __future__ import annotations

import torch

NVFP4_GROUP = 16
MXFP4_GROUP = 32
E2M1_MAX = 6.0
E4M3_MAX = 448.0
E8M0_BIAS = 127
E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
# Midpoints between neighbouring magnitudes, and whether a tie there rounds up (to the even code).
_MIDPOINTS = ((0.25, False), (0.75, True), (1.25, False), (1.75, True), (2.5, False), (3.5, True), (5.0, False))


def e2m1_table(device: torch.device | str = "cpu") -> torch.Tensor:
    """The 16 code values as float32: ``table[code]``."""
    mags = torch.tensor(E2M1_MAGNITUDES, dtype=torch.float32, device=device)
    return torch.cat([mags, -mags])


def pack_e2m1(codes: torch.Tensor) -> torch.Tensor:
    """``codes uint8 [..., K]`` (values 0-15) -> ``uint8 [..., K/2]``, even index in the low nibble."""
    if codes.shape[-1] % 2:
        raise ValueError(f"cannot pack an odd number of e2m1 codes ({codes.shape[-1]})")
    codes = codes.to(torch.uint8)
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_e2m1(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of ``pack_e2m1``: ``uint8 [..., K/2]`` -> codes ``uint8 [..., K]``."""
    if packed.dtype != torch.uint8:
        raise ValueError(f"packed e2m1 must be uint8, not {packed.dtype}")
    return torch.stack([packed & 0x0F, packed >> 4], dim=-1).flatten(-2)


def e2m1_values(packed: torch.Tensor) -> torch.Tensor:
    """Packed codes -> their float32 values ``[..., K]``."""
    return e2m1_table(packed.device)[unpack_e2m1(packed).long()]


def encode_e2m1(x: torch.Tensor) -> torch.Tensor:
    """float ``x`` (already divided by its scale, |x| <= 6 after clamping) -> codes ``uint8``,
    rounded to the nearest magnitude, ties to the even code."""
    mag = x.abs().float().clamp(max=E2M1_MAX)
    index = torch.zeros(x.shape, dtype=torch.uint8, device=x.device)
    for mid, tie_up in _MIDPOINTS:
        index += (mag >= mid if tie_up else mag > mid).to(torch.uint8)
    sign = ((x < 0) & (index > 0)).to(torch.uint8) << 3
    return index | sign


def _grouped(x: torch.Tensor, group: int) -> torch.Tensor:
    if x.shape[-1] % group:
        raise ValueError(f"K = {x.shape[-1]} is not a multiple of the 4-bit group size {group}")
    return x.reshape(*x.shape[:-1], x.shape[-1] // group, group)


def _check(packed: torch.Tensor, scale: torch.Tensor, group: int, scale_dtype: torch.dtype) -> None:
    if packed.dtype != torch.uint8 or scale.dtype != scale_dtype:
        raise ValueError(f"4-bit banks must be uint8 and {scale_dtype}, not {packed.dtype} and {scale.dtype}")
    want = (*packed.shape[:-1], packed.shape[-1] * 2 // group)
    if tuple(scale.shape) != want:
        raise ValueError(f"scale {tuple(scale.shape)} does not fit packed {tuple(packed.shape)} "
                         f"with groups of {group} (want {want})")


def dequantize_nvfp4(packed: torch.Tensor, scale: torch.Tensor, channel_scale: torch.Tensor,
                     dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``packed [..., N, K/2]``, ``scale e4m3 [..., N, K/16]``, ``channel_scale f32 [..., N]``
    -> ``[..., N, K]`` in ``dtype``."""
    _check(packed, scale, NVFP4_GROUP, torch.float8_e4m3fn)
    if tuple(channel_scale.shape) != tuple(packed.shape[:-1]):
        raise ValueError(f"channel_scale {tuple(channel_scale.shape)} does not fit packed {tuple(packed.shape)}")
    values = _grouped(e2m1_values(packed), NVFP4_GROUP) * scale.float()[..., None]
    return (values.flatten(-2) * channel_scale.float()[..., None]).to(dtype)


def dequantize_mxfp4(packed: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``packed [..., N, K/2]``, ``scale uint8 e8m0 [..., N, K/32]`` -> ``[..., N, K]`` in ``dtype``."""
    _check(packed, scale, MXFP4_GROUP, torch.uint8)
    factor = torch.exp2(scale.float() - E8M0_BIAS)
    return (_grouped(e2m1_values(packed), MXFP4_GROUP) * factor[..., None]).flatten(-2).to(dtype)


def nvfp4_global_scale(w: torch.Tensor) -> torch.Tensor:
    """ModelOpt's per-tensor scale over the last two dims: ``amax / (6 * 448)`` (1 for all zeros)."""
    amax = w.float().abs().amax(dim=(-2, -1))
    return torch.where(amax > 0, amax / (E2M1_MAX * E4M3_MAX), torch.ones_like(amax))


def quantize_nvfp4(w: torch.Tensor, global_scale: torch.Tensor | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``w [..., N, K]`` -> ``(packed, scale e4m3, channel_scale f32 [..., N])``: one global scale
    per matrix (``nvfp4_global_scale`` unless given, shape ``[...]``), an e4m3 scale per 16 columns
    from each group's amax, values rounded to nearest e2m1."""
    w = w.float()
    g = nvfp4_global_scale(w) if global_scale is None else global_scale.float()
    groups = _grouped(w, NVFP4_GROUP)
    g_full = g[..., None, None]
    scale = (groups.abs().amax(dim=-1) / (E2M1_MAX * g_full)).clamp(max=E4M3_MAX).to(torch.float8_e4m3fn)
    denom = (scale.float() * g_full)[..., None]
    x = torch.where(denom > 0, groups / torch.where(denom > 0, denom, 1.0), 0.0)
    packed = pack_e2m1(encode_e2m1(x.flatten(-2)))
    channel = g[..., None].expand(*w.shape[:-1]).contiguous()
    return packed, scale, channel


def quantize_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``w [..., N, K]`` -> ``(packed, scale uint8 e8m0 [..., N, K/32])``. The exponent is the
    smallest that fits the group's amax in e2m1's range (``ceil(log2(amax / 6))``), so nothing
    clips; an all-zero group gets 2^0."""
    groups = _grouped(w.float(), MXFP4_GROUP)
    amax = groups.abs().amax(dim=-1) / E2M1_MAX
    mantissa, exponent = torch.frexp(amax)  # amax = mantissa * 2^exponent, mantissa in [0.5, 1)
    exp = torch.where(mantissa > 0.5, exponent, exponent - 1)
    exp = torch.where(amax > 0, exp, 0).clamp(-E8M0_BIAS, E8M0_BIAS)
    x = groups / torch.exp2(exp.float())[..., None]
    packed = pack_e2m1(encode_e2m1(x.flatten(-2)))
    return packed, (exp + E8M0_BIAS).to(torch.uint8)
