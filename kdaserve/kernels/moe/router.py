"""Fused sigmoid top-k router: sigmoid + selection bias + top-k + renormalise + scale, one launch
(moe_topk_sigmoid, over logits from a GEMM); for decode-size batches also with the router GEMV
in the same launch (moe_router_fused).

Twin: `kdaserve.kernels.reference.moe_topk_sigmoid` (ids come out in descending order of
score + bias; the reference's order is unspecified, the set is the same).
"""

from __future__ import annotations

import torch

from kdaserve.kernels.utils import cdiv, check_kernel_device, next_power_of_2, require_triton


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


FUSED_ROUTER_MAX_TOKENS = 8
"""Token counts the one-launch router covers (decode batches); more take moe_topk_sigmoid over
a GEMM's logits."""


def router_workspace(num_experts: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits scratch [FUSED_ROUTER_MAX_TOKENS, next_pow2(E)] fp32, done counter [1] int32 = 0)
    of moe_router_fused; one pair per router layer (launches of one pair must not overlap)."""
    scratch = torch.empty(FUSED_ROUTER_MAX_TOKENS, next_power_of_2(num_experts),
                          dtype=torch.float32, device=device)
    return scratch, torch.zeros(1, dtype=torch.int32, device=device)


def moe_router_fused(x: torch.Tensor, weight: torch.Tensor, correction_bias: torch.Tensor | None,
                     top_k: int, renormalize: bool, scaling: float,
                     workspace: tuple[torch.Tensor, torch.Tensor],
                     ids_dtype: torch.dtype = torch.int32,
                     extra_expert: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The router GEMV (fp32 logits x @ weight.T) and moe_topk_sigmoid in one launch, for at
    most FUSED_ROUTER_MAX_TOKENS tokens. x: [N, D] (any float dtype, contiguous last dim);
    weight: [E, D] fp32; workspace: router_workspace(E). Returns what moe_topk_sigmoid returns.
    Each logit is one program's fixed-order sum, so a token's routing does not depend on the
    other tokens in the batch."""
    require_triton()
    from kdaserve.kernels.moe.triton_router import router_gemv_topk_kernel

    if x.dim() != 2 or x.stride(1) != 1:
        raise ValueError(f"x must be [N, D] with a contiguous last dim, got {tuple(x.shape)}")
    N, D = x.shape
    if N > FUSED_ROUTER_MAX_TOKENS:
        raise ValueError(f"the fused router takes at most {FUSED_ROUTER_MAX_TOKENS} tokens, "
                         f"got {N}")
    if weight.dim() != 2 or weight.shape[1] != D or weight.stride(1) != 1:
        raise ValueError(f"weight must be [E, D={D}] with a contiguous last dim, got "
                         f"{tuple(weight.shape)}")
    E = weight.shape[0]
    weights, ids = _routing_outputs(N, E, top_k, correction_bias, extra_expert, ids_dtype,
                                    x.device)
    scratch, counter = workspace
    block_e = next_power_of_2(E)
    if scratch.shape != (FUSED_ROUTER_MAX_TOKENS, block_e) or counter.shape != (1,):
        raise ValueError(f"workspace must come from router_workspace({E})")
    for t in (x, weight, scratch, counter):
        check_kernel_device(t)
    if N == 0:
        return weights, ids
    block_ex = 4
    router_gemv_topk_kernel[(cdiv(E, block_ex),)](
        x, weight, correction_bias if correction_bias is not None else weight, scratch, counter,
        weights, ids, N, E, D, x.stride(0), weight.stride(0), float(scaling),
        TOP_K=top_k, RENORMALIZE=renormalize, HAS_BIAS=correction_bias is not None,
        BLOCK_N=next_power_of_2(N), BLOCK_EX=block_ex, BLOCK_D=256, BLOCK_E=block_e,
        BLOCK_K=next_power_of_2(ids.shape[1]),
        EXTRA_ID=-1 if extra_expert is None else int(extra_expert), num_warps=4,
    )
    return weights, ids
