"""Fused routed-experts MoE layer on Triton: align by expert, two grouped GEMMs, top-k sum.
At one token (N == 1) with a `gemm2_sum` config, the second GEMM and the sum are one GEMV launch.

Same math as `kdaserve.kernels.reference.moe_experts`. No Python loop over experts, no host sync:
buffers and grids are sized from shapes alone (an upper bound on padded rows), so the call can be
captured in a CUDA graph.

`pdl=True` (fused_moe, moe_align_block_size) launches every kernel with programmatic dependent
launch (sm_90+): a kernel may start while the previous one in the stream finishes, waits for it
(griddepcontrol.wait) before its first load, then lets the next PDL kernel start. Same results as
pdl=False; ignored on CPU tensors (the Triton interpreter cannot run the PTX).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from kdaserve.kernels.utils import (cdiv, check_kernel_device, next_power_of_2, pdl_options,
                                    require_triton)


@dataclass(frozen=True)
class MoEGemmConfig:
    block_m: int
    block_n: int
    block_k: int
    group_m: int
    num_warps: int
    num_stages: int
    tma_weights: bool = False
    """The expert weight tiles by TMA through a tensor descriptor (sm_90+; the GEMM kernels'
    W_DESC) instead of pointer loads. Needs contiguous expert weights whose rows (and
    block_k) are multiples of 16 bytes."""


@dataclass(frozen=True)
class FusedMoEConfig:
    """Tile shapes of the two grouped GEMMs (they share block_m: the row blocks are common).

    gemm2_sum: tiles of moe_gemm2_sum_kernel (GEMM 2 + top-k sum in one launch), used when
    N == 1; block_n = output columns per program, block_k = chunk of I (powers of two; block_m,
    group_m unused). None keeps N == 1 on gemm2 + moe_sum."""
    gemm1: MoEGemmConfig
    gemm2: MoEGemmConfig
    gemm2_sum: MoEGemmConfig | None = None


def default_config(num_tokens: int, top_k: int, num_experts: int,
                   dtype: torch.dtype, tma_weights: bool = False) -> FusedMoEConfig:
    """Size classes by rows per expert: decode (weight-bandwidth bound), small, large batches.
    tma_weights: the classes whose row blocks take warpgroup MMA (>= 64 rows) read the weights
    by TMA (MoEGemmConfig.tma_weights)."""
    cfg = _size_class(num_tokens, top_k, num_experts, dtype)
    if tma_weights and cfg.gemm1.block_m >= 64:
        cfg = replace(cfg, gemm1=replace(cfg.gemm1, tma_weights=True),
                      gemm2=replace(cfg.gemm2, tma_weights=True))
    return cfg


def _size_class(num_tokens: int, top_k: int, num_experts: int,
                dtype: torch.dtype) -> FusedMoEConfig:
    if dtype == torch.float32:
        c = MoEGemmConfig(16, 32, 32, 1, 4, 1)
        return FusedMoEConfig(c, c, MoEGemmConfig(1, 16, 32, 1, 4, 1))
    rows_per_expert = num_tokens * top_k / max(1, num_experts)
    if num_tokens <= 8:
        # gemm2_sum: the fastest of bench_layers.py --tune at N=1, D=2304, I=1024, k=8, and
        # faster than gemm2 + moe_sum there. gemm1 block_k 64: faster than 128 in a chain of
        # pdl calls at N=1, k=9 (bench_chain.py). Figures: benchmarks/PERF_NOTES.md.
        return FusedMoEConfig(MoEGemmConfig(16, 32, 64, 1, 4, 4),
                              MoEGemmConfig(16, 32, 128, 1, 4, 4),
                              MoEGemmConfig(1, 8, 1024, 1, 4, 3))
    if num_tokens <= 16:
        # bench_batch.py at N=16 (D=2304, I=1024, 257 experts, k=9): faster than the N=1 tiles
        # both with every token on the same experts and with spread routing
        return FusedMoEConfig(MoEGemmConfig(16, 64, 128, 1, 4, 4),
                              MoEGemmConfig(16, 128, 128, 1, 4, 4))
    if num_tokens <= 64:
        # bench_batch.py at N=32 / 64: one row block per expert holding all N rows when the
        # tokens share their experts (the served dummy model; always true of the folded shared
        # expert), so each weight tile is read once
        bm = next_power_of_2(num_tokens)
        return FusedMoEConfig(MoEGemmConfig(bm, 64, 64, 1, 4, 4),
                              MoEGemmConfig(bm, 128, 64, 1, 4, 4))
    if rows_per_expert <= 32:
        return FusedMoEConfig(MoEGemmConfig(32, 64, 64, 4, 4, 4),
                              MoEGemmConfig(32, 64, 64, 4, 4, 4))
    # the fastest of bench_layers.py --tune at N=8000, D=2304, I=1024, E=256, k=8
    return FusedMoEConfig(MoEGemmConfig(128, 128, 64, 8, 8, 3),
                          MoEGemmConfig(128, 256, 64, 8, 8, 3))


def fit_config(cfg: FusedMoEConfig, hidden: int, inter_size: int) -> FusedMoEConfig:
    """Shrink tiles that exceed the problem (small test models): GEMM 1 is [.., hidden] x
    [hidden, inter], GEMM 2 is [.., inter] x [inter, hidden]. Never below 16 (tl.dot); the
    gemm2_sum GEMV (no tl.dot) shrinks to the next power of two of hidden / inter."""
    def cap(n: int) -> int:
        return max(16, next_power_of_2(n))

    g1, g2, gs = cfg.gemm1, cfg.gemm2, cfg.gemm2_sum
    g1 = replace(g1, block_n=min(g1.block_n, cap(inter_size)), block_k=min(g1.block_k, cap(hidden)))
    g2 = replace(g2, block_n=min(g2.block_n, cap(hidden)), block_k=min(g2.block_k, cap(inter_size)))
    if gs is not None:
        gs = replace(gs, block_n=min(gs.block_n, next_power_of_2(hidden)),
                     block_k=min(gs.block_k, next_power_of_2(inter_size)))
    return FusedMoEConfig(g1, g2, gs)


@dataclass
class MoEAlignment:
    """Routing entries grouped by expert into padded row blocks of block_m (device tensors)."""
    sorted_ids: torch.Tensor     # [max_rows] int32 entry ids (n * top_k + j); padding unset
    expert_ids: torch.Tensor     # [max_blocks] int32 expert of each row block, -1 past the end
    expert_start: torch.Tensor   # [E] int32 first padded row of each expert
    counts: torch.Tensor         # [E] int32 entries per expert
    num_rows: torch.Tensor       # [1] int32 padded rows in use
    max_blocks: int


# Up to this many top-k entries (64 decode tokens x top_k 9, and more), align in one program
# without atomics; entries of an expert then keep entry order. UNMEASURED on a GPU at > 64.
SMALL_ALIGN_ENTRIES = 1024


def small_align_tiles(numel: int) -> tuple[int, int]:
    """(BLOCK_T, num_warps) of moe_align_small_kernel, from the entry count only (CUDA-graph
    safe): BLOCK_T holds every entry; 8 warps from 512 up (at BLOCK_T = 1024 the sm_90 kernel is
    ~2500 straight-line SASS instructions a thread at 8 warps, ~3800 at 4; static count, not
    timed)."""
    block_t = next_power_of_2(max(numel, 16))
    return block_t, 4 if block_t <= 256 else 8


# Every section of the alignment workspace starts at a multiple of this many int32 (128 bytes).
# Triton specialises pointer arguments on 16-byte alignment: sections at offsets that follow the
# token count would make the align and GEMM kernels flip between compiled variants step by step.
ALIGN_WS_ELEMS = 32

ALIGN_WS_SECTIONS = ("counts", "expert_start", "cursor", "num_rows", "expert_ids", "sorted_ids")


def align_workspace_layout(num_experts: int, max_blocks: int,
                           max_rows: int) -> tuple[dict[str, tuple[int, int]], int]:
    """(start, length) in int32 elements of each ALIGN_WS_SECTIONS section of the alignment
    workspace, and the workspace's length. Each section is rounded up to ALIGN_WS_ELEMS, so every
    start is 128-byte aligned whatever the sizes (one kernel specialisation for every step)."""
    lengths = dict(zip(ALIGN_WS_SECTIONS, (num_experts, num_experts, num_experts, 1,
                                           max_blocks, max_rows)))
    layout, pos = {}, 0
    for name, n in lengths.items():
        layout[name] = (pos, n)
        pos += cdiv(n, ALIGN_WS_ELEMS) * ALIGN_WS_ELEMS
    return layout, pos


def moe_align_block_size(topk_ids: torch.Tensor, num_experts: int, block_m: int,
                         pdl: bool = False) -> MoEAlignment:
    """Group the flattened top-k entries by expert, each expert padded to a multiple of block_m.

    Up to SMALL_ALIGN_ENTRIES entries: one launch, an expert's entries in entry order. More: three
    launches with atomics (order inside an expert unspecified). Both fill every MoEAlignment field
    except the padding rows of sorted_ids. pdl: programmatic dependent launch (module docstring);
    on the atomic path the workspace's zero fill is an ordinary launch before the first kernel."""
    require_triton()
    from kdaserve.kernels.moe.triton_moe import (moe_align_small_kernel, moe_count_kernel,
                                                 moe_offsets_kernel, moe_scatter_kernel)

    ids = topk_ids.reshape(-1)
    numel = ids.numel()
    max_rows = numel + min(num_experts, numel) * (block_m - 1)
    max_blocks = max(1, cdiv(max_rows, block_m))
    small = numel <= SMALL_ALIGN_ENTRIES
    # one int32 workspace: counts | expert_start | cursor | num_rows | expert_ids | sorted_ids,
    # each section 128-byte aligned (align_workspace_layout)
    layout, size = align_workspace_layout(num_experts, max_blocks, max_rows)
    alloc = torch.empty if small else torch.zeros     # the atomic path counts from zero
    ws = alloc(size, dtype=torch.int32, device=ids.device)
    counts, expert_start, cursor, num_rows, expert_ids, sorted_ids = (
        ws[a:a + n] for a, n in (layout[name] for name in ALIGN_WS_SECTIONS))
    block_e = next_power_of_2(num_experts)
    pdl_opts = pdl_options(pdl, ids)
    if small:
        block_t, warps = small_align_tiles(numel)
        moe_align_small_kernel[(1,)](ids, counts, expert_start, expert_ids, num_rows, sorted_ids,
                                     numel, num_experts, max_blocks, BLOCK_M=block_m,
                                     BLOCK_T=block_t, BLOCK_E=block_e, num_warps=warps, **pdl_opts)
    else:
        block = 256
        grid = (max(1, cdiv(numel, block)),)
        moe_count_kernel[grid](ids, counts, numel, num_experts, BLOCK=block, **pdl_opts)
        moe_offsets_kernel[(1,)](counts, expert_start, cursor, expert_ids, num_rows,
                                 num_experts, max_blocks, BLOCK_M=block_m, BLOCK_E=block_e,
                                 num_warps=4, **pdl_opts)
        moe_scatter_kernel[grid](ids, cursor, sorted_ids, numel, num_experts, BLOCK=block,
                                 **pdl_opts)
    return MoEAlignment(sorted_ids, expert_ids, expert_start, counts, num_rows, max_blocks)


def _check_moe_inputs(x, w13, w2, topk_weights, topk_ids):
    if x.dim() != 2 or w13.dim() != 3 or w2.dim() != 3:
        raise ValueError(f"expected x [N, D], w13 [E, 2I, D], w2 [E, D, I]; got "
                         f"{tuple(x.shape)}, {tuple(w13.shape)}, {tuple(w2.shape)}")
    N, D = x.shape
    E, two_i, d1 = w13.shape
    if d1 != D or two_i % 2 or w2.shape != (E, D, two_i // 2):
        raise ValueError(f"shape mismatch: x {tuple(x.shape)}, w13 {tuple(w13.shape)}, "
                         f"w2 {tuple(w2.shape)} (want w13 [E, 2I, D], w2 [E, D, I])")
    if topk_ids.dim() != 2 or topk_ids.shape[0] != N or topk_weights.shape != topk_ids.shape:
        raise ValueError(f"topk_ids/topk_weights must be [N={N}, k], got "
                         f"{tuple(topk_ids.shape)}/{tuple(topk_weights.shape)}")
    if x.dtype != w13.dtype or x.dtype != w2.dtype:
        raise ValueError(f"x, w13, w2 dtypes differ: {x.dtype}, {w13.dtype}, {w2.dtype}")
    if topk_ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"topk_ids must be int32/int64, got {topk_ids.dtype}")
    if x.stride(1) != 1 or w13.stride(2) != 1 or w2.stride(2) != 1:
        raise ValueError("x, w13 and w2 need a contiguous last dim")
    for name, t in (("x", x), ("w13", w13), ("w2", w2), ("topk_weights", topk_weights),
                    ("topk_ids", topk_ids)):
        check_kernel_device(t)
        if t.device != x.device:
            raise ValueError(f"{name} is on {t.device}, x on {x.device}")


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor, out: torch.Tensor | None = None,
              config: FusedMoEConfig | None = None, pdl: bool = False,
              tma_weights: bool = False) -> torch.Tensor:
    """Routed SwiGLU experts: out[n] = sum_j w[n, j] * w2[e] @ (silu(gate_e x_n) * up_e x_n).

    x: [N, D]; w13: [E, 2I, D] (rows [0, I) gate, [I, 2I) up); w2: [E, D, I];
    topk_weights: [N, k] (fp32); topk_ids: [N, k] int (ids outside [0, E) contribute nothing).
    Returns [N, D] in x.dtype (into `out` when given). bf16 operands, fp32 accumulation.
    At N == 1 with config.gemm2_sum set (the default), GEMM 2 and the top-k sum are one launch
    that sums the k weighted expert outputs in fp32 and rounds once (the gemm2 + moe_sum path
    rounds each weighted output to x.dtype first).
    pdl: every launch (align, GEMM 1, GEMM 2 + sum or GEMM 2 and moe_sum) with programmatic
    dependent launch (module docstring); same results as pdl=False.
    tma_weights: without a config, default_config's (the wgmma classes read the weights by TMA).
    """
    require_triton()
    _check_moe_inputs(x, w13, w2, topk_weights, topk_ids)
    from kdaserve.kernels.moe.triton_moe import (moe_gemm1_kernel, moe_gemm2_kernel,
                                                 moe_sum_kernel)

    N, D = x.shape
    E, two_i, _ = w13.shape
    inter_size = two_i // 2
    top_k = topk_ids.shape[1]
    if out is None:
        out = torch.empty(N, D, dtype=x.dtype, device=x.device)
    elif out.shape != (N, D) or out.stride(1) != 1:
        raise ValueError(f"out must be [N, D]={N, D} with a contiguous last dim, "
                         f"got {tuple(out.shape)}")
    if N == 0:
        return out
    cfg = config or fit_config(default_config(N, top_k, E, x.dtype, tma_weights), D, inter_size)
    if cfg.gemm1.block_m != cfg.gemm2.block_m:
        raise ValueError(f"gemm1/gemm2 block_m differ: {cfg.gemm1.block_m} != {cfg.gemm2.block_m}")
    _check_gemm2_sum(cfg.gemm2_sum)
    topk_ids = topk_ids.contiguous()
    topk_weights = topk_weights.contiguous()
    # One token: its entries have distinct experts, so each entry is its own row block and the
    # alignment pass (one launch per layer at decode) is skipped.
    direct = N == 1
    pdl_opts = pdl_options(pdl, x)
    if direct:
        blocks, sorted_ids, expert_ids, expert_start, counts, num_rows = \
            top_k, topk_ids, topk_ids, topk_ids, topk_ids, topk_ids
    else:
        align = moe_align_block_size(topk_ids, E, cfg.gemm1.block_m, pdl=pdl)
        blocks, sorted_ids, expert_ids, expert_start, counts, num_rows = \
            align.max_blocks, align.sorted_ids, align.expert_ids, align.expert_start, \
            align.counts, align.num_rows
    precision = "ieee" if x.dtype == torch.float32 else "tf32"

    inter = torch.empty(N * top_k, inter_size, dtype=x.dtype, device=x.device)  # [N*k, I]
    c1 = cfg.gemm1
    moe_gemm1_kernel[(blocks * cdiv(inter_size, c1.block_n),)](
        x, _weights(w13, c1), inter, sorted_ids, expert_ids, expert_start, counts, num_rows,
        inter_size, D, top_k, blocks, E,
        x.stride(0), w13.stride(0), w13.stride(1), w13.stride(2), inter.stride(0),
        BLOCK_M=c1.block_m, BLOCK_N=c1.block_n, BLOCK_K=c1.block_k, GROUP_M=c1.group_m,
        DOT_PRECISION=precision, DIRECT=direct, EVEN_K=D % c1.block_k == 0,
        EVEN_N=inter_size % c1.block_n == 0, num_warps=c1.num_warps,
        num_stages=c1.num_stages, W_DESC=c1.tma_weights, **pdl_opts,
    )
    if direct and cfg.gemm2_sum is not None:
        return _gemm2_sum(inter, w2, topk_weights, topk_ids, out, cfg.gemm2_sum, pdl)
    buf = torch.empty(N * top_k, D, dtype=x.dtype, device=x.device)             # [N*k, D]
    c2 = cfg.gemm2
    moe_gemm2_kernel[(blocks * cdiv(D, c2.block_n),)](
        inter, _weights(w2, c2), buf, topk_weights, sorted_ids, expert_ids, expert_start, counts,
        num_rows,
        D, inter_size, blocks, E,
        inter.stride(0), w2.stride(0), w2.stride(1), w2.stride(2), buf.stride(0),
        BLOCK_M=c2.block_m, BLOCK_N=c2.block_n, BLOCK_K=c2.block_k, GROUP_M=c2.group_m,
        DOT_PRECISION=precision, DIRECT=direct, EVEN_K=inter_size % c2.block_k == 0,
        EVEN_N=D % c2.block_n == 0, num_warps=c2.num_warps,
        num_stages=c2.num_stages, W_DESC=c2.tma_weights, **pdl_opts,
    )
    block_d = min(1024, next_power_of_2(D))
    moe_sum_kernel[(N, cdiv(D, block_d))](buf, topk_ids, out, D, E, top_k,
                                          buf.stride(0), out.stride(0), BLOCK_D=block_d,
                                          num_warps=4, **pdl_opts)
    return out


def _weights(w: torch.Tensor, cfg: MoEGemmConfig):
    """The GEMM kernels' weight argument: w itself, or with cfg.tma_weights a TMA descriptor of
    w as [E * rows, K] in [block_n, block_k] tiles (the kernels' W_DESC)."""
    if not cfg.tma_weights:
        return w
    from triton.tools.tensor_descriptor import TensorDescriptor

    E, rows, K = w.shape
    if w.stride(1) != K or w.stride(0) != rows * K:
        raise ValueError(f"tma_weights needs contiguous expert weights, got strides "
                         f"{tuple(w.stride())} for shape {tuple(w.shape)}")
    if cfg.block_k * w.element_size() < 16 or K * w.element_size() % 16:
        raise ValueError(f"tma_weights needs weight rows of a multiple of 16 bytes and tiles of "
                         f">= 16 bytes ({w.element_size()} bytes an element), got K={K}, "
                         f"block_k={cfg.block_k}")
    flat = w.view(E * rows, K)                                           # [E * rows, K]
    return TensorDescriptor(flat, list(flat.shape), list(flat.stride()),
                            [cfg.block_n, cfg.block_k])


def _check_gemm2_sum(cfg: MoEGemmConfig | None) -> None:
    """block_n / block_k of the gemm2_sum GEMV are tl.arange sizes: powers of two."""
    if cfg is None:
        return
    for name in ("block_n", "block_k"):
        v = getattr(cfg, name)
        if v < 1 or v & (v - 1):
            raise ValueError(f"gemm2_sum.{name} must be a power of two, got {v}")


def _gemm2_sum(inter: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
               topk_ids: torch.Tensor, out: torch.Tensor, cfg: MoEGemmConfig,
               pdl: bool = False) -> torch.Tensor:
    """One token: out[0] = sum_j topk_weights[0, j] * w2[e_j] @ inter[j] in one launch.

    inter: [k, I] (last dim contiguous); w2: [E, D, I]; topk_weights, topk_ids: [1, k]
    contiguous; out: [1, D]. Inputs and tiles are checked by fused_moe. pdl: launch with
    programmatic dependent launch (module docstring)."""
    from kdaserve.kernels.moe.triton_moe import moe_gemm2_sum_kernel

    E, D, inter_size = w2.shape
    moe_gemm2_sum_kernel[(cdiv(D, cfg.block_n),)](
        inter, w2, out, topk_weights, topk_ids,
        D, inter_size, topk_ids.shape[1], E,
        inter.stride(0), w2.stride(0), w2.stride(1),
        BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, NUM_STAGES=cfg.num_stages,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pdl_options(pdl, inter),
    )
    return out
