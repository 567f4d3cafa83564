"""Triton kernels for KDA speculative verification (imported lazily by recover.py).

State tiles are [BK, BV] of one (request, head, V-block): a program owns its tile for the whole
window, so reading S_0 and later writing states into the same slot (per-position mode) cannot
race with another program. Loops over a request's tokens are dynamic (CUDA-graph safe: lengths
and accept counts are read on the device).
"""

import triton
import triton.language as tl

from kdaserve.kernels.conv.triton_conv import _last_taps, _out_col, _silu, _window_out

# The verification rows are slices of the step's projections at the speculating requests'
# offset, so their pointers' 16-byte alignment and their row strides differ between a verify
# graph's buffers and an eager mixed step: neither is specialised on, so every composition runs
# the build made at warm-up instead of compiling in the middle of serving.
_TOKEN_STRIDES = ["stride_qt", "stride_kt", "stride_vt", "stride_gt", "stride_bt", "stride_ot",
                  "stride_ut", "stride_kht", "stride_grt"]
# per-request scalars (window bounds, slots, columns), possibly views into a step's buffers
_SMALL_INPUTS = ["cu_ptr", "idx_ptr", "col_ptr"]


@triton.jit
def _token_inputs(k_ptr, q_ptr, g_ptr, beta_ptr, v_ptr, t, valid, h, offs_k, offs_v, mk, mv,
                  stride_kt, stride_kh, stride_qt, stride_qh, stride_gt, stride_gh, stride_bt,
                  stride_bh, stride_vt, stride_vh):
    """Token t's k, q, g [BK], beta (scalar) and v [BV] as stored (zeros where not valid)."""
    kt = tl.load(k_ptr + t * stride_kt + h * stride_kh + offs_k, mask=mk & valid, other=0.0)
    qt = tl.load(q_ptr + t * stride_qt + h * stride_qh + offs_k, mask=mk & valid, other=0.0)
    gt = tl.load(g_ptr + t * stride_gt + h * stride_gh + offs_k, mask=mk & valid, other=0.0)
    bt = tl.load(beta_ptr + t * stride_bt + h * stride_bh, mask=valid, other=0.0)
    vt = tl.load(v_ptr + t * stride_vt + h * stride_vh + offs_v, mask=mv & valid, other=0.0)
    return kt, qt, gt, bt, vt


@triton.jit(do_not_specialize=_TOKEN_STRIDES,
            do_not_specialize_on_alignment=["q_ptr", "k_ptr", "v_ptr", "g_ptr", "beta_ptr",
                                            "o_ptr", "u_ptr", "kh_ptr", "gr_ptr",
                                            *_SMALL_INPUTS])
def kda_spec_verify_kernel(
    q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, cu_ptr, state_ptr, idx_ptr, col_ptr,
    o_ptr, u_ptr, kh_ptr, gr_ptr, a_log_ptr, dt_bias_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_gt, stride_gh,
    stride_bt, stride_bh, stride_ot, stride_oh, stride_ut, stride_uh, stride_kht, stride_khh,
    stride_grt, stride_grh, stride_ss, stride_sh, stride_sk, stride_sv, stride_idx,
    scale, lower_bound,
    K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    L2NORM: tl.constexpr, HAS_COLS: tl.constexpr, RECORD: tl.constexpr,
    PER_POSITION: tl.constexpr, GATE_IN_KERNEL: tl.constexpr, HAS_LOWER_BOUND: tl.constexpr,
):
    """GATE_IN_KERNEL: g holds the gate pre-activation and beta the logits; the kernel applies
    kda_gate (dt_bias, A_log, optional lower bound) and sigmoid, and records the activated g.
    Token t + 1's inputs are loaded while token t's state update runs: loading each token's
    inputs at the top of its trip made the loop a chain of load latencies, a few tokens long
    (slower at every measured tile, benchmarks/PERF_NOTES.md)."""
    i = tl.program_id(0)
    h = tl.program_id(1)
    vb = tl.program_id(2)
    bos = tl.load(cu_ptr + i).to(tl.int64)
    eos = tl.load(cu_ptr + i + 1).to(tl.int64)
    col = 0
    if HAS_COLS:
        col = tl.load(col_ptr + i).to(tl.int64)
    slot = tl.load(idx_ptr + i * stride_idx + col).to(tl.int64)
    offs_k = tl.arange(0, BK)
    offs_v = vb * BV + tl.arange(0, BV)
    mk = offs_k < K
    mv = offs_v < V
    tile = h * stride_sh + offs_k[:, None] * stride_sk + offs_v[None, :] * stride_sv
    m_tile = mk[:, None] & mv[None, :]
    S = tl.load(state_ptr + slot * stride_ss + tile, mask=m_tile & (slot >= 0), other=0.0)
    S = S.to(tl.float32)                                             # [BK, BV]
    if GATE_IN_KERNEL:
        neg_a = -tl.exp(tl.load(a_log_ptr + h).to(tl.float32))
        dt_b = tl.load(dt_bias_ptr + h * K + offs_k, mask=mk, other=0.0).to(tl.float32)
    # the first token's inputs; each trip then loads the next token's early
    kn, qn, gn, bn, vn = _token_inputs(
        k_ptr, q_ptr, g_ptr, beta_ptr, v_ptr, bos, bos < eos, h, offs_k, offs_v, mk, mv,
        stride_kt, stride_kh, stride_qt, stride_qh, stride_gt, stride_gh, stride_bt,
        stride_bh, stride_vt, stride_vh)
    for t in range(bos, eos):
        kt, qt, gt, bt, vt = kn, qn, gn, bn, vn
        kn, qn, gn, bn, vn = _token_inputs(
            k_ptr, q_ptr, g_ptr, beta_ptr, v_ptr, t + 1, t + 1 < eos, h, offs_k, offs_v,
            mk, mv, stride_kt, stride_kh, stride_qt, stride_qh, stride_gt, stride_gh,
            stride_bt, stride_bh, stride_vt, stride_vh)
        kt = kt.to(tl.float32)
        qt = qt.to(tl.float32)
        if L2NORM:
            kt = kt / tl.sqrt(tl.sum(kt * kt) + 1e-6)
            qt = qt / tl.sqrt(tl.sum(qt * qt) + 1e-6)
        qt = qt * scale
        gt = gt.to(tl.float32)
        bt = bt.to(tl.float32)
        if GATE_IN_KERNEL:
            gt = gt + dt_b
            if HAS_LOWER_BOUND:
                gt = lower_bound * tl.sigmoid(-neg_a * gt)
            else:
                gt = neg_a * tl.where(gt > 20.0, gt, tl.log(1.0 + tl.exp(gt)))
            gt = tl.where(mk, gt, 0.0)
            bt = tl.sigmoid(bt)
        S = S * tl.exp(gt)[:, None]                                  # decay key rows
        ut = (vt.to(tl.float32) - tl.sum(S * kt[:, None], axis=0)) * bt
        S = S + kt[:, None] * ut[None, :]                            # rank-1 write
        ot = tl.sum(S * qt[:, None], axis=0)                         # read after write
        tl.store(o_ptr + t * stride_ot + h * stride_oh + offs_v,
                 ot.to(o_ptr.dtype.element_ty), mask=mv)
        if RECORD:
            tl.store(u_ptr + t * stride_ut + h * stride_uh + offs_v, ut, mask=mv)
            tl.store(kh_ptr + t * stride_kht + h * stride_khh + offs_k, kt, mask=mk & (vb == 0))
            if GATE_IN_KERNEL:
                tl.store(gr_ptr + t * stride_grt + h * stride_grh + offs_k, gt,
                         mask=mk & (vb == 0))
        if PER_POSITION:
            dst = tl.load(idx_ptr + i * stride_idx + (t - bos)).to(tl.int64)
            tl.store(state_ptr + dst * stride_ss + tile, S, mask=m_tile & (dst >= 0))


@triton.jit(do_not_specialize=["stride_ut", "stride_kht", "stride_gt"],
            do_not_specialize_on_alignment=["u_ptr", "kh_ptr", "g_ptr", "n_ptr", "cu_ptr",
                                            "idx_ptr"])
def kda_recover_commit_kernel(
    state_ptr, idx_ptr, u_ptr, kh_ptr, g_ptr, cu_ptr, n_ptr,
    stride_ss, stride_sh, stride_sk, stride_sv, stride_idx,
    stride_ut, stride_uh, stride_kht, stride_khh, stride_gt, stride_gh,
    K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
):
    i = tl.program_id(0)
    h = tl.program_id(1)
    vb = tl.program_id(2)
    bos = tl.load(cu_ptr + i).to(tl.int64)
    eos = tl.load(cu_ptr + i + 1).to(tl.int64)
    n = tl.minimum(tl.maximum(tl.load(n_ptr + i).to(tl.int64), 0), eos - bos)
    slot = tl.load(idx_ptr + i * stride_idx).to(tl.int64)
    offs_k = tl.arange(0, BK)
    offs_v = vb * BV + tl.arange(0, BV)
    mk = offs_k < K
    mv = offs_v < V
    ptrs = state_ptr + slot * stride_ss + h * stride_sh + offs_k[:, None] * stride_sk \
        + offs_v[None, :] * stride_sv
    m_tile = mk[:, None] & mv[None, :] & (slot >= 0) & (n > 0)
    S = tl.load(ptrs, mask=m_tile, other=0.0).to(tl.float32)
    for t in range(bos, bos + n):
        kt = tl.load(kh_ptr + t * stride_kht + h * stride_khh + offs_k, mask=mk, other=0.0)
        gt = tl.load(g_ptr + t * stride_gt + h * stride_gh + offs_k, mask=mk, other=0.0)
        ut = tl.load(u_ptr + t * stride_ut + h * stride_uh + offs_v, mask=mv, other=0.0)
        S = S * tl.exp(gt.to(tl.float32))[:, None] \
            + kt.to(tl.float32)[:, None] * ut.to(tl.float32)[None, :]
    tl.store(ptrs, S.to(state_ptr.dtype.element_ty), mask=m_tile)


@triton.jit(do_not_specialize=["stride_xt"],
            do_not_specialize_on_alignment=["x_ptr", "n_ptr", *_SMALL_INPUTS])
def conv_spec_window_kernel(
    pool_ptr, idx_ptr, col_ptr, x_ptr, cu_ptr, n_ptr, dim,
    stride_ps, stride_pd, stride_pj, stride_idx, stride_xt,
    W1: tl.constexpr, BW: tl.constexpr, BD: tl.constexpr,
    HAS_COLS: tl.constexpr, PER_POSITION: tl.constexpr,
):
    """Window after m tokens = columns m .. m+W1-1 of cat(window, x^T). Commit: m = n[i] into
    the source slot; per-position: every m = 1..T_i into idx[i, m-1]. The source window is held
    in registers, so writing into its own slot is safe."""
    i = tl.program_id(0)
    offs_d = tl.program_id(1) * BD + tl.arange(0, BD)
    md = offs_d < dim
    bos = tl.load(cu_ptr + i).to(tl.int64)
    T = tl.load(cu_ptr + i + 1).to(tl.int64) - bos
    col = 0
    if HAS_COLS:
        col = tl.load(col_ptr + i).to(tl.int64)
    src = tl.load(idx_ptr + i * stride_idx + col).to(tl.int64)
    jj = tl.arange(0, BW)
    old = tl.load(pool_ptr + src * stride_ps + offs_d[:, None] * stride_pd
                  + jj[None, :] * stride_pj,
                  mask=md[:, None] & (jj < W1)[None, :] & (src >= 0), other=0.0)
    old = old.to(tl.float32)                                           # [BD, BW]
    if PER_POSITION:
        m_lo = 1
        m_hi = T + 1
    else:
        m_lo = tl.minimum(tl.maximum(tl.load(n_ptr + i).to(tl.int64), 0), T)
        m_hi = m_lo + 1
    for m in range(m_lo, m_hi):
        if PER_POSITION:
            dst = tl.load(idx_ptr + i * stride_idx + m - 1).to(tl.int64)
        else:
            dst = src
        for j in tl.static_range(W1):
            s = m + j
            from_old = tl.sum(tl.where(jj[None, :] == s, old, 0.0), axis=1)
            from_x = tl.load(x_ptr + (bos + s - W1) * stride_xt + offs_d,
                             mask=md & (s >= W1), other=0.0).to(tl.float32)
            val = tl.where(s < W1, from_old, from_x)
            tl.store(pool_ptr + dst * stride_ps + offs_d * stride_pd + j * stride_pj,
                     val.to(pool_ptr.dtype.element_ty), mask=md & (dst >= 0))


@triton.jit
def _pool_col(pool_ptr, src, offs_d, md, c, stride_ps, stride_pd, stride_pj):
    """Column c of a request's old window ([BD] fp32; zeros for a slot < 0)."""
    return tl.load(pool_ptr + src * stride_ps + offs_d * stride_pd + c * stride_pj,
                   mask=md & (src >= 0), other=0.0).to(tl.float32)


@triton.jit(do_not_specialize=["stride_xt", "stride_yt", "stride_ysplit"],
            do_not_specialize_on_alignment=["x_ptr", "y_ptr", *_SMALL_INPUTS])
def conv_spec_verify_kernel(
    x_ptr, w_ptr, y_ptr, pool_ptr, idx_ptr, col_ptr, cu_ptr, dim,
    stride_xt, stride_yt, stride_wd, stride_wj, stride_ps, stride_pd, stride_pj, stride_idx,
    stride_ysplit,
    W: tl.constexpr, BW: tl.constexpr, BD: tl.constexpr, HAS_COLS: tl.constexpr,
    SILU: tl.constexpr, CHUNK: tl.constexpr = 8, SPLIT: tl.constexpr = 0,
):
    """y_t = sum_j w_j * z[t + j], z = cat(window, x^T) of the request; the window (read from
    idx[i, col[i]]) is never written. W <= 4 and CHUNK > 0: the taps once, the last W-1 inputs
    in registers, the window's rows CHUNK at a time in unrolled code (every row's load
    independent of the sums, so they can all be in flight); otherwise the taps and rows
    reloaded per token (CHUNK = 0: the baseline bench_batch times it against). SPLIT > 0:
    y is SPLIT-wide planes (column d at plane d // SPLIT, stride_ysplit apart: the q, k, v the
    KDA kernels read)."""
    i = tl.program_id(0)
    offs_d = tl.program_id(1) * BD + tl.arange(0, BD)
    md = offs_d < dim
    out_col = _out_col(offs_d, stride_ysplit, SPLIT)
    bos = tl.load(cu_ptr + i).to(tl.int64)
    T = tl.load(cu_ptr + i + 1).to(tl.int64) - bos
    col = 0
    if HAS_COLS:
        col = tl.load(col_ptr + i).to(tl.int64)
    src = tl.load(idx_ptr + i * stride_idx + col).to(tl.int64)
    if W <= 4 and CHUNK > 0:
        w_last, w_1, w_2, w_3 = _last_taps(w_ptr, offs_d, md, stride_wd, stride_wj, W)
        x_1 = _pool_col(pool_ptr, src, offs_d, md, W - 2, stride_ps, stride_pd, stride_pj)
        x_2 = x_1
        x_3 = x_1
        if W >= 3:
            x_2 = _pool_col(pool_ptr, src, offs_d, md, W - 3, stride_ps, stride_pd, stride_pj)
        if W >= 4:
            x_3 = _pool_col(pool_ptr, src, offs_d, md, 0, stride_ps, stride_pd, stride_pj)
        for t0 in range(0, T, CHUNK):
            # the chunk's loads first, in program order (y may alias x as far as the compiler
            # knows: a load written after a store would wait for it)
            rows = ()
            for u in tl.static_range(CHUNK):
                rows = rows + (tl.load(x_ptr + (bos + t0 + u) * stride_xt + offs_d,
                                       mask=md & (t0 + u < T), other=0.0),)
            for u in tl.static_range(CHUNK):
                t = t0 + u
                ok = md & (t < T)
                x_0 = rows[u].to(tl.float32)
                acc = _window_out(x_0, x_1, x_2, x_3, w_last, w_1, w_2, w_3, W, SILU)
                tl.store(y_ptr + (bos + t) * stride_yt + out_col,
                         acc.to(y_ptr.dtype.element_ty), mask=ok)
                x_3 = x_2
                x_2 = x_1
                x_1 = x_0
    else:
        jj = tl.arange(0, BW)
        old = tl.load(pool_ptr + src * stride_ps + offs_d[:, None] * stride_pd
                      + jj[None, :] * stride_pj,
                      mask=md[:, None] & (jj < W - 1)[None, :] & (src >= 0), other=0.0)
        old = old.to(tl.float32)                                       # [BD, BW]
        for t in range(T):
            acc = tl.zeros([BD], dtype=tl.float32)
            for j in tl.static_range(W):
                s = t + j
                w_j = tl.load(w_ptr + offs_d * stride_wd + j * stride_wj, mask=md, other=0.0)
                from_old = tl.sum(tl.where(jj[None, :] == s, old, 0.0), axis=1)
                from_x = tl.load(x_ptr + (bos + s - (W - 1)) * stride_xt + offs_d,
                                 mask=md & (s >= W - 1), other=0.0).to(tl.float32)
                acc += w_j.to(tl.float32) * tl.where(s < W - 1, from_old, from_x)
            if SILU:
                acc = _silu(acc)
            tl.store(y_ptr + (bos + t) * stride_yt + out_col, acc.to(y_ptr.dtype.element_ty),
                     mask=md)
