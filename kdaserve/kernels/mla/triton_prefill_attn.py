"""Triton kernel of MLA prefill attention (imported lazily by prefill_attn.py)."""

import triton
import triton.language as tl


@triton.jit
def _block_scores(q_nope, q_pe, kv_h, pe_ptr, cols, d_nope, d_rope, stride_kv_l, stride_pe_l,
                  key_ok, MASKED: tl.constexpr, NOPE: tl.constexpr, ROPE: tl.constexpr,
                  B_NOPE: tl.constexpr, B_ROPE: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """q . k for a key block: [BLOCK_M, BLOCK_N] fp32, k = [kv_b's nope columns | shared pe].
    Loads are masked only where a key (MASKED: key_ok) or a padded column can be out of range."""
    ptrs = kv_h + cols[None, :] * stride_kv_l + d_nope[:, None]
    if MASKED or B_NOPE != NOPE:
        k_nope = tl.load(ptrs, mask=key_ok[None, :] & (d_nope[:, None] < NOPE), other=0.0)
    else:
        k_nope = tl.load(ptrs)                                              # [B_NOPE, BLOCK_N]
    s = tl.dot(q_nope, k_nope, input_precision=DOT_PRECISION)              # [BLOCK_M, BLOCK_N]
    if ROPE > 0:
        ptrs = pe_ptr + cols[None, :] * stride_pe_l + d_rope[:, None]
        if MASKED or B_ROPE != ROPE:
            k_pe = tl.load(ptrs, mask=key_ok[None, :] & (d_rope[:, None] < ROPE), other=0.0)
        else:
            k_pe = tl.load(ptrs)                                            # [B_ROPE, BLOCK_N]
        s = tl.dot(q_pe, k_pe, s, input_precision=DOT_PRECISION)
    return s


@triton.jit(do_not_specialize=["q_len", "kv_len"])
def mla_prefill_attn_kernel(
    q_ptr, kv_ptr, pe_ptr, o_ptr, q_len, kv_len, qk_scale,
    stride_q_t, stride_q_h, stride_kv_l, stride_kv_h, stride_pe_l, stride_o_t, stride_o_h,
    NOPE: tl.constexpr, ROPE: tl.constexpr, V: tl.constexpr, B_NOPE: tl.constexpr,
    B_ROPE: tl.constexpr, B_V: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    NUM_STAGES: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """Program (query block, head h): rows [m0, m0 + BLOCK_M) of one sequence's prefill chunk
    attend causally, bottom-right aligned, to its kv_len keys: row i sees keys
    j <= kv_len - q_len + i. Keys come straight from kv_b's output (nope and v columns of head
    h) and the latents' shared rope columns; online softmax in base 2 (qk_scale = softmax
    scale * log2 e), fp32 accumulators; DOT_PRECISION "ieee" for fp32 inputs (exact products),
    else "tf32" (bf16 / fp16 products are exact either way). Query blocks are taken longest
    first."""
    pid_m = tl.cdiv(q_len, BLOCK_M) - 1 - tl.program_id(0)
    h = tl.program_id(1)
    offset = kv_len - q_len
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    d_nope = tl.arange(0, B_NOPE)
    d_rope = tl.arange(0, B_ROPE)
    d_v = tl.arange(0, B_V)
    row_ok = offs_m < q_len
    rows = offs_m.to(tl.int64)

    q_row = q_ptr + rows[:, None] * stride_q_t + h * stride_q_h
    qm = row_ok[:, None]
    if B_NOPE != NOPE:
        qm = qm & (d_nope[None, :] < NOPE)
    q_nope = tl.load(q_row + d_nope[None, :], mask=qm, other=0.0)          # [BLOCK_M, B_NOPE]
    q_pe = q_nope
    if ROPE > 0:
        qm = row_ok[:, None]
        if B_ROPE != ROPE:
            qm = qm & (d_rope[None, :] < ROPE)
        q_pe = tl.load(q_row + NOPE + d_rope[None, :], mask=qm, other=0.0)  # [BLOCK_M, B_ROPE]
    vm = d_v[None, :] < V

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, B_V], tl.float32)
    kv_h = kv_ptr + h * stride_kv_h
    # keys [0, full_end) are whole blocks every row of this block sees (no mask); the rest, up
    # to the last row's bound, are masked per row
    full_end = ((offset + pid_m * BLOCK_M + 1) // BLOCK_N) * BLOCK_N
    end = tl.minimum(kv_len, offset + (pid_m + 1) * BLOCK_M)
    all_keys = offs_n >= 0                       # every key of a whole block is in range
    for start in tl.range(0, full_end, BLOCK_N, num_stages=NUM_STAGES):
        cols = (start + offs_n).to(tl.int64)
        s = _block_scores(q_nope, q_pe, kv_h, pe_ptr, cols, d_nope, d_rope, stride_kv_l,
                          stride_pe_l, all_keys, False, NOPE, ROPE, B_NOPE, B_ROPE,
                          DOT_PRECISION) * qk_scale
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.math.exp2(s - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        if B_V != V:
            v = tl.load(kv_h + cols[:, None] * stride_kv_l + NOPE + d_v[None, :], mask=vm,
                        other=0.0)
        else:
            v = tl.load(kv_h + cols[:, None] * stride_kv_l + NOPE + d_v[None, :])
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=DOT_PRECISION)
        m_i = m_new
    for start in tl.range(full_end, end, BLOCK_N):
        key = start + offs_n
        key_ok = key < kv_len
        cols = key.to(tl.int64)
        s = _block_scores(q_nope, q_pe, kv_h, pe_ptr, cols, d_nope, d_rope, stride_kv_l,
                          stride_pe_l, key_ok, True, NOPE, ROPE, B_NOPE, B_ROPE,
                          DOT_PRECISION) * qk_scale
        seen = (key[None, :] <= offset + offs_m[:, None]) & key_ok[None, :]
        s = tl.where(seen, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.math.exp2(s - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(kv_h + cols[:, None] * stride_kv_l + NOPE + d_v[None, :],
                    mask=key_ok[:, None] & vm, other=0.0)
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=DOT_PRECISION)
        m_i = m_new
    out = acc / l_i[:, None]
    om = row_ok[:, None]
    if B_V != V:
        om = om & vm
    tl.store(o_ptr + rows[:, None] * stride_o_t + h * stride_o_h + d_v[None, :],
             out.to(o_ptr.dtype.element_ty), mask=om)
