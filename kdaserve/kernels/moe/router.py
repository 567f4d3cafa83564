"""The MoE router on Triton: the fused sigmoid top-k (sigmoid + selection bias + top-k +
renormalise + scale, one launch over logits from a GEMM or the decode GEMV, or over the K-split
partial logits of router_partials, summed there: moe_topk_sigmoid), the fp32 logits of
few-token steps on the CUDA cores (router_partials), and the fp32 logits GEMM of many-token
steps on the tensor cores (router_logits).

Twin: `kdaserve.kernels.reference.moe_topk_sigmoid` (ids come out in descending order of
score + bias; the reference's order is unspecified, the set is the same).

`pdl=True` launches with programmatic dependent launch (sm_90+): the kernel may start while the
previous kernel in the stream finishes, reads only the immutable selection bias before
griddepcontrol.wait, and lets the next PDL kernel start right after its wait. Same results as
pdl=False; ignored on CPU tensors (the Triton interpreter cannot run the PTX).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kdaserve.kernels.utils import (cdiv, check_kernel_device, next_power_of_2, num_sms,
                                    pdl_options, require_triton)


TOPK_NUM_WARPS = 4
"""Warps per token of the top-k kernel: the fastest of 1, 2 and 4 at 256 experts, top 8 + the
shared column, 1 / 9 / 16 tokens after router_partials (bench_prefill.py --cases router,
benchmarks/PERF_NOTES.md)."""


def moe_topk_sigmoid(router_logits: torch.Tensor, correction_bias: torch.Tensor | None,
                     top_k: int, renormalize: bool, scaling: float,
                     ids_dtype: torch.dtype = torch.int32,
                     extra_expert: int | None = None, pdl: bool = False,
                     num_warps: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits: [N, E] (any float dtype), or [S, N, E] partial logits whose sum over S
    (in order, fp32) is the logits (router_partials); correction_bias: [E] or None (selection
    only).

    Returns (weights fp32 [N, top_k], ids [N, top_k] of ids_dtype). With extra_expert set, one
    more column follows every row: id extra_expert with weight 1 (a shared expert run by the
    same fused MoE call). pdl: programmatic dependent launch (module docstring); the bias is
    read before the wait, so the previous kernel must not write it. num_warps: per program
    (a power of two in 1..8; default TOPK_NUM_WARPS), for benchmarks.
    """
    if num_warps is not None and (num_warps not in (1, 2, 4, 8)):
        raise ValueError(f"num_warps must be 1, 2, 4 or 8, got {num_warps}")
    require_triton()
    from kdaserve.kernels.moe.triton_router import topk_sigmoid_kernel

    parts = router_logits if router_logits.dim() == 3 else router_logits[None]
    if router_logits.dim() not in (2, 3) or parts.stride(2) != 1 or parts.shape[0] < 1:
        raise ValueError(f"router_logits must be [N, E] or [S >= 1, N, E] with a contiguous "
                         f"last dim, got {tuple(router_logits.shape)}")
    S, N, E = parts.shape
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
    block_k = next_power_of_2(width)
    block_e = max(next_power_of_2(E), block_k)          # the sort's width holds the output's
    pdl_opts = pdl_options(pdl, router_logits)
    topk_sigmoid_kernel[(N,)](
        parts, correction_bias if correction_bias is not None else parts,
        weights, ids, E, parts.stride(1), float(scaling), S, parts.stride(0),
        TOP_K=top_k, RENORMALIZE=renormalize, HAS_BIAS=correction_bias is not None,
        BLOCK_E=block_e, BLOCK_K=block_k,
        EXTRA_ID=-1 if extra_expert is None else int(extra_expert),
        num_warps=num_warps or TOPK_NUM_WARPS, **pdl_opts,
    )
    return weights, ids


ROUTER_GEMM_MIN_ROWS = 1024
"""From this many rows (prefill chunks, large mixed steps) the router's fp32 logits come from
router_logits on the tensor cores; below, the decode GEMV (1-2 rows), router_partials (up to
ROUTER_PARTIALS_MAX_ROWS) or cuBLAS's fp32 GEMM. At 1024 rows router_logits' 16 x 32 tiles
took 0.6x cuBLAS's time, and 0.3x at 8000 with 128 x 128 tiles (benchmarks/PERF_NOTES.md)."""


def use_router_logits(x: torch.Tensor) -> bool:
    """Whether the router's logits of x [N, D] come from router_logits (CUDA, bf16, at least
    ROUTER_GEMM_MIN_ROWS rows)."""
    return x.is_cuda and x.dtype == torch.bfloat16 and x.shape[0] >= ROUTER_GEMM_MIN_ROWS


ROUTER_PARTIALS_MAX_ROWS = 64
"""Rows up to which router_partials may take the router's logits (decode batches, verify
windows of up to 7 requests): there cuBLAS's fp32 GEMM is a cast launch and then a SIMT kernel
on a few SMs (benchmarks/PERF_NOTES.md). Past it the CUDA-core FMAs of a [16, 8, 32] tile a
step (a third of the loop's instructions) no longer beat cuBLAS on paper."""


def use_router_partials(x: torch.Tensor) -> bool:
    """Whether the router's logits of x [N, D] can come from router_partials (CUDA, bf16,
    1..ROUTER_PARTIALS_MAX_ROWS rows)."""
    return x.is_cuda and x.dtype == torch.bfloat16 and 0 < x.shape[0] <= ROUTER_PARTIALS_MAX_ROWS


@dataclass(frozen=True)
class RouterPartialsPlan:
    """router_partials' tiles and K splits for one (N, E, D)."""
    block_m: int
    block_n: int
    block_k: int
    splits: int
    k_split: int        # K elements per split, a multiple of block_k
    num_warps: int
    num_stages: int


ROUTER_PARTIALS_TILE = (16, 8, 32)
"""(rows, experts, K) of a router_partials program: a [16, 8, 32] fp32 product tile is 32
registers a thread at 4 warps."""
ROUTER_PARTIALS_MAX_SPLITS = 8


def router_partials_plan(N: int, E: int, D: int, sms: int = 132) -> RouterPartialsPlan:
    """The fewest K splits (a power of two, at most ROUTER_PARTIALS_MAX_SPLITS, each at least
    four K steps) that give the (row tile, expert tile) grid one program per SM: at 256
    experts and 132 SMs, 8 splits (288 of 2304 K values each) at 1-16 rows, 4 at 17-32, 2 at
    33-64."""
    bm, bn, bk = ROUTER_PARTIALS_TILE
    tiles = cdiv(N, bm) * cdiv(E, bn)
    splits = 1
    while (splits < ROUTER_PARTIALS_MAX_SPLITS and tiles * splits < sms
           and D >= 2 * splits * 4 * bk):
        splits *= 2
    k_split = cdiv(cdiv(D, splits), bk) * bk
    return RouterPartialsPlan(bm, bn, bk, cdiv(D, k_split), k_split, 4, 3)


def router_partials(x: torch.Tensor, weight: torch.Tensor,
                    plan: RouterPartialsPlan | None = None, pdl: bool = False) -> torch.Tensor:
    """x: [N, D] bf16 (contiguous last dim); weight: [E, D] fp32 (contiguous last dim) ->
    [S, N, E] fp32 partial logits over S K splits, to be summed in order (moe_topk_sigmoid
    takes them as they are): x.float() @ weight.T with fp32 FMAs, no tensor cores and no
    cast launch (triton_router.router_partials_kernel). Twin: F.linear(x.float(), weight)
    against the partials' sum. pdl: programmatic dependent launch (nothing is read before the
    wait)."""
    require_triton()
    from kdaserve.kernels.moe.triton_router import router_partials_kernel

    _check_router_gemm(x, weight)
    N, D = x.shape
    E = weight.shape[0]
    p = plan or router_partials_plan(N, E, D, num_sms(x.device))
    if p.k_split % p.block_k or p.splits != cdiv(D, p.k_split):
        raise ValueError(f"plan {p} does not tile D={D}: k_split must be a multiple of block_k "
                         f"and splits = cdiv(D, k_split)")
    part = torch.empty(p.splits, N, E, dtype=torch.float32, device=x.device)
    if N == 0:
        return part
    router_partials_kernel[(cdiv(N, p.block_m), cdiv(E, p.block_n), p.splits)](
        x, weight, part, N, E, D, p.k_split, x.stride(0), weight.stride(0), part.stride(0),
        part.stride(1), BLOCK_M=p.block_m, BLOCK_N=p.block_n, BLOCK_K=p.block_k,
        EVEN_K=D % p.block_k == 0, STAGES=p.num_stages, num_warps=p.num_warps,
        **pdl_options(pdl, x))
    return part


@dataclass(frozen=True)
class RouterGemmConfig:
    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


def router_gemm_config(N: int, E: int, D: int) -> RouterGemmConfig:
    """Tiles of router_logits: 128 x 128 output tiles from 4096 tokens (8000 tokens x 256
    experts: 126 programs, one wave on 132 SMs), 64-row tiles from 2048, and 16 x 32 tiles with
    128-wide K steps below (1024 rows: half the time of 64 x 128 tiles, whose 32 programs
    leave most SMs idle). The fp32 weight tile is split into three bf16 tiles in registers, so
    block_k stays at 64 for the larger tiles."""
    if N < 2048:
        return RouterGemmConfig(16, min(32, max(16, next_power_of_2(E))),
                                min(128, max(16, next_power_of_2(D))), 4, 3)
    bm = 128 if N >= 4096 else 64
    bn = min(128, max(16, next_power_of_2(E)))
    return RouterGemmConfig(bm, bn, min(64, max(16, next_power_of_2(D))), 8 if bm == 128 else 4,
                            3)


def router_logits(x: torch.Tensor, weight: torch.Tensor, config: RouterGemmConfig | None = None,
                  pdl: bool = False) -> torch.Tensor:
    """x: [N, D] bf16 (contiguous last dim); weight: [E, D] fp32 (contiguous) -> fp32 logits
    [N, E] = x.float() @ weight.T, computed as three exact bf16 products per weight
    (triton_router.router_logits_kernel): an fp32 GEMM's result up to the order of the
    additions, on the tensor cores instead of fp32 FMA. Twin: F.linear(x.float(), weight).
    pdl: programmatic dependent launch (nothing is read before the wait)."""
    require_triton()
    from kdaserve.kernels.moe.triton_router import router_logits_kernel

    _check_router_gemm(x, weight)
    N, D = x.shape
    E = weight.shape[0]
    out = torch.empty(N, E, dtype=torch.float32, device=x.device)
    if N == 0:
        return out
    c = config or router_gemm_config(N, E, D)
    router_logits_kernel[(cdiv(N, c.block_m), cdiv(E, c.block_n))](
        x, weight, out, N, E, D, x.stride(0), weight.stride(0), out.stride(0),
        BLOCK_M=c.block_m, BLOCK_N=c.block_n, BLOCK_K=c.block_k, EVEN_K=D % c.block_k == 0,
        num_warps=c.num_warps, num_stages=c.num_stages, **pdl_options(pdl, x))
    return out


def _check_router_gemm(x: torch.Tensor, weight: torch.Tensor) -> None:
    """The inputs of router_partials and router_logits: bf16 x [N, D], fp32 weight [E, D], both
    with a contiguous last dim, on a kernel device."""
    if x.dim() != 2 or x.dtype != torch.bfloat16 or x.stride(1) != 1:
        raise ValueError(f"x must be bf16 [N, D] with a contiguous last dim, got {x.dtype} "
                         f"{tuple(x.shape)}")
    if (weight.dim() != 2 or weight.dtype != torch.float32 or weight.shape[1] != x.shape[1]
            or weight.stride(1) != 1):
        raise ValueError(f"weight must be fp32 [E, D={x.shape[1]}] with a contiguous last dim, "
                         f"got {weight.dtype} {tuple(weight.shape)}")
    check_kernel_device(x)
