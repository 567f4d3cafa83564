"""Triton kernel of the sigmoid top-k router (imported lazily by router.py)."""

import triton
import triton.language as tl


@triton.jit
def topk_sigmoid_kernel(logits_ptr, bias_ptr, weights_ptr, ids_ptr, num_experts, stride_lt,
                        scaling,
                        TOP_K: tl.constexpr, RENORMALIZE: tl.constexpr, HAS_BIAS: tl.constexpr,
                        BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr,
                        EXTRA_ID: tl.constexpr = -1, USE_PDL: tl.constexpr = False):
    """One token per program: from its logits row [num_experts], sigmoid, selection bias, TOP_K
    rounds of argmax, renormalise, scale; stores TOP_K (weight, id) pairs. With EXTRA_ID >= 0
    one more column (weight 1, id EXTRA_ID) follows: the shared expert folded into the routed
    ones.

    One row per program keeps every reduction inside one or two warps: a 2-D [tokens, experts]
    tile per program spent most of the kernel's time on cross-warp argmax rounds.

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
    logits = tl.load(logits_ptr + row * stride_lt + offs_e, mask=mask_e, other=0.0)
    scores = tl.sigmoid(logits.to(tl.float32))                      # [BLOCK_E]
    select = scores
    if HAS_BIAS:
        if not USE_PDL:
            bias = tl.load(bias_ptr + offs_e, mask=mask_e, other=0.0)
        select += bias.to(tl.float32)
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
