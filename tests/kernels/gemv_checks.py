"""Correctness checks of the decode GEMV (run on CUDA, or on CPU under TRITON_INTERPRET=1).

Run as a script (by test_gemv.py, with TRITON_INTERPRET=1) for the fp32 interpreter subset;
the GPU tests import check_gemv directly.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from kernel_checks import patch_triton_interpreter, rel_err  # noqa: E402


def _rand(shape, dtype, device, g, scale=1.0, row_pad=0):
    """Random [R, C] tensor; with row_pad > 0 a row-strided view (C + row_pad per row)."""
    rows, cols = shape
    t = torch.randn(rows, cols + row_pad, generator=g, device=device) * scale
    return t.to(dtype)[:, row_pad // 2: row_pad // 2 + cols]


def check_gemv(device, M, N, K, x_dtype, w_dtype, out_dtype=None, strided_out=False,
               strided_in=False, config=None, bound=None, seed=0):
    """gemv vs gemv_reference computed from fp64 copies of the inputs (immune to a global TF32
    switch); relative error <= bound (1e-5 for fp32 output, 1e-2 otherwise)."""
    from kdaserve.kernels.linear.gemv import gemv, gemv_reference

    g = torch.Generator(device=device).manual_seed(seed)
    pad = 5 if strided_in else 0
    x = _rand((M, K), x_dtype, device, g, row_pad=pad)                   # [M, K]
    w = _rand((N, K), w_dtype, device, g, scale=K ** -0.5, row_pad=pad)  # [N, K]
    dtype = out_dtype or x_dtype
    out = None
    if strided_out:
        full = torch.full((M, N + 7), float("nan"), dtype=dtype, device=device)
        out = full[:, 3:3 + N]                                           # [M, N], row stride N + 7
    y = gemv(x, w, out=out, out_dtype=out_dtype, config=config)
    if strided_out:
        assert y.data_ptr() == out.data_ptr(), "gemv did not write into out"
        assert full[:, :3].isnan().all() and full[:, 3 + N:].isnan().all(), "wrote outside out"
    ref = gemv_reference(x.double(), w.double(), dtype)   # fp64 math: no TF32 in the check
    name = f"gemv M={M} N={N} K={K} x={x_dtype} w={w_dtype} out={dtype} cfg={config}"
    assert y.shape == (M, N) and y.dtype == dtype, f"{name}: got {tuple(y.shape)} {y.dtype}"
    assert not torch.isnan(y).any(), f"{name}: NaN in output (unwritten columns?)"
    limit = bound if bound is not None else (1e-5 if dtype == torch.float32 else 1e-2)
    err = rel_err(y, ref)
    assert err <= limit, f"{name}: relative error {err:.3e} > {limit:.0e}"
    return y


def run_interpreter_suite() -> None:
    """fp32 (and fp16 x into fp32 out) through the CPU interpreter; masked and unmasked K."""
    from kdaserve.kernels.linear.gemv import GemvConfig

    patch_triton_interpreter()
    f32, f16 = torch.float32, torch.float16
    check_gemv("cpu", 1, 37, 100, f32, f32)                              # default: K masked
    check_gemv("cpu", 3, 37, 100, f32, f32, config=GemvConfig(16, 32, 4, 2))
    check_gemv("cpu", 4, 300, 64, f32, f32)                              # default: K even
    check_gemv("cpu", 4, 300, 64, f32, f32, config=GemvConfig(64, 16, 4, 3))  # N tail clamped
    check_gemv("cpu", 2, 37, 100, f32, f32, strided_out=True, strided_in=True,
               config=GemvConfig(8, 64, 2, 2))
    check_gemv("cpu", 4, 45, 48, f16, f32, out_dtype=f32, config=GemvConfig(16, 16, 2, 2))
    check_gemv("cpu", 1, 8, 1, f32, f32)                                 # K = 1


if __name__ == "__main__":
    run_interpreter_suite()
    print("gemv interpreter checks passed")
