"""Triton kernels for absorbed MLA decode over the paged latent cache (imported lazily).

Stage 1 (`mla_decode_partial_kernel`): program (b, split, head group) reads the latent rows of one
context partition once and attends with every head of its group (flash-decoding, online softmax in
base 2); `mla_decode_partial_t_kernel` computes it transposed (warpgroup MMA), and
`mla_decode_partial_fold_kernel` takes several rows of one sequence (a verify window) as one
program's columns. Stage 2 (`mla_decode_reduce_kernel`): program (b, head) merges the partitions
by their log-sum-exp. `store_kv_kernel` writes new latent rows into their slots.

USE_PDL (every kernel; programmatic dependent launch, sm_90+): griddepcontrol.wait, then
griddepcontrol.launch_dependents, before any load of something another kernel writes (q, the
cache, block table, lengths, partials) and before any store; only store_latent_kernel's norm
weight is read before the wait, and with PREFETCH_KV the partial kernel's lengths, block table
and first cache tile (see there). USE_PDL=False generates the same code as before the flag
existed.
"""

import triton
import triton.language as tl

from kdaserve.kernels.triton_pdl import pdl_wait

LOG2E = 1.4426950408889634
LN2 = tl.constexpr(0.6931471805599453)   # readable inside kernels


# Split counts, the partial buffers' strides and the block table's row stride follow the batch
# and the longest context of an eager step: no value specialisation, so a new mix of decode rows
# does not JIT a new variant. (stride_bt: a suspected cause of the MLA decode compiles still
# seen in mixed steps after the start-up warm-up; benchmarks/PERF_NOTES.md.)
_SPLIT_ARGS = ["num_heads", "num_splits", "stride_po_b", "stride_po_h", "stride_pl_b",
               "stride_pl_h"]

# A verify window's rows come from wherever the step put them: q and q_pe may start at any
# row of a larger projection, and the block table and lengths at any row of the step's
# buffers. Their alignment and the q strides are not specialised, so a new step composition
# reuses the warm-up's build (the rows are read once a program; the latents stay vectorised).
_WINDOW_ROWS = ["q_ptr", "qr_ptr", "block_table_ptr", "seq_lens_ptr"]
_ROW_STRIDES = ["stride_qb", "stride_qh", "stride_qrb", "stride_qrh"]


@triton.jit
def _load_tile(kv_ptr, bt_row, n0, end, offs_c, mask_c, offs_r, mask_r, stride_kv_block,
               stride_kv_tok, KV_RANK: tl.constexpr, ROPE: tl.constexpr,
               PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr):
    """The latent rows [n0, n0 + BLOCK_N) of a sequence (rows >= end read as 0): (mask_n
    [BLOCK_N], kv_c [BLOCK_N, BLOCK_C], kv_r [BLOCK_N, BLOCK_R] or 0.0 without rope)."""
    offs_n = n0 + tl.arange(0, BLOCK_N)
    mask_n = offs_n < end
    block_ids = tl.load(bt_row + offs_n // PAGE_SIZE, mask=mask_n, other=0).to(tl.int64)
    row = block_ids * stride_kv_block + (offs_n % PAGE_SIZE) * stride_kv_tok   # [BLOCK_N]
    kv_c = tl.load(kv_ptr + row[:, None] + offs_c[None, :],
                   mask=mask_n[:, None] & mask_c[None, :], other=0.0)   # [BLOCK_N, BLOCK_C]
    kv_r = 0.0
    if ROPE > 0:
        kv_r = tl.load(kv_ptr + row[:, None] + KV_RANK + offs_r[None, :],
                       mask=mask_n[:, None] & mask_r[None, :], other=0.0)
    return mask_n, kv_c, kv_r


@triton.jit
def _attend_tile(q_c, q_r, mask_n, kv_c, kv_r, m_i, l_i, acc, sm_scale_log2,
                 ROPE: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """One online-softmax step over a tile with at least one row in range: (m_i, l_i, acc)."""
    s = tl.dot(q_c, tl.trans(kv_c), input_precision=DOT_PRECISION)      # [BLOCK_H, BLOCK_N]
    if ROPE > 0:
        s += tl.dot(q_r, tl.trans(kv_r), input_precision=DOT_PRECISION)
    s = tl.where(mask_n[None, :], s * sm_scale_log2, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.dot(p.to(kv_c.dtype), kv_c, input_precision=DOT_PRECISION)
    return m_new, l_i, acc


@triton.jit(do_not_specialize=_SPLIT_ARGS + ["stride_bt"])
def mla_decode_partial_kernel(
    q_ptr, qr_ptr, kv_ptr, block_table_ptr, seq_lens_ptr, part_out_ptr, part_lse_ptr,
    sm_scale_log2,
    stride_qb, stride_qh, stride_qrb, stride_qrh,
    stride_kv_block, stride_kv_tok,
    stride_bt,
    stride_po_b, stride_po_h, stride_po_s,
    stride_pl_b, stride_pl_h,
    num_heads, num_splits,
    KV_RANK: tl.constexpr, ROPE: tl.constexpr,
    BLOCK_C: tl.constexpr, BLOCK_R: tl.constexpr,
    PAGE_SIZE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr, USE_PDL: tl.constexpr = False,
    PREFETCH_KV: tl.constexpr = False,
):
    """PREFETCH_KV (with USE_PDL): the lengths, the block table and the partition's first tile
    of the cache are read before griddepcontrol.wait, so they stream while the previous kernel
    finishes; that kernel must not write them (in the decode layer it is the W_UK product,
    after store_latent). q is read after the wait. Same results either way."""
    pid_b = tl.program_id(0)
    pid_s = tl.program_id(1)
    pid_h = tl.program_id(2)
    early = USE_PDL and PREFETCH_KV
    if not early:
        pdl_wait(USE_PDL)

    seq_len = tl.load(seq_lens_ptr + pid_b)
    split_len = tl.cdiv(seq_len, num_splits)
    split_len = tl.cdiv(split_len, BLOCK_N) * BLOCK_N           # whole tiles per partition
    start = pid_s * split_len
    end = tl.minimum(start + split_len, seq_len)

    offs_h = pid_h * BLOCK_H + tl.arange(0, BLOCK_H)
    mask_h = offs_h < num_heads
    offs_c = tl.arange(0, BLOCK_C)
    mask_c = offs_c < KV_RANK
    offs_r = tl.arange(0, BLOCK_R)
    mask_r = offs_r < ROPE
    bt_row = block_table_ptr + pid_b.to(tl.int64) * stride_bt
    mask_n0, kv_c0, kv_r0 = _load_tile(kv_ptr, bt_row, start, end, offs_c, mask_c, offs_r,
                                       mask_r, stride_kv_block, stride_kv_tok, KV_RANK, ROPE,
                                       PAGE_SIZE, BLOCK_N)      # the partition's first tile
    if early:
        pdl_wait(USE_PDL)

    q_base = q_ptr + pid_b.to(tl.int64) * stride_qb + offs_h[:, None] * stride_qh
    q_c = tl.load(q_base + offs_c[None, :], mask=mask_h[:, None] & mask_c[None, :], other=0.0)
    q_r = 0.0
    if ROPE > 0:
        qr_base = qr_ptr + pid_b.to(tl.int64) * stride_qrb + offs_h[:, None] * stride_qrh
        q_r = tl.load(qr_base + offs_r[None, :],
                      mask=mask_h[:, None] & mask_r[None, :], other=0.0)

    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_C], dtype=tl.float32)        # [BLOCK_H, kv_lora_rank]
    if start < end:
        m_i, l_i, acc = _attend_tile(q_c, q_r, mask_n0, kv_c0, kv_r0, m_i, l_i, acc,
                                     sm_scale_log2, ROPE, DOT_PRECISION)
    for n0 in range(start + BLOCK_N, end, BLOCK_N):
        mask_n, kv_c, kv_r = _load_tile(kv_ptr, bt_row, n0, end, offs_c, mask_c, offs_r, mask_r,
                                        stride_kv_block, stride_kv_tok, KV_RANK, ROPE,
                                        PAGE_SIZE, BLOCK_N)
        m_i, l_i, acc = _attend_tile(q_c, q_r, mask_n, kv_c, kv_r, m_i, l_i, acc,
                                     sm_scale_log2, ROPE, DOT_PRECISION)

    has = l_i > 0.0
    out = acc / tl.where(has, l_i, 1.0)[:, None]
    lse = tl.where(has, m_i + tl.log2(tl.where(has, l_i, 1.0)), float("-inf"))
    po = (part_out_ptr + pid_b.to(tl.int64) * stride_po_b + offs_h[:, None] * stride_po_h
          + pid_s * stride_po_s + offs_c[None, :])
    tl.store(po, out, mask=mask_h[:, None] & mask_c[None, :])
    tl.store(part_lse_ptr + pid_b * stride_pl_b + offs_h * stride_pl_h + pid_s, lse, mask=mask_h)


@triton.jit
def _tile_scores_t(kv_ptr, bt_row, offs_n, mask_n, offs_c, mask_c, offs_r, mask_r, qt_c, qt_r,
                   stride_kv_block, stride_kv_tok, KV_RANK: tl.constexpr, ROPE: tl.constexpr,
                   PAGE_SIZE: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """One context tile of the transposed kernels: its latent rows kv_c [BLOCK_N, BLOCK_C] and
    the raw scores [BLOCK_N, columns] of the latent and rope channels against the query
    columns qt_c [BLOCK_C, columns] / qt_r [BLOCK_R, columns] (unread when ROPE == 0)."""
    block_ids = tl.load(bt_row + offs_n // PAGE_SIZE, mask=mask_n, other=0).to(tl.int64)
    row = block_ids * stride_kv_block + (offs_n % PAGE_SIZE) * stride_kv_tok
    kv_c = tl.load(kv_ptr + row[:, None] + offs_c[None, :],
                   mask=mask_n[:, None] & mask_c[None, :], other=0.0)       # [BLOCK_N, BLOCK_C]
    st = tl.dot(kv_c, qt_c, input_precision=DOT_PRECISION)
    if ROPE > 0:
        kv_r = tl.load(kv_ptr + row[:, None] + KV_RANK + offs_r[None, :],
                       mask=mask_n[:, None] & mask_r[None, :], other=0.0)
        st += tl.dot(kv_r, qt_r, input_precision=DOT_PRECISION)
    return kv_c, st


@triton.jit
def _online_update_t(m_i, l_i, acc, st, kv_c, m_ref, DOT_PRECISION: tl.constexpr):
    """The transposed kernels' online-softmax step over one tile: scores st [BLOCK_N, columns]
    (base 2, scaled, -inf where masked) against the running max m_i moved to m_ref (finite).
    Returns (l_i, acc)."""
    alpha = tl.exp2(m_i - m_ref)
    pt = tl.exp2(st - m_ref[None, :])
    l_i = l_i * alpha + tl.sum(pt, axis=0)
    acc = acc * alpha[None, :] + tl.dot(tl.trans(kv_c), pt.to(kv_c.dtype),
                                        input_precision=DOT_PRECISION)
    return l_i, acc


@triton.jit
def _finish_t(acc, l_i, m_i):
    """(the normalised partial output [BLOCK_C, columns], its base-2 lse [columns]); columns
    that saw no key give zeros and -inf."""
    has = l_i > 0.0
    out = acc / tl.where(has, l_i, 1.0)[None, :]
    lse = tl.where(has, m_i + tl.log2(tl.where(has, l_i, 1.0)), float("-inf"))
    return out, lse


@triton.jit(do_not_specialize=_SPLIT_ARGS + ["stride_bt"] + _ROW_STRIDES,
            do_not_specialize_on_alignment=_WINDOW_ROWS)
def mla_decode_partial_t_kernel(
    q_ptr, qr_ptr, kv_ptr, block_table_ptr, seq_lens_ptr, part_out_ptr, part_lse_ptr,
    sm_scale_log2,
    stride_qb, stride_qh, stride_qrb, stride_qrh,
    stride_kv_block, stride_kv_tok,
    stride_bt,
    stride_po_b, stride_po_h, stride_po_s,
    stride_pl_b, stride_pl_h,
    num_heads, num_splits,
    KV_RANK: tl.constexpr, ROPE: tl.constexpr,
    BLOCK_C: tl.constexpr, BLOCK_R: tl.constexpr,
    PAGE_SIZE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr, USE_PDL: tl.constexpr = False,
):
    """Same contract as mla_decode_partial_kernel, computed transposed (tokens and latent
    channels as the matrix rows, heads as columns): both products then have >= 64 rows, which
    lets Hopper use its warpgroup MMA although a sequence has only 16-32 heads."""
    pdl_wait(USE_PDL)
    pid_b = tl.program_id(0)
    pid_s = tl.program_id(1)
    pid_h = tl.program_id(2)

    seq_len = tl.load(seq_lens_ptr + pid_b)
    split_len = tl.cdiv(seq_len, num_splits)
    split_len = tl.cdiv(split_len, BLOCK_N) * BLOCK_N
    start = pid_s * split_len
    end = tl.minimum(start + split_len, seq_len)

    offs_h = pid_h * BLOCK_H + tl.arange(0, BLOCK_H)
    mask_h = offs_h < num_heads
    offs_c = tl.arange(0, BLOCK_C)
    mask_c = offs_c < KV_RANK
    offs_r = tl.arange(0, BLOCK_R)
    mask_r = offs_r < ROPE

    q_base = q_ptr + pid_b.to(tl.int64) * stride_qb + offs_h[None, :] * stride_qh
    qt_c = tl.load(q_base + offs_c[:, None], mask=mask_c[:, None] & mask_h[None, :], other=0.0)
    if ROPE > 0:
        qr_base = qr_ptr + pid_b.to(tl.int64) * stride_qrb + offs_h[None, :] * stride_qrh
        qt_r = tl.load(qr_base + offs_r[:, None],
                       mask=mask_r[:, None] & mask_h[None, :], other=0.0)   # [BLOCK_R, BLOCK_H]
    else:
        qt_r = qt_c                                                           # unread

    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_C, BLOCK_H], dtype=tl.float32)        # [kv_lora_rank, BLOCK_H]

    bt_row = block_table_ptr + pid_b.to(tl.int64) * stride_bt
    for n0 in range(start, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        mask_n = offs_n < end
        kv_c, st = _tile_scores_t(kv_ptr, bt_row, offs_n, mask_n, offs_c, mask_c, offs_r, mask_r,
                                  qt_c, qt_r, stride_kv_block, stride_kv_tok, KV_RANK, ROPE,
                                  PAGE_SIZE, DOT_PRECISION)               # st [BLOCK_N, BLOCK_H]
        st = tl.where(mask_n[:, None], st * sm_scale_log2, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(st, axis=0))
        l_i, acc = _online_update_t(m_i, l_i, acc, st, kv_c, m_new, DOT_PRECISION)
        m_i = m_new

    out, lse = _finish_t(acc, l_i, m_i)
    po = (part_out_ptr + pid_b.to(tl.int64) * stride_po_b + offs_h[None, :] * stride_po_h
          + pid_s * stride_po_s + offs_c[:, None])
    tl.store(po, out, mask=mask_c[:, None] & mask_h[None, :])
    tl.store(part_lse_ptr + pid_b * stride_pl_b + offs_h * stride_pl_h + pid_s, lse, mask=mask_h)


@triton.jit(do_not_specialize=_SPLIT_ARGS + _ROW_STRIDES + ["stride_bt", "rows_per_seq",
                                                            "num_rows"],
            do_not_specialize_on_alignment=_WINDOW_ROWS)
def mla_decode_partial_fold_kernel(
    q_ptr, qr_ptr, kv_ptr, block_table_ptr, seq_lens_ptr, part_out_ptr, part_lse_ptr,
    sm_scale_log2,
    stride_qb, stride_qh, stride_qrb, stride_qrh,
    stride_kv_block, stride_kv_tok,
    stride_bt,
    stride_po_b, stride_po_h, stride_po_s,
    stride_pl_b, stride_pl_h,
    num_heads, num_splits, rows_per_seq, num_rows,
    KV_RANK: tl.constexpr, ROPE: tl.constexpr,
    BLOCK_C: tl.constexpr, BLOCK_R: tl.constexpr,
    PAGE_SIZE: tl.constexpr, BLOCK_H: tl.constexpr, ROWS: tl.constexpr, BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr, USE_PDL: tl.constexpr = False,
):
    """mla_decode_partial_t_kernel with ROWS query rows of one sequence per program: the
    columns are (row, head) pairs, ROWS * BLOCK_H of them, so one pass over a partition's
    latents serves ROWS rows (a verify window's rows read one context). Rows seq *
    rows_per_seq + j, j < rows_per_seq, are one sequence (their block table rows are equal);
    program (group, split, head group) takes rows j = g * ROWS .. g * ROWS + ROWS - 1 of
    sequence group // cdiv(rows_per_seq, ROWS), g = group % cdiv(rows_per_seq, ROWS). Its
    partitions follow its longest row; each column masks the keys at or past its own row's
    length. Writes the same partials as the one-row kernels (the reduce is shared)."""
    pdl_wait(USE_PDL)
    pid_g = tl.program_id(0)
    pid_s = tl.program_id(1)
    pid_h = tl.program_id(2)

    groups = tl.cdiv(rows_per_seq, ROWS)
    seq = pid_g // groups
    first = seq * rows_per_seq + (pid_g % groups) * ROWS
    cols = tl.arange(0, ROWS * BLOCK_H)
    j = (pid_g % groups) * ROWS + cols // BLOCK_H
    row = seq * rows_per_seq + j                                             # [COLS]
    head = pid_h * BLOCK_H + cols % BLOCK_H                                  # [COLS]
    valid = (j < rows_per_seq) & (row < num_rows) & (head < num_heads)
    len_col = tl.load(seq_lens_ptr + row, mask=valid, other=0)              # [COLS]
    seq_len = tl.max(len_col, axis=0)
    split_len = tl.cdiv(seq_len, num_splits)
    split_len = tl.cdiv(split_len, BLOCK_N) * BLOCK_N
    start = pid_s * split_len
    end = tl.minimum(start + split_len, seq_len)

    offs_c = tl.arange(0, BLOCK_C)
    mask_c = offs_c < KV_RANK
    offs_r = tl.arange(0, BLOCK_R)
    mask_r = offs_r < ROPE

    row64 = row.to(tl.int64)
    q_base = q_ptr + row64[None, :] * stride_qb + head[None, :] * stride_qh
    qt_c = tl.load(q_base + offs_c[:, None], mask=mask_c[:, None] & valid[None, :],
                   other=0.0)                                                # [BLOCK_C, COLS]
    if ROPE > 0:
        qr_base = qr_ptr + row64[None, :] * stride_qrb + head[None, :] * stride_qrh
        qt_r = tl.load(qr_base + offs_r[:, None],
                       mask=mask_r[:, None] & valid[None, :], other=0.0)    # [BLOCK_R, COLS]
    else:
        qt_r = qt_c                                                           # unread

    m_i = tl.full([ROWS * BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([ROWS * BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_C, ROWS * BLOCK_H], dtype=tl.float32)

    bt_row = block_table_ptr + first.to(tl.int64) * stride_bt
    for n0 in range(start, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        mask_n = offs_n < end
        kv_c, st = _tile_scores_t(kv_ptr, bt_row, offs_n, mask_n, offs_c, mask_c, offs_r, mask_r,
                                  qt_c, qt_r, stride_kv_block, stride_kv_tok, KV_RANK, ROPE,
                                  PAGE_SIZE, DOT_PRECISION)               # st [BLOCK_N, COLS]
        st = tl.where(offs_n[:, None] < len_col[None, :], st * sm_scale_log2, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(st, axis=0))
        # a column whose keys all lie past its length (a shorter row of the window) stays at
        # -inf: exponentiate against 0 there, not -inf - -inf
        l_i, acc = _online_update_t(m_i, l_i, acc, st, kv_c,
                                    tl.where(m_new == float("-inf"), 0.0, m_new), DOT_PRECISION)
        m_i = m_new

    out, lse = _finish_t(acc, l_i, m_i)
    po = (part_out_ptr + row64[None, :] * stride_po_b + head[None, :] * stride_po_h
          + pid_s * stride_po_s + offs_c[:, None])
    tl.store(po, out, mask=mask_c[:, None] & valid[None, :])
    tl.store(part_lse_ptr + row64 * stride_pl_b + head * stride_pl_h + pid_s, lse, mask=valid)


# stride_lb: lse's row stride, or (no lse) part_lse's, heads * splits, whose divisibility by 16
# follows the split count of the step.
@triton.jit(do_not_specialize=_SPLIT_ARGS[1:] + ["stride_lb"])
def mla_decode_reduce_kernel(
    part_out_ptr, part_lse_ptr, out_ptr, lse_ptr,
    stride_po_b, stride_po_h, stride_po_s,
    stride_pl_b, stride_pl_h,
    stride_ob, stride_oh, stride_lb,
    num_splits,
    KV_RANK: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_S: tl.constexpr,
    USE_PDL: tl.constexpr = False, STORE_LSE: tl.constexpr = False,
):
    """Program (b, h, channel chunk): all partitions' partial outputs in one [BLOCK_S, BLOCK_C]
    load (no serial loop over partitions), weighted by exp2(lse - max lse). STORE_LSE: the
    first channel chunk also writes the query's natural-log lse over all partitions to
    lse_ptr[b * stride_lb + h] (-inf for an empty sequence)."""
    pdl_wait(USE_PDL)
    pid_b = tl.program_id(0)
    pid_h = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    mask_s = offs_s < num_splits
    lse = tl.load(part_lse_ptr + pid_b * stride_pl_b + pid_h * stride_pl_h + offs_s,
                  mask=mask_s, other=float("-inf"))
    m = tl.max(lse, axis=0)
    w = tl.exp2(lse - tl.where(m == float("-inf"), 0.0, m))      # 0 for empty partitions
    denom = tl.sum(w, axis=0)
    offs_c = tl.program_id(2) * BLOCK_C + tl.arange(0, BLOCK_C)
    mask_c = offs_c < KV_RANK
    po = (part_out_ptr + pid_b.to(tl.int64) * stride_po_b + pid_h * stride_po_h
          + offs_s[:, None] * stride_po_s + offs_c[None, :])
    part = tl.load(po, mask=(mask_s & (w > 0.0))[:, None] & mask_c[None, :], other=0.0)
    out = tl.sum(part * w[:, None], axis=0) / tl.where(denom > 0.0, denom, 1.0)  # empty -> 0
    o = out_ptr + pid_b.to(tl.int64) * stride_ob + pid_h * stride_oh + offs_c
    tl.store(o, out.to(out_ptr.dtype.element_ty), mask=mask_c)
    if STORE_LSE:
        if tl.program_id(2) == 0:
            lse2 = tl.where(denom > 0.0, m + tl.log2(tl.where(denom > 0.0, denom, 1.0)),
                            float("-inf"))
            tl.store(lse_ptr + pid_b * stride_lb + pid_h, lse2 * LN2)


@triton.jit
def store_kv_kernel(kv_ptr, slot_ptr, src_ptr, stride_src, dim, BLOCK_D: tl.constexpr,
                    USE_PDL: tl.constexpr = False):
    pdl_wait(USE_PDL)
    pid = tl.program_id(0)
    slot = tl.load(slot_ptr + pid).to(tl.int64)
    offs = tl.arange(0, BLOCK_D)
    mask = offs < dim
    row = tl.load(src_ptr + pid.to(tl.int64) * stride_src + offs, mask=mask & (slot >= 0))
    tl.store(kv_ptr + slot * dim + offs, row.to(kv_ptr.dtype.element_ty), mask=mask & (slot >= 0))


@triton.jit
def store_latent_kernel(kv_ptr, slot_ptr, src_ptr, w_ptr, stride_src, dim, rank, eps,
                        BLOCK_D: tl.constexpr, USE_PDL: tl.constexpr = False):
    """One token: RMS-norm its first `rank` channels (fp32, cast back, times the weight, as
    HF's norm), keep the rest (k_pe), write the row into its cache slot. USE_PDL: the norm
    weight (immutable) is loaded before griddepcontrol.wait, the slot and the row after it."""
    pid = tl.program_id(0)
    if USE_PDL:   # the weight is immutable: load it while the previous kernel finishes
        offs_w = tl.arange(0, BLOCK_D)
        w = tl.load(w_ptr + offs_w, mask=offs_w < rank, other=1.0)
        pdl_wait(USE_PDL)
    slot = tl.load(slot_ptr + pid).to(tl.int64)
    offs = tl.arange(0, BLOCK_D)
    mask = (offs < dim) & (slot >= 0)
    row = tl.load(src_ptr + pid.to(tl.int64) * stride_src + offs, mask=mask, other=0.0)
    xf = row.to(tl.float32)
    is_c = offs < rank
    var = tl.sum(tl.where(is_c, xf * xf, 0.0), axis=0) / rank
    normed = (xf * tl.rsqrt(var + eps)).to(row.dtype)
    if not USE_PDL:
        w = tl.load(w_ptr + offs, mask=is_c, other=1.0)
    out = tl.where(is_c, (w * normed).to(row.dtype), row)
    tl.store(kv_ptr + slot * dim + offs, out.to(kv_ptr.dtype.element_ty), mask=mask)
