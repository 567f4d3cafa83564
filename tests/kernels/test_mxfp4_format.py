"""MXFP4 (kernels/mxfp4/format.py) against the OCP Microscaling v1.0 definitions: all 16 E2M1
codes, the whole E8M0 scale range, compressed-tensors' nibble order, and the quantiser's
rounding (nearest, ties to even), saturation and shared-exponent rule."""

from __future__ import annotations

import pytest
import torch

from kdaserve.kernels.mxfp4.format import (BLOCK, dequantize_mxfp4, e2m1_codes, pack_codes,
                                           packed_bytes, quantize_mxfp4, unpack_codes)


def e2m1_spec(code: int) -> float:
    """E2M1 from its bits: sign bit 3, exponent bits 2..1 (bias 1), mantissa bit 0;
    exponent 0 is subnormal (0.5 * M)."""
    sign = -1.0 if code & 8 else 1.0
    e, m = (code >> 1) & 3, code & 1
    return sign * (0.5 * m if e == 0 else 2.0 ** (e - 1) * (1 + m / 2))


def one_block(codes: list[int], scale: int, dtype=torch.float64) -> torch.Tensor:
    c = torch.tensor(codes + [0] * (BLOCK - len(codes)))[None]
    return dequantize_mxfp4(pack_codes(c), torch.tensor([[scale]], dtype=torch.uint8),
                            dtype)[0, :len(codes)]


def test_all_16_codes():
    got = one_block(list(range(16)), 127)
    want = torch.tensor([e2m1_spec(c) for c in range(16)], dtype=torch.float64)
    assert torch.equal(got, want)
    assert torch.signbit(got[8])                      # code 8 is -0
    assert got.abs().max() == 6.0


def test_whole_scale_range():
    for e in range(255):
        got = one_block([2, 7, 9], e)                 # 1.0, 6.0, -0.5
        s = 2.0 ** (e - 127)
        assert got.tolist() == [s, 6.0 * s, -0.5 * s], e
    assert torch.isnan(one_block([2], 255)).all()     # E8M0 0xFF is NaN
    # fp32 holds the smallest scale exactly (a subnormal)
    assert one_block([2], 0, torch.float32).item() == 2.0 ** -127


def test_nibble_order_and_layout():
    packed = torch.tensor([[0x72] + [0] * 15], dtype=torch.uint8)   # [1, 32 / 2]
    scale = torch.tensor([[128]], dtype=torch.uint8)                 # x2
    out = dequantize_mxfp4(packed, scale)
    assert out.shape == (1, 32)
    assert out[0, :2].tolist() == [2.0, 12.0]   # element 0 = low nibble (1.0), 1 = high (6.0)
    assert torch.equal(unpack_codes(pack_codes(torch.arange(16)[None])), torch.arange(16)[None])
    assert packed_bytes(4, 64) == 4 * 32 + 4 * 2


def test_scales_apply_per_block_of_32_with_expert_dims():
    codes = torch.full((2, 3, 64), 2)                                # all 1.0
    scale = torch.tensor([[[120, 130]] * 3] * 2, dtype=torch.uint8)   # [E, N, K/32]
    out = dequantize_mxfp4(pack_codes(codes), scale)
    assert out.shape == (2, 3, 64)
    assert (out[..., :32] == 2.0 ** -7).all() and (out[..., 32:] == 2.0 ** 3).all()


def test_rounding_to_nearest_ties_to_even_and_saturation():
    x = torch.tensor([0.2, 0.25, 0.3, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 5.1, 7.0, -0.25, -2.6])
    want = [0.0, 0.0, 0.5, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 6.0, 6.0, -0.0, -3.0]
    got = [e2m1_spec(int(c)) for c in e2m1_codes(x)]
    assert got == want


def test_quantize_ocp_exponent_and_exact_round_trip():
    torch.manual_seed(0)
    codes = torch.randint(0, 16, (4, 64))
    scale = torch.randint(100, 150, (4, 2), dtype=torch.uint8)
    codes[:, 0] = codes[:, 32] = 7                                  # each block holds a 6.0
    w = dequantize_mxfp4(pack_codes(codes), scale)
    packed, s = quantize_mxfp4(w)
    # amax = 6 * 2^x: floor(log2(amax)) - 2 = x, the scale it was made with
    assert torch.equal(s, scale)
    assert torch.equal(dequantize_mxfp4(packed, s), w)
    zero_p, zero_s = quantize_mxfp4(torch.zeros(1, 32))
    assert (zero_p == 0).all() and zero_s.item() == 127


def test_quantize_error_bound():
    torch.manual_seed(1)
    w = torch.randn(8, 256) * 0.01
    p, s = quantize_mxfp4(w)
    back = dequantize_mxfp4(p, s)
    unit = dequantize_mxfp4(torch.full_like(p, 0x22), s)            # 1.0 * scale per element
    # E2M1 spacing is at most 2 (4 -> 6): error <= 1 scale; a block max in (6, 8) scales
    # clips to 6: error < 2 scales
    assert ((back - w).abs() < 2 * unit).all()
    assert ((back - w).abs() <= unit).float().mean() > 0.99


@pytest.mark.parametrize("bad", ["dtype", "shape"])
def test_rejects_bad_tensors(bad):
    p = torch.zeros(2, 16, dtype=torch.uint8)
    s = torch.zeros(2, 1, dtype=torch.uint8)
    with pytest.raises(ValueError):
        if bad == "dtype":
            dequantize_mxfp4(p.float(), s)
        else:
            dequantize_mxfp4(p, torch.zeros(2, 2, dtype=torch.uint8))
    with pytest.raises(ValueError):
        quantize_mxfp4(torch.zeros(2, 48))
