"""Fused sigmoid top-k router: sigmoid + selection bias + top-k + renormalise + scale, one launch
over logits from a GEMM or the decode GEMV (moe_topk_sigmoid).

Twin: `kdaserve.kernels.reference.moe_topk_sigmoid` (ids come out in descending order of
score + bias; the reference's order is unspecified, the set is the same).

`pdl=True` launches with programmatic dependent launch (sm_90+): the kernel may start while the
previous kernel in the stream finishes, reads only the immutable selection bias before
griddepcontrol.wait, and lets the next PDL kernel start right after its wait. Same results as
pdl=False; ignored on CPU tensors (the Triton interpreter cannot run the PTX).
"""

from __future__ import annotations

import torch

from kdaserve.kernels.utils import (check_kernel_device, next_power_of_2, pdl_options,
                                    require_triton)


def topk_num_warps(block_e: int) -> int:
    """Warps per token of the top-k kernel: one up to 512 experts (one warp measured fastest
    of 1, 2 and 4 at E=256, one token; benchmarks/PERF_NOTES.md: one warp's argmax rounds need
    no cross-warp reduction), then one more per 512."""
    return max(1, min(4, block_e // 512))


def moe_topk_sigmoid(router_logits: torch.Tensor, correction_bias: torch.Tensor | None,
                     top_k: int, renormalize: bool, scaling: float,
                     ids_dtype: torch.dtype = torch.int32,
                     extra_expert: int | None = None, pdl: bool = False,
                     num_warps: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits: [N, E] (any float dtype); correction_bias: [E] or None (selection only).

    Returns (weights fp32 [N, top_k], ids [N, top_k] of ids_dtype). With extra_expert set, one
    more column follows every row: id extra_expert with weight 1 (a shared expert run by the
    same fused MoE call). pdl: programmatic dependent launch (module docstring); the bias is
    read before the wait, so the previous kernel must not write it. num_warps: per program
    (a power of two in 1..8; default topk_num_warps), for benchmarks.
    """
    if num_warps is not None and (num_warps not in (1, 2, 4, 8)):
        raise ValueError(f"num_warps must be 1, 2, 4 or 8, got {num_warps}")
    require_triton()
    from kdaserve.kernels.moe.triton_router import topk_sigmoid_kernel

    if router_logits.dim() != 2 or router_logits.stride(1) != 1:
        raise ValueError(f"router_logits must be [N, E] with a contiguous last dim, "
                         f"got {tuple(router_logits.shape)}")
    N, E = router_logits.shape
    check_kernel_device(router_logits)
    if not 0 < top_k <= E:
        raise ValueError(f"top_k must be in [1, E={E}], got {top_k}")
    if correction_bias is not None and correction_bias.shape != (E,):
        raise ValueError(f"correction_bias must be [E={E}], got {tuple(correction_bias.shape)}")
    width = top_k + (extra_expert is not None)
    weights = torch.empty(N, width, dtype=torch.float32, device=router_logits.device)
    ids = torch.empty(N, width, dtype=ids_dtype, device=router_logits.device)
    if N == 0:
        return weights, ids
    block_e = next_power_of_2(E)
    pdl_opts = pdl_options(pdl, router_logits)
    topk_sigmoid_kernel[(N,)](
        router_logits, correction_bias if correction_bias is not None else router_logits,
        weights, ids, E, router_logits.stride(0), float(scaling),
        TOP_K=top_k, RENORMALIZE=renormalize, HAS_BIAS=correction_bias is not None,
        BLOCK_E=block_e, BLOCK_K=next_power_of_2(width),
        EXTRA_ID=-1 if extra_expert is None else int(extra_expert),
        num_warps=num_warps or topk_num_warps(block_e), **pdl_opts,
    )
    return weights, ids
