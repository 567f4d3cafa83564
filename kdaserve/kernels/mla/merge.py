"""Merge attention outputs over disjoint key sets by their log-sum-exp, on Triton.

Same contract as `kdaserve.kernels.reference.merge_attn_states`. Decode context parallelism
attends each query over every rank's shard of the latent KV and merges the ranks' partial outputs
with this kernel (attention/dcp.py). One launch; the grid depends only on shapes (CUDA-graph
safe). The partials may be strided views (the DCP exchange packs [out | lse] rows into one
buffer).
"""

from __future__ import annotations

import torch

from kdaserve.kernels.utils import cdiv, check_kernel_device, next_power_of_2, require_triton


def merge_attn_states(outs: torch.Tensor, lses: torch.Tensor, out: torch.Tensor | None = None,
                      return_lse: bool = True):
    """outs: [N, R, H, D] (contiguous last dim); lses: [N, R, H] natural-log lse (-inf = empty).

    Returns (out [R, H, D] in outs.dtype, or `out` when given; lse [R, H] fp32), or only out
    when return_lse is False.
    """
    require_triton()
    from kdaserve.kernels.mla.triton_merge import merge_attn_states_kernel

    if outs.dim() != 4 or lses.shape != outs.shape[:3] or outs.stride(-1) != 1:
        raise ValueError(f"outs must be [N, R, H, D] with a contiguous last dim and lses "
                         f"[N, R, H]; got {tuple(outs.shape)} and {tuple(lses.shape)}")
    N, R, H, D = outs.shape
    if N < 1:
        raise ValueError("merge_attn_states needs at least one partial")
    for t in (outs, lses):
        check_kernel_device(t)
    if out is None:
        out = torch.empty(R, H, D, dtype=outs.dtype, device=outs.device)
    elif out.shape != (R, H, D) or out.stride(-1) != 1:
        raise ValueError(f"out must be [R, H, D]={R, H, D} with a contiguous last dim, got "
                         f"{tuple(out.shape)}")
    lse = torch.empty(R, H, dtype=torch.float32, device=outs.device) if return_lse else None
    if R == 0 or H == 0:
        return (out, lse) if return_lse else out
    block_n = max(2, next_power_of_2(N))
    block_d = min(next_power_of_2(D), max(16, 4096 // block_n))
    lse_arg = lse if return_lse else out
    merge_attn_states_kernel[(R, H, cdiv(D, block_d))](
        outs, lses, out, lse_arg,
        outs.stride(0), outs.stride(1), outs.stride(2),
        lses.stride(0), lses.stride(1), lses.stride(2),
        out.stride(0), out.stride(1),
        lse_arg.stride(0),
        N, D,
        BLOCK_N=block_n, BLOCK_D=block_d, STORE_LSE=return_lse, num_warps=4,
    )
    return (out, lse) if return_lse else out
