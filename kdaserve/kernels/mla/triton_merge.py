"""Triton kernel merging attention partials by their log-sum-exp (imported lazily)."""

import triton
import triton.language as tl


@triton.jit(do_not_specialize=["num_parts"])
def merge_attn_states_kernel(
    parts_ptr, part_lse_ptr, out_ptr, lse_ptr,
    stride_pn, stride_pr, stride_ph,
    stride_ln, stride_lr, stride_lh,
    stride_or, stride_oh,
    stride_olr,
    num_parts, head_dim,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, STORE_LSE: tl.constexpr,
):
    """Program (row, head, channel chunk): the num_parts partials [BLOCK_N, BLOCK_D] in one
    load, weighted by exp(lse_n - max lse) and normalised; empty partials (lse -inf) weigh 0,
    a row with none at all gives 0 and lse -inf. The first chunk writes the merged lse."""
    pid_r = tl.program_id(0)
    pid_h = tl.program_id(1)
    offs_n = tl.arange(0, BLOCK_N)
    mask_n = offs_n < num_parts
    lse = tl.load(part_lse_ptr + offs_n * stride_ln + pid_r.to(tl.int64) * stride_lr
                  + pid_h * stride_lh, mask=mask_n, other=float("-inf")).to(tl.float32)
    m = tl.max(lse, axis=0)
    m = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp(lse - m)                                            # [BLOCK_N], 0 when empty
    denom = tl.sum(w, axis=0)
    offs_d = tl.program_id(2) * BLOCK_D + tl.arange(0, BLOCK_D)
    mask_d = offs_d < head_dim
    p = (parts_ptr + offs_n[:, None].to(tl.int64) * stride_pn + pid_r.to(tl.int64) * stride_pr
         + pid_h * stride_ph + offs_d[None, :])
    part = tl.load(p, mask=(mask_n & (w > 0.0))[:, None] & mask_d[None, :],
                   other=0.0).to(tl.float32)                       # [BLOCK_N, BLOCK_D]
    out = tl.sum(part * w[:, None], axis=0) / tl.where(denom > 0.0, denom, 1.0)
    o = out_ptr + pid_r.to(tl.int64) * stride_or + pid_h * stride_oh + offs_d
    tl.store(o, out.to(out_ptr.dtype.element_ty), mask=mask_d)
    if STORE_LSE:
        if tl.program_id(2) == 0:
            total = tl.where(denom > 0.0, m + tl.log(tl.where(denom > 0.0, denom, 1.0)),
                             float("-inf"))
            tl.store(lse_ptr + pid_r.to(tl.int64) * stride_olr + pid_h, total)
