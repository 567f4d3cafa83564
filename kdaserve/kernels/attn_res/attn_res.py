"""One AttnRes read (Kimi K3's softmax attention over depth) in one launch.

Twin: `kdaserve.kernels.reference.attn_res` (same arguments, same results within rounding).
"""

from __future__ import annotations

import torch

from kdaserve.kernels.utils import check_kernel_device, next_power_of_2, pdl_options, require_triton


def attn_res(prefix: torch.Tensor, delta: torch.Tensor | None, blocks: torch.Tensor,
             norm_weight: torch.Tensor, query: torch.Tensor,
             out_norm_weight: torch.Tensor | None, num_blocks: int, write_idx: int,
             eps: float, pdl: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """prefix: [T, D]; delta: [T, D] or None; blocks: [T, NB, D] (written in place at
    write_idx >= 0 with the updated prefix); norm_weight, query: [D]; out_norm_weight: [D] or
    None. Returns (prefix + delta [T, D] (prefix itself when delta is None), the read's output
    [T, D]), both in prefix.dtype: the prefix add, the block write, the depth softmax over the
    RMS-normed sources, the weighted sum of the raw sources and the output norm in one pass
    (reference.attn_res). num_blocks and write_idx are Python ints fixed per layer, so a CUDA
    graph captures the launch as is; write_idx must be -1 or >= num_blocks (a read never mixes
    the block it writes).

    pdl: launch with programmatic dependent launch (sm_90+): the kernel reads the three
    weights, then waits for the previous kernel before it reads prefix / delta / blocks or
    writes. Ignored on CPU tensors (the interpreter cannot run the PTX)."""
    require_triton()
    from kdaserve.kernels.attn_res.triton_attn_res import attn_res_kernel

    T, D = prefix.shape
    if prefix.stride(1) != 1 or blocks.dim() != 3 or blocks.shape[0] != T \
            or blocks.shape[2] != D or blocks.stride(2) != 1:
        raise ValueError(f"prefix [T, D] and blocks [T, NB, D] with contiguous last dims, got "
                         f"{tuple(prefix.shape)} / {tuple(blocks.shape)}")
    if delta is not None and (delta.shape != prefix.shape or delta.stride(1) != 1):
        raise ValueError(f"delta must be [T, D]={tuple(prefix.shape)} with a contiguous last "
                         f"dim, got {tuple(delta.shape)}")
    if not 0 <= num_blocks <= blocks.shape[1] or not (write_idx == -1
                                                       or num_blocks <= write_idx
                                                       < blocks.shape[1]):
        raise ValueError(f"num_blocks {num_blocks} / write_idx {write_idx} out of range for "
                         f"{blocks.shape[1]} blocks (write_idx is -1 or >= num_blocks)")
    check_kernel_device(prefix)
    prefix_out = torch.empty_like(prefix) if delta is not None else prefix
    out = torch.empty_like(prefix)
    if T:
        attn_res_kernel[(T,)](
            prefix, delta if delta is not None else prefix, blocks, norm_weight, query,
            out_norm_weight if out_norm_weight is not None else norm_weight, prefix_out, out,
            D, write_idx, float(eps), prefix.stride(0),
            delta.stride(0) if delta is not None else 0, blocks.stride(0), blocks.stride(1),
            prefix_out.stride(0), out.stride(0), NUM_BLOCKS=num_blocks,
            HAS_DELTA=delta is not None, WRITE=write_idx >= 0,
            HAS_OUT_NORM=out_norm_weight is not None, BLOCK_D=next_power_of_2(D),
            num_warps=8 if D >= 2048 else 4, **pdl_options(pdl, prefix))
    return prefix_out, out
