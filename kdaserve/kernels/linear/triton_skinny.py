"""Triton kernel of the skinny GEMM y = x @ weight.T for 3..64 rows (imported lazily by
skinny.py)."""

import triton
import triton.language as tl


@triton.jit(do_not_specialize=["M"])   # M follows the batch: one build per BLOCK_M
def skinny_gemm_kernel(x_ptr, w_ptr, out_ptr, M, N, K, stride_xm, stride_wn, stride_om,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                       EVEN_K: tl.constexpr, STAGES: tl.constexpr,
                       USE_PDL: tl.constexpr = False, PREFETCH: tl.constexpr = 0):
    """One program per BLOCK_N output columns, all M (<= BLOCK_M) rows, the whole K (no
    split-K): each step multiplies the [BLOCK_M, BLOCK_K] x tile by the [BLOCK_K, BLOCK_N]
    transposed weight tile on the tensor cores (fp32 accumulation), so every weight element is
    read from HBM once whatever M is. x rows past M load as zeros and are not stored; weight
    rows past N read row N - 1 (clamped: no N mask on the weight stream) and are not stored.

    STAGES: tiles in flight through shared memory (tl.range num_stages): the weight stream is
    the whole cost, so the depth decides how many bytes each SM keeps in flight.
    USE_PDL (programmatic dependent launch, sm_90+): griddepcontrol.wait before the first x
    load (x is the previous kernel's output), launch_dependents right after it.
    PREFETCH (0 or 1): the first weight tile is loaded before the wait and held in registers
    (weights are immutable), so it streams while the previous kernel finishes; the K steps are
    reduced in the same order either way, so the results do not depend on it.
    """
    pid = tl.program_id(0)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)                   # [BLOCK_N]
    rows = tl.minimum(offs_n, N - 1).to(tl.int64)
    offs_m = tl.arange(0, BLOCK_M)                                   # [BLOCK_M]
    m_mask = offs_m < M
    offs_k = tl.arange(0, BLOCK_K)                                   # [BLOCK_K]
    w_ptrs = w_ptr + rows[:, None] * stride_wn + offs_k[None, :]     # [BLOCK_N, BLOCK_K]
    x_ptrs = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm + offs_k[None, :]  # [BM, BK]
    if PREFETCH:
        if EVEN_K:
            w0 = tl.load(w_ptrs)                                     # [BLOCK_N, BLOCK_K]
        else:
            w0 = tl.load(w_ptrs, mask=(offs_k < K)[None, :], other=0.0)
    if USE_PDL:
        tl.extra.cuda.gdc_wait()                  # the previous kernel's writes are visible
        tl.extra.cuda.gdc_launch_dependents()     # the next PDL kernel may start its preamble
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)             # acc[m, n]
    if PREFETCH:
        if EVEN_K:
            x0 = tl.load(x_ptrs, mask=m_mask[:, None], other=0.0)    # [BLOCK_M, BLOCK_K]
        else:
            x0 = tl.load(x_ptrs, mask=m_mask[:, None] & (offs_k < K)[None, :], other=0.0)
        acc = tl.dot(x0, tl.trans(w0), acc)
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
    for k0 in tl.range(PREFETCH * BLOCK_K, K, BLOCK_K, num_stages=STAGES):
        if EVEN_K:
            w = tl.load(w_ptrs)                                      # [BLOCK_N, BLOCK_K]
            xm = tl.load(x_ptrs, mask=m_mask[:, None], other=0.0)    # [BLOCK_M, BLOCK_K]
        else:
            k_mask = (k0 + offs_k) < K
            w = tl.load(w_ptrs, mask=k_mask[None, :], other=0.0)
            xm = tl.load(x_ptrs, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        acc = tl.dot(xm, tl.trans(w), acc)                           # [BLOCK_M, BLOCK_N]
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
    out_ptrs = out_ptr + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty),
             mask=m_mask[:, None] & (offs_n[None, :] < N))
