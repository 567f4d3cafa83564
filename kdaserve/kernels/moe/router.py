"""Fused sigmoid top-k router: sigmoid + selection bias + top-k + renormalise + scale, one launch
over logits from a GEMM (moe_topk_sigmoid); for decode batches (<= 64 tokens) the logits GEMV
too, split over K with the partial sums reduced inside the top-k launch (moe_router_splitk).

Twin: `kdaserve.kernels.reference.moe_topk_sigmoid` (ids come out in descending order of
score + bias; the reference's order is unspecified, the set is the same).

`pdl=True` launches with programmatic dependent launch (sm_90+): each kernel may start while the
previous kernel in the stream finishes, reads only immutable inputs (the top-k's selection bias)
before griddepcontrol.wait, and lets the next PDL kernel start right after its wait. Same results
as pdl=False; ignored on CPU tensors (the Triton interpreter cannot run the PTX).
"""

from __future__ import annotations

import torch

from kdaserve.kernels.utils import (cdiv, check_device, check_kernel_device, next_power_of_2,
                                    num_sms, pdl_options, require_triton)

ROUTER_SPLITK_MAX_TOKENS = 64
"""moe_router_splitk's token limit: every program keeps all tokens' accumulators."""

_SPLITK_BLOCK_E = 32
_SPLITK_BLOCK_K = 32
_SPLITK_MAX_PARTIALS = 32   # the top-k kernel unrolls one load per partial


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
                     extra_expert: int | None = None, pdl: bool = False
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits: [N, E] (any float dtype); correction_bias: [E] or None (selection only).

    Returns (weights fp32 [N, top_k], ids [N, top_k] of ids_dtype). With extra_expert set, one
    more column follows every row: id extra_expert with weight 1 (a shared expert run by the
    same fused MoE call). pdl: programmatic dependent launch (module docstring); the bias is
    read before the wait, so the previous kernel must not write it.
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
    pdl_opts = pdl_options(pdl, router_logits)
    topk_sigmoid_kernel[(N,)](
        router_logits, correction_bias if correction_bias is not None else router_logits,
        weights, ids, E, router_logits.stride(0), 0, float(scaling),
        TOP_K=top_k, RENORMALIZE=renormalize, HAS_BIAS=correction_bias is not None,
        BLOCK_E=block_e, BLOCK_K=next_power_of_2(ids.shape[1]),
        EXTRA_ID=-1 if extra_expert is None else int(extra_expert),
        num_warps=max(1, min(4, block_e // 128)), **pdl_opts,
    )
    return weights, ids


def router_splitk_plan(E: int, D: int, sms: int) -> tuple[int, int, int]:
    """(BLOCK_E, K_PER_SPLIT, SPLIT_K) of moe_router_splitk, from E, D and the SM count only.

    Never from N: a token's logits are summed over the same K slices in the same order in every
    batch (batch invariance), and a CUDA graph captured at one batch size keeps its launch.
    K slices are whole BLOCK_K chunks; the fewest chunks per slice such that the grid stays
    within ~1.25 programs per SM and SPLIT_K <= 32. E=256, D=2304, 132 SMs: BLOCK_E 32,
    K_PER_SPLIT 128, SPLIT_K 18, a grid of 8 x 18 = 144 programs of 16 KB of weight each.
    """
    block_e = min(_SPLITK_BLOCK_E, next_power_of_2(E))
    e_blocks, k_blocks = cdiv(E, block_e), cdiv(D, _SPLITK_BLOCK_K)
    chunks = cdiv(k_blocks, _SPLITK_MAX_PARTIALS)
    while chunks < k_blocks and e_blocks * cdiv(k_blocks, chunks) > sms * 5 // 4:
        chunks += 1
    k_per_split = chunks * _SPLITK_BLOCK_K
    return block_e, k_per_split, cdiv(D, k_per_split)


def _check_splitk_inputs(x: torch.Tensor, weight: torch.Tensor) -> None:
    if x.dim() != 2 or x.stride(1) != 1:
        raise ValueError(f"x must be [N, D] with a contiguous last dim, got {tuple(x.shape)}")
    if x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"x must be fp32, bf16 or fp16, got {x.dtype}")
    if x.shape[0] > ROUTER_SPLITK_MAX_TOKENS:
        raise ValueError(f"moe_router_splitk takes at most {ROUTER_SPLITK_MAX_TOKENS} tokens, "
                         f"got N={x.shape[0]}")
    if weight.dim() != 2 or weight.stride(1) != 1 or weight.shape[1] != x.shape[1]:
        raise ValueError(f"weight must be [E, D={x.shape[1]}] with a contiguous last dim, "
                         f"got {tuple(weight.shape)}")
    if weight.dtype != torch.float32:
        raise ValueError(f"weight must be fp32, got {weight.dtype}")
    check_kernel_device(x)
    check_device("weight", weight, x.device)


def moe_router_splitk(x: torch.Tensor, weight: torch.Tensor,
                      correction_bias: torch.Tensor | None, top_k: int, renormalize: bool,
                      scaling: float, ids_dtype: torch.dtype = torch.int32,
                      extra_expert: int | None = None, pdl: bool = False
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """The whole router of a decode batch in two launches: fp32 logits x @ weight.T split over
    K (router_logits_splitk_kernel, partials [SPLIT_K, N, E]), then moe_topk_sigmoid's kernel
    summing each token's SPLIT_K partial rows in a fixed order before its top-k.

    x: [N, D] fp32 or bf16 (read as fp32: exact, no TF32), N <= ROUTER_SPLITK_MAX_TOKENS;
    weight: [E, D] fp32. Outputs as moe_topk_sigmoid (ids in descending score + bias order,
    the extra_expert column last). Deterministic, and batch invariant: a token's outputs do
    not depend on N or on the other tokens (router_splitk_plan, router_logits_splitk_kernel).
    pdl: both launches with programmatic dependent launch (module docstring); the logits GEMV
    waits before its first load, the top-k reads the bias before its wait.
    """
    require_triton()
    from kdaserve.kernels.moe.triton_router import (router_logits_splitk_kernel,
                                                    topk_sigmoid_kernel)

    _check_splitk_inputs(x, weight)
    (N, D), E = x.shape, weight.shape[0]
    weights, ids = _routing_outputs(N, E, top_k, correction_bias, extra_expert, ids_dtype,
                                    x.device)
    if N == 0:
        return weights, ids
    block_e, k_per_split, split_k = router_splitk_plan(E, D, num_sms(x.device))
    partials = torch.empty(split_k, N, E, dtype=torch.float32, device=x.device)  # [S, N, E]
    chunks = k_per_split // _SPLITK_BLOCK_K
    pdl_opts = pdl_options(pdl, x)
    router_logits_splitk_kernel[(cdiv(E, block_e), split_k)](
        x, weight, partials, N, E, D, x.stride(0), weight.stride(0), N * E,
        K_PER_SPLIT=k_per_split, BLOCK_N=next_power_of_2(N), BLOCK_E=block_e,
        BLOCK_K=_SPLITK_BLOCK_K, EVEN_K=D % k_per_split == 0,
        num_warps=4, num_stages=min(chunks, 4) + 1, **pdl_opts,   # <= 4 chunks: all in flight
    )
    block_e_topk = next_power_of_2(E)
    topk_sigmoid_kernel[(N,)](
        partials, correction_bias if correction_bias is not None else partials,
        weights, ids, E, E, N * E, float(scaling),
        TOP_K=top_k, RENORMALIZE=renormalize, HAS_BIAS=correction_bias is not None,
        BLOCK_E=block_e_topk, BLOCK_K=next_power_of_2(ids.shape[1]),
        EXTRA_ID=-1 if extra_expert is None else int(extra_expert), NUM_PARTIALS=split_k,
        num_warps=max(1, min(4, block_e_topk // 128)), **pdl_opts,
    )
    return weights, ids
