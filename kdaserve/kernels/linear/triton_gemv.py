"""Triton kernel of the decode GEMV y = x @ weight.T (imported lazily by gemv.py)."""

import triton
import triton.language as tl


@triton.jit
def _load_tile(w_ptrs, k0, offs_k, K, EVEN_K: tl.constexpr):
    """The [BLOCK_N, BLOCK_K] weight tile at K offset k0, in the weight's dtype (zeros past K)."""
    if EVEN_K:
        w = tl.load(w_ptrs)
    else:
        w = tl.load(w_ptrs, mask=((k0 + offs_k) < K)[None, :], other=0.0)
    return w


@triton.jit
def _load_x(x_ptrs, k_mask, EVEN_K: tl.constexpr):
    if EVEN_K:
        xm = tl.load(x_ptrs)
    else:
        xm = tl.load(x_ptrs, mask=k_mask, other=0.0)
    return xm


@triton.jit
def _tanh(z):
    e = tl.exp(-2.0 * tl.abs(z))                 # in (0, 1]: no overflow
    t = (1.0 - e) / (1.0 + e)
    return tl.where(z >= 0, t, -t)


@triton.jit
def _accumulate(acc, w, x_ptr, k0, offs_k, offs_m, K, stride_xm, M: tl.constexpr,
                EVEN_K: tl.constexpr, SWIGLU: tl.constexpr, SITU: tl.constexpr = False,
                SITU_BETA: tl.constexpr = 1.0, SITU_LINEAR_BETA: tl.constexpr = 0.0):
    """acc[n, m] += sum_k w[n, k] * x[m, k0 + k] in fp32 for every x row m < M; returns acc.
    SWIGLU: x row m is [gate (K) | up (K)] and its value at k is silu(gate) * up (fp32,
    rounded once to x's dtype, as a separate silu-and-mul launch would store it); with SITU,
    Kimi K3's SiTU instead: SITU_BETA * tanh(gate / SITU_BETA) * sigmoid(gate) * up', up' =
    SITU_LINEAR_BETA * tanh(up / SITU_LINEAR_BETA) (up itself when SITU_LINEAR_BETA is 0)."""
    k_mask = (k0 + offs_k) < K                                       # [BLOCK_K]
    w = w.to(tl.float32)                                             # [BLOCK_N, BLOCK_K]
    for m in tl.static_range(M):
        x_ptrs = x_ptr + m * stride_xm + k0 + offs_k
        xm = _load_x(x_ptrs, k_mask, EVEN_K)                         # [BLOCK_K]
        if SWIGLU:
            g = xm.to(tl.float32)
            u = _load_x(x_ptrs + K, k_mask, EVEN_K).to(tl.float32)
            if SITU:
                if SITU_LINEAR_BETA != 0.0:
                    u = SITU_LINEAR_BETA * _tanh(u / SITU_LINEAR_BETA)
                xm = (SITU_BETA * _tanh(g / SITU_BETA) / (1.0 + tl.exp(-g)) * u
                      ).to(x_ptr.dtype.element_ty)
            else:
                xm = (g / (1.0 + tl.exp(-g)) * u).to(x_ptr.dtype.element_ty)
        part = tl.sum(w * xm.to(tl.float32)[None, :], axis=1)         # [BLOCK_N]
        acc += tl.where(offs_m[None, :] == m, part[:, None], 0.0)
    return acc


@triton.jit
def gemv_kernel(x_ptr, w_ptr, out_ptr, N, K, stride_xm, stride_wn, stride_om,
                stride_xb, stride_wb, stride_ob, M: tl.constexpr, BLOCK_M: tl.constexpr,
                BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
                PREFETCH: tl.constexpr = 0, USE_PDL: tl.constexpr = False,
                STAGES: tl.constexpr = 1, SWIGLU: tl.constexpr = False,
                SITU: tl.constexpr = False, SITU_BETA: tl.constexpr = 1.0,
                SITU_LINEAR_BETA: tl.constexpr = 0.0):
    """One program per BLOCK_N output columns, all M (<= 4) rows, the whole K (no split-K);
    grid axis 1 runs batch entries (x, w and out each offset by their stride_*b).

    Each [BLOCK_N, BLOCK_K] weight tile is loaded once (coalesced along K) and reduced against
    every x row in fp32 on the CUDA cores: M is far below the 16 rows a tensor-core MMA needs.
    Rows past N read row N - 1 (clamped, so weight loads need no N mask) and are not stored.

    PREFETCH (0..2, <= the number of K steps): the first PREFETCH weight tiles are loaded before
    anything else and held in registers; with USE_PDL (programmatic dependent launch, sm_90+)
    griddepcontrol.wait follows them, so they stream while the previous kernel finishes, and
    griddepcontrol.launch_dependents follows the wait. Nothing that another kernel writes (x)
    is read, and nothing is written, before the wait. The K steps are reduced in the same order
    whatever PREFETCH is (the prefetched tiles first), so results do not depend on it.

    SWIGLU: x rows are [gate | up] (2K wide) and the product reads silu(gate) * up
    (_accumulate): a SwiGLU MLP's down projection without a separate activation launch; with
    SITU the activation is Kimi K3's SiTU (SITU_BETA, SITU_LINEAR_BETA; 0: up unclipped).

    STAGES: software pipelining of the K loop (tl.range num_stages: the next STAGES - 1 weight
    tiles are in flight, through shared memory, while one is reduced). Triton pipelines only
    loads that feed a tl.dot on its own, so the launch's num_stages alone left this loop with
    one tile in flight per program. Same reduction order, same results, whatever STAGES is.
    """
    pid = tl.program_id(0)
    batch = tl.program_id(1).to(tl.int64)      # batch entry (0 for a plain GEMV)
    x_ptr += batch * stride_xb
    w_ptr += batch * stride_wb
    out_ptr += batch * stride_ob
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)                   # [BLOCK_N]
    rows = tl.minimum(offs_n, N - 1).to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K)                                   # [BLOCK_K]
    offs_m = tl.arange(0, BLOCK_M)                                   # [BLOCK_M]
    w_ptrs = w_ptr + rows[:, None] * stride_wn + offs_k[None, :]     # [BLOCK_N, BLOCK_K]
    if PREFETCH >= 1:   # weights are immutable: safe to read before the wait
        w0 = _load_tile(w_ptrs, 0, offs_k, K, EVEN_K)                # [BLOCK_N, BLOCK_K]
    if PREFETCH >= 2:
        w1 = _load_tile(w_ptrs + BLOCK_K, BLOCK_K, offs_k, K, EVEN_K)
    if USE_PDL:
        tl.extra.cuda.gdc_wait()                  # the previous kernel's writes are visible
        tl.extra.cuda.gdc_launch_dependents()     # the next PDL kernel may start its preamble
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)             # acc[n, m]
    if PREFETCH >= 1:
        acc = _accumulate(acc, w0, x_ptr, 0, offs_k, offs_m, K, stride_xm, M, EVEN_K,
                          SWIGLU, SITU, SITU_BETA, SITU_LINEAR_BETA)
    if PREFETCH >= 2:
        acc = _accumulate(acc, w1, x_ptr, BLOCK_K, offs_k, offs_m, K, stride_xm, M, EVEN_K,
                          SWIGLU, SITU, SITU_BETA, SITU_LINEAR_BETA)
    if PREFETCH > 0:
        w_ptrs += PREFETCH * BLOCK_K
    for k0 in tl.range(PREFETCH * BLOCK_K, K, BLOCK_K, num_stages=STAGES):
        w = _load_tile(w_ptrs, k0, offs_k, K, EVEN_K)                # [BLOCK_N, BLOCK_K]
        acc = _accumulate(acc, w, x_ptr, k0, offs_k, offs_m, K, stride_xm, M, EVEN_K,
                          SWIGLU, SITU, SITU_BETA, SITU_LINEAR_BETA)
        w_ptrs += BLOCK_K
    out_ptrs = out_ptr + offs_m[None, :] * stride_om + offs_n[:, None]
    mask = (offs_n[:, None] < N) & (offs_m[None, :] < M)
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)
