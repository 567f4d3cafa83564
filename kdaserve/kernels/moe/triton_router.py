"""Triton kernels of the router (imported lazily by router.py): the sigmoid top-k selection, the
split-K partial logits of few-token steps, and the logits GEMM of many-token steps."""

import triton
import triton.language as tl

from kdaserve.kernels.triton_pdl import pdl_wait


# num_parts and stride_lp follow the step's token count (router_partials' split plan): no
# value specialisation, so a new batch size does not compile a new variant
@triton.jit(do_not_specialize=["num_parts", "stride_lp"])
def topk_sigmoid_kernel(logits_ptr, bias_ptr, weights_ptr, ids_ptr, num_experts, stride_lt,
                        scaling, num_parts, stride_lp,
                        TOP_K: tl.constexpr, RENORMALIZE: tl.constexpr, HAS_BIAS: tl.constexpr,
                        BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr,
                        EXTRA_ID: tl.constexpr = -1, USE_PDL: tl.constexpr = False):
    """One token per program: from its logits row [num_experts], sigmoid, selection bias, top-k
    selection, renormalise, scale; stores TOP_K (weight, id) pairs. With EXTRA_ID >= 0
    one more column (weight 1, id EXTRA_ID) follows: the shared expert folded into the routed
    ones. The row is the sum of num_parts partial rows stride_lp apart (router_partials_kernel's
    K splits, added in split order; 1 for plain logits).

    One row per program: a 2-D [tokens, experts] tile per program was slower (it spent most of
    its time on cross-warp reductions).

    The selection is one partial bitonic sort (tl.topk, BLOCK_K <= BLOCK_E) of int64 keys, the
    selection score's order-preserving bits above the inverted expert index: descending score,
    ties to the lowest index (as TOP_K argmax rounds would pick them), in fewer instructions and
    shuffle rounds than those dependent rounds (which it replaced: benchmarks/PERF_NOTES.md).

    USE_PDL (programmatic dependent launch): only the selection bias (immutable) is read before
    griddepcontrol.wait; the logits and every store come after it."""
    row = tl.program_id(0).to(tl.int64)
    offs_e = tl.arange(0, BLOCK_E)
    mask_e = offs_e < num_experts
    bias = 0.0                                  # unused unless HAS_BIAS
    if USE_PDL:
        if HAS_BIAS:   # the bias is immutable: load it while the previous kernel finishes
            bias = tl.load(bias_ptr + offs_e, mask=mask_e, other=0.0)
        tl.extra.cuda.gdc_wait()                  # the previous kernel's writes are visible
        tl.extra.cuda.gdc_launch_dependents()     # the next PDL kernel may start its preamble
    row_ptr = logits_ptr + row * stride_lt + offs_e
    logits = tl.load(row_ptr, mask=mask_e, other=0.0).to(tl.float32)
    for s in range(1, num_parts):
        logits += tl.load(row_ptr + s * stride_lp, mask=mask_e, other=0.0).to(tl.float32)
    scores = tl.sigmoid(logits)                                     # [BLOCK_E]
    select = scores
    if HAS_BIAS:
        if not USE_PDL:
            bias = tl.load(bias_ptr + offs_e, mask=mask_e, other=0.0)
        select += bias.to(tl.float32)
    select = tl.where(mask_e, select, float("-inf"))
    offs_k = tl.arange(0, BLOCK_K)
    bits = select.to(tl.int32, bitcast=True)
    bits = bits ^ ((bits >> 31) & 0x7FFFFFFF)            # signed-int order = float order
    key = (bits.to(tl.int64) << 32) | (BLOCK_E - 1 - offs_e).to(tl.int64)      # [BLOCK_E]
    top = tl.topk(key, BLOCK_K)                                     # [BLOCK_K], descending
    ids = (BLOCK_E - 1 - (top & 0xFFFFFFFF)).to(tl.int32)
    keep = offs_k < TOP_K
    w_row = tl.where(keep, tl.gather(scores, ids, 0), 0.0)
    id_row = tl.where(keep, ids, 0)
    if RENORMALIZE:
        w_row = w_row / (tl.sum(w_row, axis=0) + 1e-20)
    w_row = w_row * scaling
    OUT_K: tl.constexpr = TOP_K + 1 if EXTRA_ID >= 0 else TOP_K
    if EXTRA_ID >= 0:
        extra = offs_k == TOP_K
        w_row = tl.where(extra, 1.0, w_row)
        id_row = tl.where(extra, EXTRA_ID, id_row)
    out_mask = offs_k < OUT_K
    tl.store(weights_ptr + row * OUT_K + offs_k, w_row, mask=out_mask)
    tl.store(ids_ptr + row * OUT_K + offs_k, id_row.to(ids_ptr.dtype.element_ty), mask=out_mask)


@triton.jit(do_not_specialize=["N"])   # one build whatever the step's token count
def router_logits_kernel(x_ptr, w_ptr, out_ptr, N, E, D, stride_xm, stride_we, stride_om,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                         EVEN_K: tl.constexpr, USE_PDL: tl.constexpr = False):
    """out[N, E] = x[N, D] (bf16) @ w[E, D].T (fp32) in fp32, on the tensor cores.

    Each fp32 weight tile is split in registers into three bf16 tiles, w = hi + mid + lo
    exactly (8 + 8 + 8 mantissa bits): the three bf16 x bf16 products are exact in fp32. The
    tensor cores' own accumulation keeps fewer bits than an fp32 add (a tile accumulated over
    the whole of K lands measurably further from the exact result than cuBLAS's fp32 GEMM:
    benchmarks/PERF_NOTES.md), so each BLOCK_K step's products sum into a fresh tile that is
    then added to the running sum with ordinary fp32 adds. The logits are those of an fp32
    GEMM of the widened x up to rounding. One program per [BLOCK_M, BLOCK_N] output tile."""
    pdl_wait(USE_PDL)
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    mask_m, mask_n = offs_m < N, offs_n < E
    a_ptrs = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm + offs_k[None, :]     # [BM, BK]
    b_ptrs = w_ptr + offs_n[None, :] * stride_we + offs_k[:, None]                  # [BK, BN]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, D, BLOCK_K):
        if EVEN_K:
            a = tl.load(a_ptrs, mask=mask_m[:, None], other=0.0)
            b = tl.load(b_ptrs, mask=mask_n[None, :], other=0.0)
        else:
            mask_k = offs_k < D - k0
            a = tl.load(a_ptrs, mask=mask_m[:, None] & mask_k[None, :], other=0.0)
            b = tl.load(b_ptrs, mask=mask_k[:, None] & mask_n[None, :], other=0.0)
        hi = b.to(tl.bfloat16)
        r = b - hi.to(tl.float32)
        mid = r.to(tl.bfloat16)
        lo = (r - mid.to(tl.float32)).to(tl.bfloat16)
        part = tl.dot(a, lo)
        part = tl.dot(a, mid, part)
        part = tl.dot(a, hi, part)
        acc += part
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    o_ptrs = out_ptr + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :]
    tl.store(o_ptrs, acc, mask=mask_m[:, None] & mask_n[None, :])


@triton.jit(do_not_specialize=["N", "k_split", "stride_ps"])   # one build per model
def router_partials_kernel(x_ptr, w_ptr, part_ptr, N, E, D, k_split, stride_xm, stride_we,
                           stride_ps, stride_pm,
                           BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                           EVEN_K: tl.constexpr, STAGES: tl.constexpr,
                           USE_PDL: tl.constexpr = False):
    """part[s, n, e] = sum over k in [s * k_split, min((s + 1) * k_split, D)) of
    x[n, k] * w[e, k]: bf16 x against the fp32 router weight with fp32 FMAs on the CUDA cores
    (each product exact, the sums in fp32 like an fp32 GEMM's), one program per (BLOCK_M rows,
    BLOCK_N experts, K split). The products accumulate elementwise in a [BLOCK_M, BLOCK_N,
    BLOCK_K] tile reduced over K once, after the loop. The splits are what gives a few-token
    step enough programs (16 rows x 256 experts are 32 tiles); topk_sigmoid_kernel adds them.
    Rows past N and experts past E load clamped rows and are not stored. EVEN_K: D is a
    multiple of BLOCK_K (k_split always is), so no K mask. STAGES: software pipelining of the K
    loop (tl.range), as in the decode GEMV."""
    pdl_wait(USE_PDL)
    pid_m, pid_n, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    rows_m = tl.minimum(offs_m, N - 1).to(tl.int64)
    rows_n = tl.minimum(offs_n, E - 1).to(tl.int64)
    k_lo = split * k_split
    k_hi = tl.minimum(k_lo + k_split, D)
    x_ptrs = x_ptr + rows_m[:, None] * stride_xm + (k_lo + offs_k)[None, :]     # [BM, BK]
    w_ptrs = w_ptr + rows_n[:, None] * stride_we + (k_lo + offs_k)[None, :]     # [BN, BK]
    acc = tl.zeros([BLOCK_M, BLOCK_N, BLOCK_K], dtype=tl.float32)
    for k0 in tl.range(k_lo, k_hi, BLOCK_K, num_stages=STAGES):
        if EVEN_K:
            x = tl.load(x_ptrs)
            w = tl.load(w_ptrs)
        else:
            mask_k = (k0 + offs_k) < k_hi
            x = tl.load(x_ptrs, mask=mask_k[None, :], other=0.0)
            w = tl.load(w_ptrs, mask=mask_k[None, :], other=0.0)
        acc += x.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :]
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    out = tl.sum(acc, axis=2)                                                   # [BM, BN]
    o_ptrs = part_ptr + split * stride_ps + offs_m[:, None].to(tl.int64) * stride_pm \
        + offs_n[None, :]
    tl.store(o_ptrs, out, mask=(offs_m < N)[:, None] & (offs_n < E)[None, :])
