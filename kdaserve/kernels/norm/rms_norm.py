"""Fused RMS norms: residual add + norm in one pass, and KDA's gated output norm.

Twins: `kdaserve.kernels.reference.add_rms_norm` and `rms_norm_gated`.
"""

from __future__ import annotations

import torch

from kdaserve.kernels.utils import (cdiv, check_kernel_device, next_power_of_2, pdl_options,
                                    require_triton)


def add_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
                 residual: torch.Tensor | None = None, out32: torch.Tensor | None = None,
                 pdl: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """x, residual: [N, D]. s = x + residual (rounded to x.dtype, or x alone); returns
    (weight * rmsnorm(s), s). With `out32` ([N, D] fp32) the kernel also writes the normed
    output there, widened exactly (`out.float()` without the extra launch).

    pdl: launch with programmatic dependent launch (sm_90+): the kernel loads `weight` (so the
    previous kernel must not write it), then waits for the previous kernel (griddepcontrol.wait)
    before it reads x / residual or writes, then lets the next PDL kernel start. Same results as
    pdl=False; ignored on CPU tensors (the Triton interpreter cannot run the PTX)."""
    require_triton()
    from kdaserve.kernels.norm.triton_norm import add_rms_norm_kernel

    if x.dim() != 2 or x.stride(1) != 1:
        raise ValueError(f"x must be [N, D] with a contiguous last dim, got {tuple(x.shape)}")
    if residual is not None and residual.shape != x.shape:
        raise ValueError(f"residual shape {tuple(residual.shape)} != x shape {tuple(x.shape)}")
    check_kernel_device(x)
    N, D = x.shape
    if out32 is not None and (out32.shape != x.shape or out32.dtype != torch.float32
                              or out32.stride(1) != 1 or out32.device != x.device):
        raise ValueError(f"out32 must be fp32 [N, D]={tuple(x.shape)} on {x.device} with a "
                         f"contiguous last dim, got {out32.dtype} {tuple(out32.shape)}")
    out = torch.empty_like(x)
    res_out = torch.empty_like(x) if residual is not None else x
    pdl_opts = pdl_options(pdl, x)
    if N:
        add_rms_norm_kernel[(N,)](
            x, residual if residual is not None else x, weight, out, res_out,
            out32 if out32 is not None else out, D, float(eps),
            x.stride(0), residual.stride(0) if residual is not None else 0, out.stride(0),
            res_out.stride(0), out32.stride(0) if out32 is not None else 0,
            HAS_RESIDUAL=residual is not None, OUT32=out32 is not None,
            BLOCK_D=next_power_of_2(D), num_warps=8 if D >= 2048 else 4,
            **pdl_opts)
    return out, res_out


def rms_norm_gated(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor,
                   eps: float, pdl: bool = False,
                   tiles: tuple[int, int] | None = None) -> torch.Tensor:
    """x, gate: [N, D] (any row strides); fp32 norm * weight * sigmoid(gate), in x.dtype.

    pdl: launch with programmatic dependent launch (sm_90+): the kernel loads `weight` (so the
    previous kernel must not write it), waits for the previous kernel (griddepcontrol.wait)
    before it reads x / gate or writes, then lets the next PDL kernel start. Same results as
    pdl=False; ignored on CPU tensors (the Triton interpreter cannot run the PTX). tiles: (rows
    per program, num_warps), default gated_norm_tiles."""
    require_triton()
    from kdaserve.kernels.norm.triton_norm import rms_norm_gated_kernel

    if x.dim() != 2 or gate.shape != x.shape or x.stride(1) != 1 or gate.stride(1) != 1:
        raise ValueError(f"x and gate must be [N, D] with contiguous last dims, got "
                         f"{tuple(x.shape)} / {tuple(gate.shape)}")
    check_kernel_device(x)
    N, D = x.shape
    out = torch.empty(N, D, dtype=x.dtype, device=x.device)
    pdl_opts = pdl_options(pdl, x)
    if N:
        block_n, block_d, warps = gated_norm_tiles(N, D)
        if tiles is not None:
            block_n, warps = tiles
        rms_norm_gated_kernel[(cdiv(N, block_n),)](
            x, gate, weight, out, N, D, float(eps), x.stride(0), gate.stride(0), out.stride(0),
            BLOCK_N=block_n, BLOCK_D=block_d, num_warps=warps, **pdl_opts)
    return out


def gated_norm_tiles(N: int, D: int) -> tuple[int, int, int]:
    """(rows per program, BLOCK_D, warps) of rms_norm_gated. KDA's output norm runs over
    N = tokens x heads rows of one head dim (128): a prefill of 8000 tokens has 256000 of them,
    too many one-row programs to schedule. Two tile classes, so that a step's token count
    cannot produce a kernel variant the start-up warm-up did not compile: one row a program
    below 8192 rows (a row per warp-sized program keeps small steps parallel), else as many
    rows as make 4096 elements a program, with 8 warps."""
    block_d = next_power_of_2(D)
    if N < 8192 or block_d >= 4096:
        return 1, block_d, 1 if block_d <= 256 else 4
    block_n = 4096 // block_d
    return block_n, block_d, 8
