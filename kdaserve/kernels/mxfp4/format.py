"""MXFP4 (OCP Microscaling v1.0, E2M1 elements with one E8M0 scale per 32) in the layout of
compressed-tensors' `mxfp4-pack-quantized`: for a weight [N, K] (nn.Linear layout, K the
reduction axis),

- `weight_packed` uint8 [N, K / 2]: two E2M1 codes per byte, element 2j in the low nibble and
  2j + 1 in the high nibble;
- `weight_scale` uint8 [N, K / 32]: the E8M0 exponent byte e of each block of 32 along K,
  scale 2^(e - 127); e = 255 is NaN.

value = E2M1(code) * 2^(e - 127), exactly (the spec's decoding; no rounding happens when the
result type can hold it). Leading dims (experts) pass through. This file is the format itself,
so it is its own reference: the CPU path dequantises with it and the kernels' twins build on it.
"""

from __future__ import annotations

import torch

BLOCK = 32
"""Elements per E8M0 scale (along K)."""
SCALE_BIAS = 127
SCALE_NAN = 255
E2M1_MAX = 6.0
E2M1_EMAX = 2
"""Exponent of E2M1's largest power of two (4 = 2^2): the OCP shared-exponent rule subtracts it."""

E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
               -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
"""Code -> value: sign bit 3, exponent bits 2..1 (bias 1), mantissa bit 0; E = 0 is
subnormal (0.5 * M). No Inf, no NaN."""

_BOUNDS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
"""Midpoints between consecutive E2M1 magnitudes (codes 0..7)."""


def packed_bytes(n: int, k: int) -> int:
    """Bytes of one [n, k] MXFP4 weight: values + scales (4.25 bits per element)."""
    return n * k // 2 + n * k // BLOCK


def unpack_codes(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [..., K / 2] -> int64 codes [..., K] (low nibble first)."""
    p = packed.to(torch.int64)
    return torch.stack([p & 0x0F, p >> 4], dim=-1).flatten(-2)


def pack_codes(codes: torch.Tensor) -> torch.Tensor:
    """Codes [..., K] (0..15, K even) -> uint8 [..., K / 2] (element 2j in the low nibble)."""
    c = codes.to(torch.uint8)
    return c[..., 0::2] | (c[..., 1::2] << 4)


def e8m0_to_float(scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """uint8 exponent bytes -> 2^(e - 127) in dtype (fp32 holds 2^-127 as a subnormal);
    255 -> NaN."""
    e = scale.to(torch.int32) - SCALE_BIAS
    out = torch.ldexp(torch.ones(scale.shape, dtype=dtype, device=scale.device), e)
    return out.masked_fill(scale == SCALE_NAN, float("nan"))


def dequantize_mxfp4(packed: torch.Tensor, scale: torch.Tensor,
                     dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """packed uint8 [..., N, K / 2], scale uint8 [..., N, K / 32] -> [..., N, K] in dtype.
    Computed in fp64 for dtype float64, else fp32, then cast (exact wherever dtype can hold
    the value)."""
    if packed.dtype != torch.uint8 or scale.dtype != torch.uint8:
        raise ValueError(f"MXFP4 tensors must be uint8, got {packed.dtype} and {scale.dtype}")
    k = packed.shape[-1] * 2
    if scale.shape[:-1] != packed.shape[:-1] or scale.shape[-1] * BLOCK != k:
        raise ValueError(f"scale {tuple(scale.shape)} does not match packed "
                         f"{tuple(packed.shape)} (one scale per {BLOCK} values)")
    work = torch.float64 if dtype == torch.float64 else torch.float32
    lut = torch.tensor(E2M1_VALUES, dtype=work, device=packed.device)
    values = lut[unpack_codes(packed)]                                    # [..., N, K]
    s = e8m0_to_float(scale, work).repeat_interleave(BLOCK, dim=-1)       # [..., N, K]
    return (values * s).to(dtype)


def e2m1_codes(x: torch.Tensor) -> torch.Tensor:
    """Round fp32 x (already divided by the block scale) to the nearest E2M1 value, ties to
    the even code, saturating at +-6. Returns int64 codes (sign bit for x < 0 or -0.0)."""
    mag = x.abs().clamp(max=E2M1_MAX)
    code = torch.zeros(x.shape, dtype=torch.int64, device=x.device)
    for i, b in enumerate(_BOUNDS):     # boundary between codes i and i + 1
        above = mag > b
        if (i + 1) % 2 == 0:            # a tie goes to the even code, here i + 1
            above = above | (mag == b)
        code += above.to(torch.int64)
    return code | (torch.signbit(x).to(torch.int64) << 3)


def quantize_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [..., N, K] (K a multiple of 32) -> (packed uint8 [..., N, K / 2], scale uint8
    [..., N, K / 32]) by the OCP rule: per block, shared exponent = floor(log2(amax)) - 2
    (E2M1's emax), clamped to the E8M0 range; elements w / 2^exp rounded to nearest even and
    saturated at +-6 (the block maximum may clip, as the spec allows). An all-zero block
    gets exponent 0 (byte 127)."""
    k = w.shape[-1]
    if k % BLOCK:
        raise ValueError(f"K={k} is not a multiple of {BLOCK}")
    blocks = w.float().reshape(*w.shape[:-1], k // BLOCK, BLOCK)          # [..., N, K/32, 32]
    amax = blocks.abs().amax(dim=-1)                                      # [..., N, K/32]
    exp = torch.where(amax > 0, torch.floor(torch.log2(amax)) - E2M1_EMAX,
                      torch.zeros_like(amax))
    exp = exp.clamp(-SCALE_BIAS, SCALE_BIAS).to(torch.int32)
    scaled = torch.ldexp(blocks, -exp[..., None])
    codes = e2m1_codes(scaled).reshape(w.shape)
    return pack_codes(codes), (exp + SCALE_BIAS).to(torch.uint8)
