"""Triton kernels of the one-token MoE expert path (imported lazily by single_token.py).

Batch-1 decode reads each routed expert's weights once for one activation row, so the work is
k matrix-vector products: no tensor-core tile (padded to 16 rows, 15 of them empty) is used.
  1. moe_single_gemv1_kernel   inter[j] = silu(w_gate[e_j] @ x) * (w_up[e_j] @ x)     [k, I]
  2. moe_single_gemv2_kernel   out = sum_j w_j * w2[e_j] @ inter[j]                     [1, D]
Step 2 owns a slice of output columns and loops over all k entries itself, so the top-k sum
needs neither a [k, D] buffer nor atomics: the order of the sum is fixed (deterministic).
Entries whose expert id is outside [0, E) contribute nothing (their weight loads are masked).
"""

import triton
import triton.language as tl


@triton.jit
def _expert(topk_ids_ptr, j, num_experts):
    """(expert id as int64, clamped to 0 when invalid; valid flag) of routing entry j."""
    e = tl.load(topk_ids_ptr + j).to(tl.int64)
    valid = (e >= 0) & (e < num_experts)
    return tl.where(valid, e, 0), valid


@triton.jit
def moe_single_gemv1_kernel(
    x_ptr, w13_ptr, inter_ptr, topk_ids_ptr,
    inter_size, hidden, num_experts,
    stride_we, stride_wn, stride_im,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """Program (j, nb): rows [nb*BLOCK_N, +BLOCK_N) of entry j's gate and up projections.

    Weight tiles are [BLOCK_N, BLOCK_K], contiguous along hidden (coalesced); products are
    accumulated elementwise in fp32 and reduced over BLOCK_K once, after the loop."""
    j = tl.program_id(0)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < inter_size
    e, valid = _expert(topk_ids_ptr, j, num_experts)
    offs_k = tl.arange(0, BLOCK_K)
    g_ptrs = w13_ptr + e * stride_we + offs_n[:, None] * stride_wn + offs_k[None, :]  # [BN, BK]
    u_ptrs = g_ptrs + inter_size * stride_wn
    acc_g = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    for k0 in range(0, hidden, BLOCK_K):
        mask_k = offs_k < hidden - k0
        xk = tl.load(x_ptr + k0 + offs_k, mask=mask_k, other=0.0).to(tl.float32)      # [BK]
        mask_w = (mask_n[:, None] & mask_k[None, :]) & valid
        wg = tl.load(g_ptrs, mask=mask_w, other=0.0)
        wu = tl.load(u_ptrs, mask=mask_w, other=0.0)
        acc_g += wg.to(tl.float32) * xk[None, :]
        acc_u += wu.to(tl.float32) * xk[None, :]
        g_ptrs += BLOCK_K
        u_ptrs += BLOCK_K
    g = tl.sum(acc_g, axis=1)                                                       # [BN]
    u = tl.sum(acc_u, axis=1)
    h = g / (1.0 + tl.exp(-g)) * u                                                  # SwiGLU
    tl.store(inter_ptr + j * stride_im + offs_n, h.to(inter_ptr.dtype.element_ty), mask=mask_n)


@triton.jit
def moe_single_gemv2_kernel(
    inter_ptr, w2_ptr, topk_weights_ptr, topk_ids_ptr, out_ptr,
    hidden, inter_size, top_k, num_experts,
    stride_im, stride_we, stride_wd,
    BLOCK_D: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """Program d: output columns [d*BLOCK_D, +BLOCK_D), summed over all k entries.

    One flat runtime loop over (entry j, chunk of inter_size) pairs, so the weight stream is a
    single loop the compiler can pipeline; w2 tiles are [BLOCK_D, BLOCK_K], contiguous along
    inter_size. The routing weight scales the [BLOCK_K] activation chunk, not the tile."""
    offs_d = tl.program_id(0) * BLOCK_D + tl.arange(0, BLOCK_D)
    mask_d = offs_d < hidden
    offs_k = tl.arange(0, BLOCK_K)
    chunks = tl.cdiv(inter_size, BLOCK_K)
    acc = tl.zeros([BLOCK_D, BLOCK_K], dtype=tl.float32)
    for t in range(0, top_k * chunks):
        j = t // chunks
        i0 = (t - j * chunks) * BLOCK_K
        e, valid = _expert(topk_ids_ptr, j, num_experts)
        route_w = tl.load(topk_weights_ptr + j, mask=valid, other=0.0).to(tl.float32)
        mask_k = offs_k < inter_size - i0
        h = tl.load(inter_ptr + j * stride_im + i0 + offs_k, mask=mask_k, other=0.0)   # [BK]
        h = h.to(tl.float32) * route_w
        w_ptrs = (w2_ptr + e * stride_we + offs_d[:, None] * stride_wd
                  + (i0 + offs_k)[None, :])                                           # [BD, BK]
        w = tl.load(w_ptrs, mask=(mask_d[:, None] & mask_k[None, :]) & valid, other=0.0)
        acc += w.to(tl.float32) * h[None, :]
    y = tl.sum(acc, axis=1)                                                         # [BD]
    tl.store(out_ptr + offs_d, y.to(out_ptr.dtype.element_ty), mask=mask_d)
