"""Fused sigmoid top-k router: sigmoid + selection bias + top-k + renormalise + scale, one launch
over logits from a GEMM (moe_topk_sigmoid).

Twin: `kdaserve.kernels.reference.moe_topk_sigmoid` (ids come out in descending order of
score + bias; the reference's order is unspecified, the set is the same).
"""

from __future__ import annotations

import torch

from kdaserve.kernels.utils import check_kernel_device, next_power_of_2, require_triton


def _routing_outputs(N: int, E: int, top_k: int, correction_bias: torch.Tensor | None,
                     extra_expert: int | None, ids_dtype: torch.dtype, device
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """Checks top_k and the bias against E; the empty (weights fp32, ids) [N, top_k (+1)]."""
    if not 0 < top_k <= E:
        raise ValueError(f"top_k must be in [1, E={E}], got {top_k}")
    if correction_bias is not None and correction_bias.shape != (E,):
        raise ValueError(f"correction_bias must be [E={E}], got {tuple(correction_bias.shape)}")
    width = top_k + (extra_expert is not None)
    return (torch.empty(N, width, dtype=torch.float32, device=device),
            torch.empty(N, width, dtype=ids_dtype, device=device))


def moe_topk_sigmoid(router_logits: torch.Tensor, correction_bias: torch.Tensor | None,
                     top_k: int, renormalize: bool, scaling: float,
                     ids_dtype: torch.dtype = torch.int32,
                     extra_expert: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits: [N, E] (any float dtype); correction_bias: [E] or None (selection only).

    Returns (weights fp32 [N, top_k], ids [N, top_k] of ids_dtype). With extra_expert set, one
    more column follows every row: id extra_expert with weight 1 (a shared expert run by the
    same fused MoE call).
    """
    require_triton()
    from kdaserve.kernels.moe.triton_router import topk_sigmoid_kernel

    if router_logits.dim() != 2 or router_logits.stride(1) != 1:
        raise ValueError(f"router_logits must be [N, E] with a contiguous last dim, "
                         f"got {tuple(router_logits.shape)}")
    N, E = router_logits.shape
    check_kernel_device(router_logits)
    weights, ids = _routing_outputs(N, E, top_k, correction_bias, extra_expert, ids_dtype,
                                    router_logits.device)
    if N == 0:
        return weights, ids
    block_e = next_power_of_2(E)
    topk_sigmoid_kernel[(N,)](
        router_logits, correction_bias if correction_bias is not None else router_logits,
        weights, ids, E, router_logits.stride(0), float(scaling),
        TOP_K=top_k, RENORMALIZE=renormalize, HAS_BIAS=correction_bias is not None,
        BLOCK_E=block_e, BLOCK_K=next_power_of_2(ids.shape[1]),
        EXTRA_ID=-1 if extra_expert is None else int(extra_expert),
        num_warps=max(1, min(4, block_e // 128)),
    )
    return weights, ids
