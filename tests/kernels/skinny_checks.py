"""Correctness checks of the skinny GEMM (run on CUDA, or on CPU under TRITON_INTERPRET=1).

Run as a script (by test_skinny_gemm.py, with TRITON_INTERPRET=1) for the interpreter subset;
the GPU tests import check_skinny directly.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gemv_checks import _rand  # noqa: E402
from kernel_checks import patch_triton_interpreter, rel_err  # noqa: E402


def check_skinny(device, M, N, K, dtype=torch.bfloat16, out_dtype=None, strided_in=False,
                 strided_out=False, config=None, pdl=False, seed=0, bound=1e-2):
    """skinny_gemm vs gemv_reference from fp64 copies of the inputs: relative error <= bound;
    every column of a NaN-poisoned out written, nothing outside it."""
    from kdaserve.kernels.linear.gemv import gemv_reference
    from kdaserve.kernels.linear.skinny import skinny_gemm

    g = torch.Generator(device=device).manual_seed(seed)
    pad = 5 if strided_in else 0
    x = _rand((M, K), dtype, device, g, row_pad=pad)                     # [M, K]
    w = _rand((N, K), dtype, device, g, scale=K ** -0.5, row_pad=pad)    # [N, K]
    odt = out_dtype or dtype
    full = torch.full((M, N + 7), float("nan"), dtype=odt, device=device)
    out = full[:, 3:3 + N] if strided_out else None                      # [M, N]
    y = skinny_gemm(x, w, out=out, out_dtype=out_dtype, config=config, pdl=pdl)
    name = f"skinny M={M} N={N} K={K} {dtype} out={odt} cfg={config} pdl={pdl}"
    if strided_out:
        assert y.data_ptr() == out.data_ptr(), f"{name}: did not write into out"
        assert full[:, :3].isnan().all() and full[:, 3 + N:].isnan().all(), \
            f"{name}: wrote outside out"
    assert y.shape == (M, N) and y.dtype == odt, f"{name}: got {tuple(y.shape)} {y.dtype}"
    assert not torch.isnan(y).any(), f"{name}: NaN in output (unwritten columns?)"
    ref = gemv_reference(x.double(), w.double(), odt)
    err = rel_err(y, ref)
    assert err <= bound, f"{name}: relative error {err:.3e} > {bound:.0e}"
    return y


def main() -> None:
    patch_triton_interpreter()
    from kdaserve.kernels.linear.skinny import SkinnyConfig

    # every row bucket (16 / 32 / 64) at its ends, uneven K (the K mask), N not a multiple of
    # the tile (the clamped weight rows), strided rows in and out, fp32 out
    check_skinny("cpu", 3, 40, 100, strided_in=True)
    check_skinny("cpu", 9, 72, 256, config=SkinnyConfig(16, 64, 4, 2), strided_out=True)
    check_skinny("cpu", 16, 48, 300, config=SkinnyConfig(32, 128, 2, 3))
    check_skinny("cpu", 17, 33, 64, out_dtype=torch.float32, bound=1e-5)
    check_skinny("cpu", 33, 96, 160, config=SkinnyConfig(64, 32, 4, 4), strided_in=True)
    check_skinny("cpu", 64, 20, 96, dtype=torch.float16, strided_out=True)
    # the first weight tile read before the PDL wait (the interpreter keeps the order): the
    # same output bit for bit, even and uneven K, one K step and several
    for M, N, K, bk in ((5, 40, 256, 64), (20, 33, 100, 64), (9, 16, 64, 64)):
        base = check_skinny("cpu", M, N, K, config=SkinnyConfig(16, bk, 4, 2), seed=K)
        fast = check_skinny("cpu", M, N, K, config=SkinnyConfig(16, bk, 4, 2, prefetch=1),
                            pdl=True, seed=K)
        assert torch.equal(base, fast), f"prefetch changed the output at {(M, N, K)}"
    print("skinny checks passed")


if __name__ == "__main__":
    main()
