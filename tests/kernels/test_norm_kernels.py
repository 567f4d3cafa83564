"""Fused RMS-norm kernels vs their reference twins (GPU), and add_rms_norm's pdl path
(programmatic dependent launch): its sm_90 PTX order (compiled on the CPU) and bit-equality
with pdl=False on the GPU."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import gemv_checks as gc
from kdaserve.kernels import reference as ref



def gpu(test):
    """Mark a test gpu and skip it without CUDA."""
    skip = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
    return pytest.mark.gpu(skip(test))


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def _norm_ptx(use_pdl, has_residual):
    triton = pytest.importorskip("triton")
    if not (Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas").exists():
        pytest.skip("triton's bundled ptxas is missing")
    from kdaserve.kernels.norm.triton_norm import add_rms_norm_kernel

    types = dict(x_ptr="*bf16", res_ptr="*bf16", w_ptr="*bf16", out_ptr="*bf16",
                 res_out_ptr="*bf16", out32_ptr="*fp32", D="i32", eps="fp32", stride_x="i32",
                 stride_res="i32", stride_out="i32", stride_res_out="i32", stride_out32="i32")
    consts = dict(HAS_RESIDUAL=has_residual, OUT32=False, BLOCK_D=4096, USE_PDL=use_pdl)
    k = gc.sm90_compile(add_rms_norm_kernel, types, consts, num_warps=8, launch_pdl=use_pdl)
    assert bool(k.metadata.launch_pdl) == use_pdl
    return k.asm["ptx"]


@pytest.mark.parametrize("has_residual", [True, False])
def test_add_rms_norm_pdl_sm90_ptx_order(has_residual):
    """Only loads (the norm weight's: as many as the whole pdl=False kernel minus its x and
    residual loads) before griddepcontrol.wait; launch_dependents right after; every store
    after. D=2304 in 4096 lanes of 8 warps: 2 vector loads of each of w, x (and residual)."""
    before, after = gc.split_at_wait(_norm_ptx(True, has_residual))
    assert before and all(op.startswith("ld.global") for op in before), before
    assert after[0].startswith("griddepcontrol.launch_dependents"), after[:2]
    plain = gc.memory_ops(_norm_ptx(False, has_residual))
    plain_loads = [op for op in plain if op.startswith("ld.global")]
    inputs = 2 if has_residual else 1                                  # x (+ residual)
    assert len(before) * (inputs + 1) == len(plain_loads), (before, plain_loads)
    loads_after = [op for op in after if op.startswith("ld.global")]
    assert len(before) + len(loads_after) == len(plain_loads), "weight loaded twice?"
    assert any(op.startswith("st.global") for op in after)


@pytest.mark.parametrize("n,d", [(1, 2304), (37, 2304), (5, 512)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@gpu
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


@pytest.mark.parametrize("n,d", [(1, 2304), (2, 2304), (37, 2304), (5, 512)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@gpu
def test_add_rms_norm_pdl_gpu(n, d, dtype):
    """pdl=True equals pdl=False bit for bit (with and without residual, with out32)."""
    from kdaserve.kernels.norm.rms_norm import add_rms_norm

    x = torch.randn(n, d, device="cuda", dtype=dtype)
    r = torch.randn(n, d, device="cuda", dtype=dtype)
    w = torch.rand(d, device="cuda", dtype=dtype) + 0.5
    for residual in (r, None):
        want = add_rms_norm(x, w, 1e-5, residual)
        got = add_rms_norm(x, w, 1e-5, residual, pdl=True)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), residual is None
    out32 = torch.full((n, d), float("nan"), device="cuda")
    out, _ = add_rms_norm(x, w, 1e-5, r, out32=out32, pdl=True)
    assert torch.equal(out, add_rms_norm(x, w, 1e-5, r)[0]) and torch.equal(out32, out.float())


@pytest.mark.parametrize("n", [64, 20001])   # one row a program; 32 rows, the last partial
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@gpu
def test_rms_norm_gated(dtype, n):
    from kdaserve.kernels.norm.rms_norm import rms_norm_gated

    x = torch.randn(n, 128, device="cuda", dtype=dtype)
    g = torch.randn(n, 3, 128, device="cuda", dtype=dtype)[:, 1]      # strided rows
    w = torch.rand(128, device="cuda") + 0.5
    tol = 1e-2 if dtype == torch.bfloat16 else 1e-5
    assert rel(rms_norm_gated(x, g, w, 1e-5), ref.rms_norm_gated(x, g, w, 1e-5)) <= tol
