"""Triton kernel of the decode GEMV y = x @ weight.T (imported lazily by gemv.py)."""

import triton
import triton.language as tl


@triton.jit
def gemv_kernel(x_ptr, w_ptr, out_ptr, N, K, stride_xm, stride_wn, stride_om,
                M: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr):
    """One program per BLOCK_N output columns, all M (<= 4) rows, the whole K (no split-K).

    Each [BLOCK_N, BLOCK_K] weight tile is loaded once (coalesced along K) and reduced against
    every x row in fp32 on the CUDA cores: M is far below the 16 rows a tensor-core MMA needs.
    Rows past N read row N - 1 (clamped, so weight loads need no N mask) and are not stored.
    """
    pid = tl.program_id(0)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)                   # [BLOCK_N]
    rows = tl.minimum(offs_n, N - 1).to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K)                                   # [BLOCK_K]
    offs_m = tl.arange(0, BLOCK_M)                                   # [BLOCK_M]
    w_ptrs = w_ptr + rows[:, None] * stride_wn + offs_k[None, :]     # [BLOCK_N, BLOCK_K]
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)             # acc[n, m]
    for k0 in range(0, K, BLOCK_K):
        k_mask = (k0 + offs_k) < K                                   # [BLOCK_K]
        if EVEN_K:
            w = tl.load(w_ptrs)
        else:
            w = tl.load(w_ptrs, mask=k_mask[None, :], other=0.0)
        w = w.to(tl.float32)                                         # [BLOCK_N, BLOCK_K]
        for m in tl.static_range(M):
            x_ptrs = x_ptr + m * stride_xm + k0 + offs_k
            if EVEN_K:
                xm = tl.load(x_ptrs)
            else:
                xm = tl.load(x_ptrs, mask=k_mask, other=0.0)
            part = tl.sum(w * xm.to(tl.float32)[None, :], axis=1)     # [BLOCK_N]
            acc += tl.where(offs_m[None, :] == m, part[:, None], 0.0)
        w_ptrs += BLOCK_K
    out_ptrs = out_ptr + offs_m[None, :] * stride_om + offs_n[:, None]
    mask = (offs_n[:, None] < N) & (offs_m[None, :] < M)
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)
