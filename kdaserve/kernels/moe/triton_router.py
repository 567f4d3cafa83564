"""Triton kernel of the sigmoid top-k router (imported lazily by router.py)."""

import triton
import triton.language as tl


@triton.jit
def _route_row(logits, mask_e, offs_e, bias_ptr, weights_ptr, ids_ptr, row, scaling,
               TOP_K: tl.constexpr, RENORMALIZE: tl.constexpr, HAS_BIAS: tl.constexpr,
               BLOCK_K: tl.constexpr, EXTRA_ID: tl.constexpr):
    """One token's routing from its logits [BLOCK_E]: sigmoid, selection bias, TOP_K rounds of
    argmax, renormalise, scale; stores TOP_K (weight, id) pairs (+ the extra column)."""
    scores = tl.sigmoid(logits.to(tl.float32))                      # [BLOCK_E]
    select = scores
    if HAS_BIAS:
        select += tl.load(bias_ptr + offs_e, mask=mask_e, other=0.0).to(tl.float32)
    select = tl.where(mask_e, select, float("-inf"))
    offs_k = tl.arange(0, BLOCK_K)
    w_row = tl.zeros([BLOCK_K], dtype=tl.float32)
    id_row = tl.zeros([BLOCK_K], dtype=tl.int32)
    for j in tl.static_range(TOP_K):                                # k rounds of argmax
        best = tl.argmax(select, axis=0)
        hit = offs_e == best
        w = tl.sum(tl.where(hit, scores, 0.0), axis=0)
        w_row = tl.where(offs_k == j, w, w_row)
        id_row = tl.where(offs_k == j, best.to(tl.int32), id_row)
        select = tl.where(hit, float("-inf"), select)
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


@triton.jit
def topk_sigmoid_kernel(logits_ptr, bias_ptr, weights_ptr, ids_ptr, num_experts, stride_lt,
                        scaling,
                        TOP_K: tl.constexpr, RENORMALIZE: tl.constexpr, HAS_BIAS: tl.constexpr,
                        BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr,
                        EXTRA_ID: tl.constexpr = -1):
    """One token per program: TOP_K (weight, id) pairs; with EXTRA_ID >= 0 one more column
    (weight 1, id EXTRA_ID) follows: the shared expert folded into the routed ones.

    One row per program keeps every reduction inside one or two warps: the 2-D [tokens,
    experts] tile this replaced spent ~25 us per decode step on cross-warp argmax rounds."""
    row = tl.program_id(0).to(tl.int64)
    offs_e = tl.arange(0, BLOCK_E)
    mask_e = offs_e < num_experts
    logits = tl.load(logits_ptr + row * stride_lt + offs_e, mask=mask_e, other=0.0)
    _route_row(logits, mask_e, offs_e, bias_ptr, weights_ptr, ids_ptr, row, scaling,
               TOP_K, RENORMALIZE, HAS_BIAS, BLOCK_K, EXTRA_ID)


@triton.jit
def router_gemv_topk_kernel(x_ptr, w_ptr, bias_ptr, logits_ptr, counter_ptr, weights_ptr,
                            ids_ptr, num_tokens, num_experts, hidden, stride_xn, stride_we,
                            scaling,
                            TOP_K: tl.constexpr, RENORMALIZE: tl.constexpr,
                            HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr,
                            BLOCK_EX: tl.constexpr, BLOCK_D: tl.constexpr,
                            BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr,
                            EXTRA_ID: tl.constexpr = -1):
    """Router GEMV and top-k in one launch, for a few tokens (decode). Program p computes the
    fp32 logits of experts [p * BLOCK_EX, (p + 1) * BLOCK_EX) for every token into the scratch
    [BLOCK_N, BLOCK_E], then counts itself done; the program that finishes last routes every
    token from the scratch and resets the counter for the next launch."""
    pid = tl.program_id(0)
    offs_ex = pid * BLOCK_EX + tl.arange(0, BLOCK_EX)
    mask_ex = offs_ex < num_experts
    offs_n = tl.arange(0, BLOCK_N)
    mask_n = offs_n < num_tokens
    acc = tl.zeros([BLOCK_N, BLOCK_EX], dtype=tl.float32)
    for d0 in range(0, hidden, BLOCK_D):
        offs_d = d0 + tl.arange(0, BLOCK_D)
        mask_d = offs_d < hidden
        w = tl.load(w_ptr + offs_ex.to(tl.int64)[:, None] * stride_we + offs_d[None, :],
                    mask=mask_ex[:, None] & mask_d[None, :], other=0.0)   # [BLOCK_EX, BLOCK_D]
        x = tl.load(x_ptr + offs_n[:, None] * stride_xn + offs_d[None, :],
                    mask=mask_n[:, None] & mask_d[None, :], other=0.0)    # [BLOCK_N, BLOCK_D]
        acc += tl.sum(x.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :], axis=2)
    tl.store(logits_ptr + offs_n[:, None] * BLOCK_E + offs_ex[None, :], acc,
             mask=mask_n[:, None] & mask_ex[None, :])
    # acq_rel: this program's logits are visible to the one that sees the final count, and
    # that one sees everyone's
    done = tl.atomic_add(counter_ptr, 1, sem="acq_rel")
    if done == tl.num_programs(0) - 1:
        offs_e = tl.arange(0, BLOCK_E)
        mask_e = offs_e < num_experts
        for n in range(0, num_tokens):
            # .cg: read past L1, which may hold this scratch from an earlier launch
            logits = tl.load(logits_ptr + n * BLOCK_E + offs_e, mask=mask_e, other=0.0,
                             cache_modifier=".cg")
            _route_row(logits, mask_e, offs_e, bias_ptr, weights_ptr, ids_ptr, n, scaling,
                       TOP_K, RENORMALIZE, HAS_BIAS, BLOCK_K, EXTRA_ID)
        tl.atomic_xchg(counter_ptr, 0)
