"""Fused RMS-norm kernels vs their reference twins (GPU)."""

from __future__ import annotations

import pytest
import torch

from kdaserve.kernels import reference as ref

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.mark.parametrize("n,d", [(1, 2304), (37, 2304), (5, 512)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_add_rms_norm(n, d, dtype):
    from kdaserve.kernels.norm.rms_norm import add_rms_norm

    x = torch.randn(n, d, device="cuda", dtype=dtype)
    r = torch.randn(n, d, device="cuda", dtype=dtype)
    w = torch.rand(d, device="cuda", dtype=dtype) + 0.5
    tol = 1e-2 if dtype == torch.bfloat16 else 1e-5
    out, s = add_rms_norm(x, w, 1e-5, r)
    ref_out, ref_s = ref.add_rms_norm(x, w, 1e-5, r)
    assert rel(s, ref_s) <= tol and rel(out, ref_out) <= tol
    out, s = add_rms_norm(x, w, 1e-5)
    assert s is x and rel(out, ref.rms_norm(x, w, 1e-5)) <= tol
    out32 = torch.full((n, d), float("nan"), device="cuda")           # the router's fp32 input
    out, s = add_rms_norm(x, w, 1e-5, r, out32=out32)
    assert torch.equal(out32, out.float())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rms_norm_gated(dtype):
    from kdaserve.kernels.norm.rms_norm import rms_norm_gated

    x = torch.randn(64, 128, device="cuda", dtype=dtype)
    g = torch.randn(64, 3, 128, device="cuda", dtype=dtype)[:, 1]     # strided rows
    w = torch.rand(128, device="cuda") + 0.5
    tol = 1e-2 if dtype == torch.bfloat16 else 1e-5
    assert rel(rms_norm_gated(x, g, w, 1e-5), ref.rms_norm_gated(x, g, w, 1e-5)) <= tol
