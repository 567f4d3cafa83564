"""Triton kernel building MLA prefill's k and padded v (imported lazily by prefill_kv.py)."""

import triton
import triton.language as tl


@triton.jit(do_not_specialize=["num_tokens"])
def mla_prefill_kv_kernel(
    kv_ptr, pe_ptr, k_ptr, v_ptr, num_tokens, stride_kv_l, stride_kv_h, stride_pe_l,
    NOPE: tl.constexpr, ROPE: tl.constexpr, V: tl.constexpr, V_WIDTH: tl.constexpr,
    B_NOPE: tl.constexpr, B_ROPE: tl.constexpr, B_V: tl.constexpr, BLOCK_L: tl.constexpr,
):
    """Program (token block, head h): k[l, h] = [kv[l, h, :NOPE] | pe[l]] and v[l, h] =
    [kv[l, h, NOPE:] | 0], k and v contiguous."""
    h = tl.program_id(1)
    offs_l = tl.program_id(0) * BLOCK_L + tl.arange(0, BLOCK_L)
    mask_l = (offs_l < num_tokens)[:, None]
    rows = offs_l.to(tl.int64)[:, None]
    H = tl.num_programs(1)
    kv_row = kv_ptr + rows * stride_kv_l + h * stride_kv_h
    k_row = k_ptr + (rows * H + h) * (NOPE + ROPE)
    v_row = v_ptr + (rows * H + h) * V_WIDTH

    c = tl.arange(0, B_NOPE)[None, :]
    m = mask_l & (c < NOPE)
    tl.store(k_row + c, tl.load(kv_row + c, mask=m), mask=m)
    if ROPE > 0:
        c = tl.arange(0, B_ROPE)[None, :]
        m = mask_l & (c < ROPE)
        tl.store(k_row + NOPE + c, tl.load(pe_ptr + rows * stride_pe_l + c, mask=m), mask=m)
    c = tl.arange(0, B_V)[None, :]
    m = mask_l & (c < V_WIDTH)
    val = tl.load(kv_row + NOPE + c, mask=m & (c < V), other=0.0)
    tl.store(v_row + c, val, mask=m)
