"""Projection dispatch: decode-size rows to the Triton GEMV (1-2 rows) and the skinny GEMM
(3-64 rows) under their backends, everything else to F.linear."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kdaserve.kernels.linear.skinny import DTYPES as SKINNY_DTYPES
from kdaserve.kernels.linear.skinny import MAX_M as SKINNY_MAX_M

GEMV_MAX_ROWS = 2
"""Rows up to which the gemv backend routes projections to the Triton GEMV (the kernel takes
1..4); at 4 rows it lost to cuBLAS (benchmarks/PERF_NOTES.md), and from 3 rows the skinny GEMM
takes them under its backend."""


def use_gemv(x: torch.Tensor, enabled: bool) -> bool:
    return enabled and x.is_cuda and 1 <= x.shape[0] <= GEMV_MAX_ROWS and x.stride(-1) == 1


def use_skinny(x: torch.Tensor, weight: torch.Tensor, enabled: bool) -> bool:
    """The skinny GEMM takes the input: enabled, CUDA, GEMV_MAX_ROWS < rows <= its MAX_M, x
    and weight of one 16-bit dtype, contiguous last dims."""
    return (enabled and x.is_cuda and GEMV_MAX_ROWS < x.shape[0] <= SKINNY_MAX_M
            and x.dtype == weight.dtype and x.dtype in SKINNY_DTYPES and x.stride(-1) == 1
            and weight.stride(-1) == 1)


def linear(x: torch.Tensor, weight: torch.Tensor, gemv: bool = False,
           out_dtype: torch.dtype | None = None, pdl: bool = False,
           skinny: bool = False) -> torch.Tensor:
    """x: [T, K] @ weight [N, K].T -> [T, N] in out_dtype (default x.dtype), fp32 accumulation.

    With `gemv` set, CUDA inputs of 1..GEMV_MAX_ROWS rows go through kernels/linear/gemv.py
    (which reads a weight of another dtype directly, e.g. the router's fp32 weight with bf16 x);
    with `skinny` set, those of GEMV_MAX_ROWS + 1..64 rows through kernels/linear/skinny.py
    (use_skinny); everything else is F.linear on x cast to the weight's dtype. pdl: the Triton
    kernels launch with programmatic dependent launch."""
    if use_gemv(x, gemv):
        from kdaserve.kernels.linear.gemv import gemv as triton_gemv

        return triton_gemv(x, weight, out_dtype=out_dtype or x.dtype, pdl=pdl)
    if use_skinny(x, weight, skinny):
        from kdaserve.kernels.linear.skinny import skinny_gemm

        return skinny_gemm(x, weight, out_dtype=out_dtype or x.dtype, pdl=pdl)
    y = F.linear(x.to(weight.dtype), weight)
    return y if out_dtype is None or y.dtype == out_dtype else y.to(out_dtype)
