"""One-token (batch-1 decode) routed-experts MoE: two GEMV launches, the top-k sum fused in.

Same math as `kdaserve.kernels.reference.moe_experts` for N = 1:
    out = sum_j w_j * W2[e_j] @ (silu(Wg[e_j] x) * (Wu[e_j] x)),  ids outside [0, E) skipped.
Unlike `fused_moe` at N = 1 (each entry a 16-row tensor-core block with one valid row, then a
[k, D] buffer and a sum launch), the kernels here are matrix-vector products on CUDA cores and the
second one sums over the k entries itself. No host sync; buffers and grids come from shapes only,
so the call can be captured in a CUDA graph. Not wired into the model.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from kdaserve.kernels.moe.fused_moe import _check_moe_inputs
from kdaserve.kernels.utils import cdiv, next_power_of_2, require_triton


@dataclass(frozen=True)
class GemvConfig:
    """One GEMV launch: block_rows output rows per program, block_k reduction chunk."""
    block_rows: int
    block_k: int
    num_warps: int
    num_stages: int


@dataclass(frozen=True)
class SingleTokenMoEConfig:
    """gemv1: rows of I per program, chunk of D; gemv2: columns of D per program, chunk of I."""
    gemv1: GemvConfig
    gemv2: GemvConfig


# UNMEASURED guess (no GPU was available when this was written): gemv1 gives k * I / 16 = 576
# programs at the 48B shapes, gemv2 gives D / 8 = 288, i.e. a few programs per SM with 8-16 KB of
# weight loads each per loop step. Replace with benchmarks/bench_moe_single.py --tune results.
DEFAULT_CONFIG = SingleTokenMoEConfig(gemv1=GemvConfig(16, 256, 4, 3),
                                      gemv2=GemvConfig(8, 512, 4, 3))
# inter [k, I] is kept in fp32: at the 48B shapes it is 36 KB (k = 9, I = 1024), against ~127 MB
# of expert weights streamed per call, so the wider type costs nothing measurable in bytes, and
# the SwiGLU product is not rounded to bf16 between the two GEMVs.
INTER_DTYPE = torch.float32


def fit_single_config(cfg: SingleTokenMoEConfig, hidden: int,
                      inter_size: int) -> SingleTokenMoEConfig:
    """Shrink tiles that exceed the problem (small test models): gemv1 is [I, D] @ [D],
    gemv2 is [D, I] @ [I]."""
    def cap(n: int) -> int:
        return next_power_of_2(max(1, n))

    g1, g2 = cfg.gemv1, cfg.gemv2
    g1 = replace(g1, block_rows=min(g1.block_rows, cap(inter_size)),
                 block_k=min(g1.block_k, cap(hidden)))
    g2 = replace(g2, block_rows=min(g2.block_rows, cap(hidden)),
                 block_k=min(g2.block_k, cap(inter_size)))
    return SingleTokenMoEConfig(g1, g2)


def _check_config(cfg: SingleTokenMoEConfig) -> None:
    for name, c in (("gemv1", cfg.gemv1), ("gemv2", cfg.gemv2)):
        for field in ("block_rows", "block_k"):
            v = getattr(c, field)
            if v < 1 or v & (v - 1):
                raise ValueError(f"{name}.{field} must be a power of two, got {v}")


def _check_single_token_inputs(x, w13, w2, topk_weights, topk_ids, out):
    if x.dim() != 2 or x.shape[0] != 1:
        raise ValueError(f"fused_moe_single_token needs one token: x must be [1, D], "
                         f"got {tuple(x.shape)}")
    if out is not None and (out.shape != x.shape or out.stride(1) != 1):
        raise ValueError(f"out must be [1, D]={tuple(x.shape)} with a contiguous last dim, "
                         f"got {tuple(out.shape)}")
    _check_moe_inputs(x, w13, w2, topk_weights, topk_ids)
    if out is not None and out.device != x.device:
        raise ValueError(f"out is on {out.device}, x on {x.device}")


def single_token_gemv1(x: torch.Tensor, w13: torch.Tensor, topk_ids: torch.Tensor,
                       inter: torch.Tensor, cfg: GemvConfig) -> torch.Tensor:
    """inter[j] = silu(gate[e_j] @ x[0]) * (up[e_j] @ x[0]); zeros for ids outside [0, E).

    x: [1, D]; w13: [E, 2I, D]; topk_ids: [k] contiguous int; inter: [k, I], last dim contiguous.
    Inputs are not checked here (fused_moe_single_token does it)."""
    from kdaserve.kernels.moe.triton_single_token import moe_single_gemv1_kernel

    E, two_i, D = w13.shape
    inter_size, top_k = two_i // 2, topk_ids.numel()
    if top_k == 0:
        return inter
    moe_single_gemv1_kernel[(top_k, cdiv(inter_size, cfg.block_rows))](
        x, w13, inter, topk_ids, inter_size, D, E,
        w13.stride(0), w13.stride(1), inter.stride(0),
        BLOCK_N=cfg.block_rows, BLOCK_K=cfg.block_k,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return inter


def single_token_gemv2(inter: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                       topk_ids: torch.Tensor, out: torch.Tensor,
                       cfg: GemvConfig) -> torch.Tensor:
    """out[0] = sum_j w_j * w2[e_j] @ inter[j] over ids in [0, E), written once (out's dtype).

    inter: [k, I]; w2: [E, D, I]; topk_weights, topk_ids: [k] contiguous; out: [1, D]."""
    from kdaserve.kernels.moe.triton_single_token import moe_single_gemv2_kernel

    E, D, inter_size = w2.shape
    moe_single_gemv2_kernel[(cdiv(D, cfg.block_rows),)](
        inter, w2, topk_weights, topk_ids, out,
        D, inter_size, topk_ids.numel(), E,
        inter.stride(0), w2.stride(0), w2.stride(1),
        BLOCK_D=cfg.block_rows, BLOCK_K=cfg.block_k,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return out


def fused_moe_single_token(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                           topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                           out: torch.Tensor | None = None,
                           config: SingleTokenMoEConfig | None = None) -> torch.Tensor:
    """Routed SwiGLU experts for one token: out[0] = sum_j w[0, j] * w2[e] @ (silu(gate_e x)
    * up_e x), e = topk_ids[0, j].

    x: [1, D]; w13: [E, 2I, D] (rows [0, I) gate, [I, 2I) up); w2: [E, D, I];
    topk_weights: [1, k] (fp32); topk_ids: [1, k] int32/int64 (repeats allowed; ids outside
    [0, E) contribute nothing). Returns [1, D] in x.dtype (into `out` when given).
    Two launches; fp32 accumulation; deterministic (no atomics).
    """
    _check_single_token_inputs(x, w13, w2, topk_weights, topk_ids, out)
    require_triton()
    E, two_i, D = w13.shape
    inter_size, top_k = two_i // 2, topk_ids.shape[1]
    cfg = config or fit_single_config(DEFAULT_CONFIG, D, inter_size)
    _check_config(cfg)
    if out is None:
        out = torch.empty(1, D, dtype=x.dtype, device=x.device)
    ids = topk_ids.reshape(-1).contiguous()                                  # [k]
    weights = topk_weights.reshape(-1).contiguous()                          # [k]
    inter = torch.empty(top_k, inter_size, dtype=INTER_DTYPE, device=x.device)   # [k, I]
    single_token_gemv1(x, w13, ids, inter, cfg.gemv1)
    return single_token_gemv2(inter, w2, weights, ids, out, cfg.gemv2)
