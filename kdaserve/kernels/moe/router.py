"""Fused sigmoid top-k router: sigmoid + selection bias + top-k + renormalise + scale, one launch
over logits from a GEMM (moe_topk_sigmoid); for decode batches (<= 64 tokens) the logits GEMV
too, split over K with the partial sums reduced inside the top-k launch (moe_router_splitk);
for <= 4 tokens all of it in ONE launch, the program that finishes last running the top-k
(moe_router_gemv_topk, with a caller-owned ticket counter).

Twin: `kdaserve.kernels.reference.moe_topk_sigmoid` (ids come out in descending order of
score + bias; the reference's order is unspecified, the set is the same).

`pdl=True` launches with programmatic dependent launch (sm_90+): each kernel may start while the
previous kernel in the stream finishes, reads only immutable inputs (the top-k's selection bias,
the one-launch router's first weight chunks) before griddepcontrol.wait, and lets the next PDL
kernel start right after its wait. Same results as pdl=False; ignored on CPU tensors (the Triton
interpreter cannot run the PTX).
"""

from __future__ import annotations

import torch

from kdaserve.kernels.utils import (cdiv, check_device, check_kernel_device, next_power_of_2,
                                    num_sms, pdl_options, require_triton)

ROUTER_SPLITK_MAX_TOKENS = 64
"""moe_router_splitk's token limit: every program keeps all tokens' accumulators."""

ROUTER_FUSED_MAX_TOKENS = 4
"""moe_router_gemv_topk's token limit: the kernel's fixed BLOCK_N (never derived from N)."""

_SPLITK_BLOCK_E = 32
_SPLITK_BLOCK_K = 32
_SPLITK_MAX_PARTIALS = 32   # the top-k kernel unrolls one load per partial
_FUSED_BLOCK_K = 256        # K chunk of the one-launch router (divides D=2304: no K mask)
_FUSED_PREFETCH = 2         # weight chunks loaded before griddepcontrol.wait with pdl
_FUSED_MAX_BLOCK_E = 4      # acc [4, BLOCK_E, 256] fp32: 64 registers a thread at 4, 2 warps
_FUSED_MAX_STAGES = 9       # K-loop pipeline depth: D=2304 (9 chunks) has 7+ chunks in flight


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


def topk_num_warps(block_e: int) -> int:
    """Warps per token of the top-k kernel: one up to 512 experts (H200, E=256, one token:
    2.48 us a call against 3.61 with two warps and 3.80 with four, chain_h200_v4.json), then
    one more per 512."""
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
        num_warps=num_warps or topk_num_warps(block_e), **pdl_opts,
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


def _check_router_inputs(x: torch.Tensor, weight: torch.Tensor, max_tokens: int,
                         name: str) -> None:
    """x [N <= max_tokens, D] fp32 / bf16 / fp16 and an fp32 [E, D] weight, both with a
    contiguous last dim, on one kernel device; `name` is the function named in the errors."""
    if x.dim() != 2 or x.stride(1) != 1:
        raise ValueError(f"x must be [N, D] with a contiguous last dim, got {tuple(x.shape)}")
    if x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"x must be fp32, bf16 or fp16, got {x.dtype}")
    if x.shape[0] > max_tokens:
        raise ValueError(f"{name} takes at most {max_tokens} tokens, got N={x.shape[0]}")
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

    _check_router_inputs(x, weight, ROUTER_SPLITK_MAX_TOKENS, "moe_router_splitk")
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
        num_warps=topk_num_warps(block_e_topk), **pdl_opts,
    )
    return weights, ids


def router_fused_plan(E: int, D: int, sms: int) -> int:
    """BLOCK_E of moe_router_gemv_topk: the smallest power of two whose grid cdiv(E, BLOCK_E)
    fits in one wave of one program per SM. Fewer experts per program means more SMs pulling
    the weight at once and fewer bytes on the slowest one; past one program per SM an SM would
    stream two programs' rows (the same bytes per SM) and add ticket atomics for nothing.
    E=256 on 132 SMs: 2 experts, 128 programs of 18 KB each of the 2.4 MB fp32 weight (D=2304),
    rather than 64 programs of 4 (36 KB each, half the SMs idle). D does not enter (bytes per
    program grow with it, the split does not change). At most _FUSED_MAX_BLOCK_E (4: the
    [4, BLOCK_E, 256] fp32 accumulator's registers); past that the grid takes more waves.
    UNMEASURED on GPU: a guess from the byte count (benchmarks/bench_router_fused.py times the
    chosen launch, not the alternatives)."""
    del D
    block_e = 1
    while block_e < min(_FUSED_MAX_BLOCK_E, next_power_of_2(E)) and cdiv(E, block_e) > sms:
        block_e *= 2
    return block_e


def _check_fused_inputs(x: torch.Tensor, weight: torch.Tensor, ticket: torch.Tensor) -> None:
    _check_router_inputs(x, weight, ROUTER_FUSED_MAX_TOKENS, "moe_router_gemv_topk")
    if ticket.shape != (1,) or ticket.dtype != torch.int32:
        raise ValueError(f"ticket must be an int32 [1] tensor, got {ticket.dtype} "
                         f"{tuple(ticket.shape)}")
    check_device("ticket", ticket, x.device)


def moe_router_gemv_topk(x: torch.Tensor, weight: torch.Tensor,
                         correction_bias: torch.Tensor | None, top_k: int, renormalize: bool,
                         scaling: float, ticket: torch.Tensor,
                         ids_dtype: torch.dtype = torch.int32, extra_expert: int | None = None,
                         pdl: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """The whole router of a decode batch of N <= ROUTER_FUSED_MAX_TOKENS tokens in ONE launch
    (router_gemv_topk_kernel): fp32 logits x @ weight.T over cdiv(E, BLOCK_E) programs into a
    scratch [N, E], and the program that finishes last (a ticket counter) runs the top-k of
    every token.

    x: [N, D] fp32, bf16 or fp16 (read as fp32, exact products, no TF32); weight: [E, D] fp32.
    ticket: a caller-owned int32 tensor of shape [1] on x's device, 0 before the call and left
    0 after it (the kernel resets it). Keep one per call site: two launches that may run
    concurrently (other streams) must not share one; calls in one stream may.
    Outputs as moe_topk_sigmoid / moe_router_splitk: (weights fp32 [N, top_k (+1)], ids
    [N, top_k (+1)] of ids_dtype), ids in descending score + bias order, the extra_expert
    column (weight 1) last. Deterministic and batch invariant (a token's outputs do not depend
    on N or the other tokens). pdl: programmatic dependent launch (module docstring); the first
    weight chunks are read before griddepcontrol.wait, so the previous kernel must not write
    the weight. Raises ValueError for N > ROUTER_FUSED_MAX_TOKENS (naming N) or bad inputs.
    """
    require_triton()
    from kdaserve.kernels.moe.triton_router import router_gemv_topk_kernel

    _check_fused_inputs(x, weight, ticket)
    (N, D), E = x.shape, weight.shape[0]
    weights, ids = _routing_outputs(N, E, top_k, correction_bias, extra_expert, ids_dtype,
                                    x.device)
    if N == 0:
        return weights, ids
    block_e = router_fused_plan(E, D, num_sms(x.device))
    e_pad = next_power_of_2(E)
    logits = torch.empty(N, E, dtype=torch.float32, device=x.device)            # [N, E]
    pdl_opts = pdl_options(pdl, x)
    prefetch = min(_FUSED_PREFETCH, D // _FUSED_BLOCK_K) if pdl_opts["USE_PDL"] else 0
    loop_chunks = cdiv(D, _FUSED_BLOCK_K) - prefetch
    router_gemv_topk_kernel[(cdiv(E, block_e),)](
        x, weight, correction_bias if correction_bias is not None else weight, logits,
        weights, ids, ticket, N, E, D, x.stride(0), weight.stride(0), float(scaling),
        TOP_K=top_k, RENORMALIZE=renormalize, HAS_BIAS=correction_bias is not None,
        BLOCK_E=block_e, BLOCK_K=_FUSED_BLOCK_K, EVEN_K=D % _FUSED_BLOCK_K == 0,
        E_PAD=e_pad, BLOCK_OUT=next_power_of_2(ids.shape[1]),
        EXTRA_ID=-1 if extra_expert is None else int(extra_expert), PREFETCH=prefetch,
        NUM_STAGES=max(2, min(_FUSED_MAX_STAGES, loop_chunks + 1)),   # most chunks in flight
        num_warps=max(1, min(4, e_pad // 128)), **pdl_opts,
    )
    return weights, ids
