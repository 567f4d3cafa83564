"""The router's tensor-core logits GEMM (kernels/moe/router.py router_logits) and its K-split
partial logits of few-row steps (router_partials) against their twin, an fp32 GEMM of the
widened bf16 input, on the GPU at the served models' shapes; their CPU checks run through the
interpreter (interp_extras.py)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kdaserve.kernels.moe.router import moe_topk_sigmoid, router_logits, router_partials


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("n,e,d", [(8000, 256, 2304), (65, 256, 2304), (144, 256, 2304),
                                   (1500, 256, 2304), (300, 384, 7168),
                                   (129, 40, 100)])
def test_router_logits_matches_fp32_gemm(n, e, d):
    g = torch.Generator(device="cuda").manual_seed(n)
    x = torch.randn(n, d, device="cuda", generator=g).bfloat16()
    w = torch.randn(e, d, device="cuda", generator=g) * d ** -0.5
    want = F.linear(x.double(), w.double())
    got = router_logits(x, w)
    err = (got.double() - want).abs().max().item()
    fp32_err = (F.linear(x.float(), w).double() - want).abs().max().item()   # cuBLAS fp32
    bf16_err = (F.linear(x, w.bfloat16()).double() - want).abs().max().item()
    assert err <= 4 * fp32_err + 1e-6, (err, fp32_err)
    assert err * 100 < bf16_err, (err, bf16_err)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("n,e,d", [(3, 256, 2304), (9, 256, 2304), (16, 256, 2304),
                                   (33, 256, 2304), (144, 256, 2304), (1023, 256, 2304),
                                   (16, 256, 2048), (17, 896, 7168), (9, 40, 100)])
def test_router_partials_match_fp32_gemm(n, e, d):
    """The partials summed in split order: as close to the exact product as cuBLAS's fp32 GEMM
    (up to 4x its error), far closer than a bf16 weight; the top-k over the partials is the
    top-k over that sum, bit for bit."""
    g = torch.Generator(device="cuda").manual_seed(n + e)
    x = torch.randn(n, d, device="cuda", generator=g).bfloat16()
    w = torch.randn(e, d, device="cuda", generator=g) * d ** -0.5
    want = F.linear(x.double(), w.double())
    part = router_partials(x, w)
    total = part[0].clone()
    for s in range(1, part.shape[0]):
        total += part[s]
    err = (total.double() - want).abs().max().item()
    fp32_err = (F.linear(x.float(), w).double() - want).abs().max().item()
    bf16_err = (F.linear(x, w.bfloat16()).double() - want).abs().max().item()
    assert err <= 4 * fp32_err + 1e-6, (err, fp32_err)
    assert err * 100 < bf16_err, (err, bf16_err)
    bias = torch.randn(e, device="cuda", generator=g) * 0.1
    got = moe_topk_sigmoid(part, bias, 8, True, 2.5, extra_expert=e)
    summed = moe_topk_sigmoid(total, bias, 8, True, 2.5, extra_expert=e)
    assert torch.equal(got[0], summed[0]) and torch.equal(got[1], summed[1])
