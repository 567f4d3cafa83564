"""Triton kernel of the sigmoid top-k router (imported lazily by router.py)."""

import triton
import triton.language as tl


@triton.jit
def topk_sigmoid_kernel(logits_ptr, bias_ptr, weights_ptr, ids_ptr, num_tokens, num_experts,
                        stride_lt, scaling,
                        TOP_K: tl.constexpr, RENORMALIZE: tl.constexpr, HAS_BIAS: tl.constexpr,
                        BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr,
                        BLOCK_K: tl.constexpr, EXTRA_ID: tl.constexpr = -1):
    """Rows of TOP_K (weight, id) pairs; with EXTRA_ID >= 0 one more column (weight 1, id
    EXTRA_ID) follows: the shared expert folded into the routed ones."""
    offs_t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    mask_t = offs_t < num_tokens
    offs_e = tl.arange(0, BLOCK_E)
    mask_e = offs_e < num_experts
    logits = tl.load(logits_ptr + offs_t.to(tl.int64)[:, None] * stride_lt + offs_e[None, :],
                     mask=mask_t[:, None] & mask_e[None, :], other=0.0).to(tl.float32)
    scores = tl.sigmoid(logits)                                    # [BLOCK_T, BLOCK_E]
    select = scores
    if HAS_BIAS:
        select += tl.load(bias_ptr + offs_e, mask=mask_e, other=0.0).to(tl.float32)[None, :]
    select = tl.where(mask_e[None, :], select, float("-inf"))
    offs_k = tl.arange(0, BLOCK_K)
    w_tile = tl.zeros([BLOCK_T, BLOCK_K], dtype=tl.float32)
    id_tile = tl.zeros([BLOCK_T, BLOCK_K], dtype=tl.int32)
    for j in tl.static_range(TOP_K):                               # k rounds of argmax
        best = tl.argmax(select, axis=1)                           # [BLOCK_T]
        hit = offs_e[None, :] == best[:, None]
        w = tl.sum(tl.where(hit, scores, 0.0), axis=1)
        w_tile = tl.where(offs_k[None, :] == j, w[:, None], w_tile)
        id_tile = tl.where(offs_k[None, :] == j, best[:, None].to(tl.int32), id_tile)
        select = tl.where(hit, float("-inf"), select)
    if RENORMALIZE:
        w_tile = w_tile / (tl.sum(w_tile, axis=1)[:, None] + 1e-20)
    w_tile = w_tile * scaling
    OUT_K: tl.constexpr = TOP_K + 1 if EXTRA_ID >= 0 else TOP_K
    if EXTRA_ID >= 0:
        extra = offs_k[None, :] == TOP_K
        w_tile = tl.where(extra, 1.0, w_tile)
        id_tile = tl.where(extra, EXTRA_ID, id_tile)
    out_mask = mask_t[:, None] & (offs_k < OUT_K)[None, :]
    out_offs = offs_t.to(tl.int64)[:, None] * OUT_K + offs_k[None, :]
    tl.store(weights_ptr + out_offs, w_tile, mask=out_mask)
    tl.store(ids_ptr + out_offs, id_tile.to(ids_ptr.dtype.element_ty), mask=out_mask)
