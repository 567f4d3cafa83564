"""The router's tensor-core logits GEMM (kernels/moe/router.py router_logits) against its twin,
an fp32 GEMM of the widened bf16 input, on the GPU at the served models' shapes; its CPU checks
run through the interpreter (interp_extras.py)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kdaserve.kernels.moe.router import router_logits


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
