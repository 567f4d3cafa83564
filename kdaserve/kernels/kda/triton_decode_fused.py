"""Triton kernel of the fused KDA decode (imported lazily by decode_fused.py).

Programs (row, head, value block) do a head's one-token step: the causal conv of its q, k, v
channels (and the shift of their windows), the f_b / g_b up-projections of the gate rows, the
gate activation, l2norm, sigmoid beta, the gated delta rule on the block's [D, BV] columns of the
fp32 state and the gated RMS norm of the head's D outputs (the last program of a head finishes
it; see the kernel). Every state column and v conv channel belongs to exactly one program, the
q / k windows are shifted by one program after all have read them: in-place updates cannot
race between programs.
"""

import triton
import triton.language as tl

from kdaserve.kernels.triton_pdl import pdl_wait


@triton.jit
def _silu(x):
    return x / (1.0 + tl.exp(-x))


@triton.jit
def _conv_taps(w_ptr, ch, offs_j, stride_wd, stride_wj, W: tl.constexpr):
    """Conv weights of channels ch [D]: the taps on the window [D, BW] (zeros past W-1) and the
    tap on the new input [D], fp32."""
    w_win = tl.load(w_ptr + ch[:, None] * stride_wd + offs_j[None, :] * stride_wj,
                    mask=(offs_j < W - 1)[None, :], other=0.0)
    w_new = tl.load(w_ptr + ch * stride_wd + (W - 1) * stride_wj)
    return w_win.to(tl.float32), w_new.to(tl.float32)


@triton.jit
def _conv_load(cache_ptr, ch, offs_j, live, stride_cd, stride_cj, W: tl.constexpr):
    """The old window of channels ch ([D, BW], zeros for a dead slot or past W-1) and the same
    window read one column later (column j holds old column j+1; column W-2 is replaced by the
    new input before it is stored)."""
    ptrs = cache_ptr + ch[:, None] * stride_cd + offs_j[None, :] * stride_cj   # [D, BW]
    win = tl.load(ptrs, mask=(offs_j < W - 1)[None, :] & live, other=0.0)
    nxt = tl.load(ptrs + stride_cj, mask=(offs_j < W - 2)[None, :] & live, other=0.0)
    return win, nxt


@triton.jit
def _conv_out(win, w_win, x, w_new):
    """SiLU(causal conv) of one token [D] fp32 from its window [D, BW] and input x [D]."""
    return _silu(tl.sum(win.to(tl.float32) * w_win, axis=1) + x * w_new)


@triton.jit
def _conv_store(cache_ptr, ch, offs_j, live, nxt, x, stride_cd, stride_cj, W: tl.constexpr):
    """Window <- old columns 1..W-2 then x (in the cache's dtype)."""
    new = tl.where((offs_j == W - 2)[None, :], x[:, None].to(nxt.dtype), nxt)   # [D, BW]
    tl.store(cache_ptr + ch[:, None] * stride_cd + offs_j[None, :] * stride_cj, new,
             mask=(offs_j < W - 1)[None, :] & live)


@triton.jit
def _scratch_head(o_part_ptr, ss_part_ptr, head, offs, eps, D: tl.constexpr,
                  SPLITS: tl.constexpr):
    """A split head's gated outputs [D] from scratch, times its RMS norm scale (from the SPLITS
    programs' sums of squares). .cg: read at L2, past this SM's L1 (other SMs wrote them)."""
    ss = tl.load(ss_part_ptr + head * SPLITS + tl.arange(0, SPLITS), cache_modifier=".cg")
    o = tl.load(o_part_ptr + head * D + offs, cache_modifier=".cg")   # [D] fp32
    return o * tl.rsqrt(tl.sum(ss, axis=0) / D + eps)


@triton.jit
def _finish_head(o, out_ptr, n, h, stride_on, offs, cache, ch_q, ch_k, offs_j, live, nxt_q,
                 nxt_k, x_q, x_k, stride_cd, stride_cj, D: tl.constexpr, W: tl.constexpr):
    """Head h's normed outputs o [D] into out, and its q / k windows shifted by one column with
    the row's new inputs x_q / x_k (every program of the head has read the old ones)."""
    tl.store(out_ptr + n * stride_on + h * D + offs, o.to(out_ptr.dtype.element_ty))
    _conv_store(cache, ch_q, offs_j, live, nxt_q, x_q, stride_cd, stride_cj, W)
    _conv_store(cache, ch_k, offs_j, live, nxt_k, x_k, stride_cd, stride_cj, W)


@triton.jit
def _l2norm(x):
    return x / tl.sqrt(tl.sum(x * x, axis=0) + 1e-6)


@triton.jit
def kda_decode_fused_kernel(
    proj_ptr, conv_w_ptr, conv_ptr, rec_ptr, idx_ptr, fgb_ptr, a_log_ptr, dt_bias_ptr,
    norm_w_ptr, out_ptr, o_part_ptr, ss_part_ptr, ticket_ptr, graw_ptr, gout_ptr,
    P, eps, scale,
    stride_pn, stride_on, stride_wd, stride_wj, stride_cs, stride_cd, stride_cj,
    stride_rs, stride_rh, stride_rk, stride_rv, stride_fg, stride_fp, stride_gr, stride_go,
    D: tl.constexpr, W: tl.constexpr, BW: tl.constexpr, BV: tl.constexpr,
    USE_PDL: tl.constexpr = False, PREFETCH_STATE: tl.constexpr = False,
    FULL_RANK_GATE: tl.constexpr = False, LOWER_BOUND: tl.constexpr = 0.0,
    GATES_IN: tl.constexpr = False,
):
    """Program (n, h, s): row n's token through head h, value columns [s * BV, (s + 1) * BV)
    of its state. proj row n = [q | k | v (3P) | f_a (D) | g_a (D) | beta logits (H)]; the
    conv cache slot holds [3P, W-1] windows, the recurrent slot [H, D, D] fp32 states. A row
    whose state index is < 0 computes from a zero window and a zero state and writes neither
    (its output is still written).

    The delta rule is column-local in the value dimension (decay by key row, u[v], the rank-1
    write and the read all act on column v alone), so the D // BV programs of a head split its
    state without talking. Each recomputes q, k (conv + l2norm over all D channels) and the
    decay g (all D key rows) from the old windows, and owns its value channels: their conv
    windows, state columns and gated outputs. Two things need the whole head: the gated RMS
    norm (one scale per head) and the shift of the q / k windows (every program reads them).
    With BV == D one program holds the head and does both itself (no scratch, no ticket).
    Otherwise each program writes its gated, unnormalised outputs (fp32) and their sum of
    squares to scratch; with GATES_IN (the many-row steps) it ends there and
    kda_decode_norm_kernel, launched next, finishes every head. Without it the program then
    draws a ticket (an acq_rel atomic on ticket_ptr[n * H + h], after a CTA barrier: its
    stores and its window loads come before); the program that draws the last ticket sees
    every other program's scratch, applies the norm scale to the head's D outputs, stores the
    shifted q / k windows (every other program has read them by then) and resets the ticket to
    0 for the next launch or CUDA-graph replay.

    Kimi K3's variant: FULL_RANK_GATE, proj row n = [q | k | v | g (the output gate, P) | f_a (D)
    | beta logits (H)] and fgb_ptr holds f_b alone; LOWER_BOUND (< 0; 0 = none): the decay is
    LOWER_BOUND * sigmoid(exp(A_log) * (f_b f_a + dt_bias)) instead of -exp(A_log) *
    softplus(f_b f_a + dt_bias).

    GATES_IN: the gate pre-activation f_b f_a (graw_ptr, row n: [P]) and, without
    FULL_RANK_GATE, the output gate g_b g_a (gout_ptr, [P]) come computed (one GEMM over every
    row, before this launch) instead of from the [D, D] f_b and [BV, D] g_b tiles that each
    program would otherwise load and multiply: at many rows those tiles' registers and reads
    cost more than the GEMM. graw / gout are read after the wait (the GEMM's output). A split
    head is then finished by kda_decode_norm_kernel, not by a ticket (above).

    USE_PDL (programmatic dependent launch, sm_90+): only weights (conv taps, f_b / g_b rows,
    dt_bias, A_log, norm weight) are read before griddepcontrol.wait; proj, the state index,
    both caches and every store come after it, then launch_dependents. With PREFETCH_STATE
    the state index, the conv windows and the recurrent state columns are read before the wait
    too (they stream while the previous kernel, the input projection, finishes): the previous
    kernel must not write them. proj and every store still come after it.
    """
    n = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    s = tl.program_id(2)
    offs = tl.arange(0, D)                                          # [D] key channel
    offs_v = s * BV + tl.arange(0, BV)                              # [BV] value channel
    offs_j = tl.arange(0, BW)                                       # [BW] window column
    ch_q = h * D + offs
    ch_k = P + ch_q
    ch_v = 2 * P + h * D + offs_v
    # ---- weights: safe to read before the wait (nothing in the step writes them)
    if not GATES_IN:
        fb_ptrs = fgb_ptr + (h * D + offs)[:, None].to(tl.int64) * stride_fp + offs[None, :]
        f_b = tl.load(fb_ptrs)                                      # [D, D] gate rows of f_b
        if not FULL_RANK_GATE:
            gb_ptrs = (fgb_ptr + stride_fg + (h * D + offs_v)[:, None].to(tl.int64) * stride_fp
                       + offs[None, :])
            g_b = tl.load(gb_ptrs)                                  # [BV, D] rows of g_b
    wq_win, wq_new = _conv_taps(conv_w_ptr, ch_q, offs_j, stride_wd, stride_wj, W)
    wk_win, wk_new = _conv_taps(conv_w_ptr, ch_k, offs_j, stride_wd, stride_wj, W)
    wv_win, wv_new = _conv_taps(conv_w_ptr, ch_v, offs_j, stride_wd, stride_wj, W)
    dt_b = tl.load(dt_bias_ptr + h * D + offs).to(tl.float32)       # [D]
    neg_a = -tl.exp(tl.load(a_log_ptr + h).to(tl.float32))
    norm_w = tl.load(norm_w_ptr + offs_v).to(tl.float32)            # [BV]
    if USE_PDL and not PREFETCH_STATE:
        tl.extra.cuda.gdc_wait()                  # the previous kernel's writes are visible
        tl.extra.cuda.gdc_launch_dependents()
    # ---- state: the slot, its conv windows and recurrent state columns
    slot = tl.load(idx_ptr + n).to(tl.int64)
    live = slot >= 0
    cache = conv_ptr + tl.maximum(slot, 0) * stride_cs
    win_q, nxt_q = _conv_load(cache, ch_q, offs_j, live, stride_cd, stride_cj, W)
    win_k, nxt_k = _conv_load(cache, ch_k, offs_j, live, stride_cd, stride_cj, W)
    win_v, nxt_v = _conv_load(cache, ch_v, offs_j, live, stride_cd, stride_cj, W)
    s_ptrs = (rec_ptr + tl.maximum(slot, 0) * stride_rs + h * stride_rh
              + offs[:, None] * stride_rk + offs_v[None, :] * stride_rv)    # [D(k), BV]
    S = tl.load(s_ptrs, mask=live, other=0.0)                       # [D, BV] fp32
    if USE_PDL and PREFETCH_STATE:
        tl.extra.cuda.gdc_wait()                  # proj (the previous kernel's output) next
        tl.extra.cuda.gdc_launch_dependents()
    # ---- activations
    row = proj_ptr + n * stride_pn
    x_q = tl.load(row + ch_q).to(tl.float32)                        # [D] pre-conv inputs
    x_k = tl.load(row + ch_k).to(tl.float32)
    x_v = tl.load(row + ch_v).to(tl.float32)                        # [BV]
    if FULL_RANK_GATE:
        gate = tl.load(row + 3 * P + h * D + offs_v).to(tl.float32)  # [BV] output gate
        b_logit = tl.load(row + 4 * P + D + h).to(tl.float32)
        if not GATES_IN:
            f_a = tl.load(row + 4 * P + offs).to(tl.float32)        # [D] low-rank gate input
    else:
        b_logit = tl.load(row + 3 * P + 2 * D + h).to(tl.float32)
        if not GATES_IN:
            f_a = tl.load(row + 3 * P + offs).to(tl.float32)        # [D] low-rank gate input
            g_a = tl.load(row + 3 * P + D + offs).to(tl.float32)
    # ---- conv, gates, l2norm
    q = _l2norm(_conv_out(win_q, wq_win, x_q, wq_new)) * scale      # [D]
    k = _l2norm(_conv_out(win_k, wk_win, x_k, wk_new))
    v = _conv_out(win_v, wv_win, x_v, wv_new)                       # [BV]
    if GATES_IN:
        g = tl.load(graw_ptr + n * stride_gr + h * D + offs).to(tl.float32) + dt_b
        if not FULL_RANK_GATE:
            gate = tl.load(gout_ptr + n * stride_go + h * D + offs_v).to(tl.float32)
    else:
        g = tl.sum(f_b.to(tl.float32) * f_a[None, :], axis=1) + dt_b   # [D] pre-activation
        if not FULL_RANK_GATE:
            gate = tl.sum(g_b.to(tl.float32) * g_a[None, :], axis=1)   # [BV] output gate
    if LOWER_BOUND != 0.0:                                          # log decay (<= 0)
        g = LOWER_BOUND * tl.sigmoid(-neg_a * g)
    else:
        g = neg_a * tl.where(g > 20.0, g, tl.log(1.0 + tl.exp(g)))
    beta = tl.sigmoid(b_logit)
    # ---- gated delta rule on the program's value columns
    S = S * tl.exp(g)[:, None]
    u = (v - tl.sum(S * k[:, None], axis=0)) * beta                 # [BV]
    S = S + k[:, None] * u[None, :]
    o = tl.sum(S * q[:, None], axis=0)                              # [BV]
    sum_sq = tl.sum(o * o, axis=0)
    o = o * norm_w * tl.sigmoid(gate)                               # gated, not yet normalised
    tl.debug_barrier()                            # every window / state load before any store
    _conv_store(cache, ch_v, offs_j, live, nxt_v, x_v, stride_cd, stride_cj, W)
    tl.store(s_ptrs, S, mask=live)
    if BV == D:                                   # the whole head here: no scratch, no ticket
        _finish_head(o * tl.rsqrt(sum_sq / D + eps), out_ptr, n, h, stride_on, offs_v, cache,
                     ch_q, ch_k, offs_j, live, nxt_q, nxt_k, x_q, x_k, stride_cd, stride_cj, D,
                     W)
        return
    head = n * (P // D) + h                                         # ticket / scratch index
    tl.store(o_part_ptr + head * D + offs_v, o)
    tl.store(ss_part_ptr + head * (D // BV) + s, sum_sq)
    if GATES_IN:                                  # kda_decode_norm_kernel finishes the head
        return
    tl.debug_barrier()                            # every thread's stores before the ticket
    ticket = tl.atomic_add(ticket_ptr + head, 1, sem="acq_rel", scope="gpu")
    if ticket == D // BV - 1:                     # the head's last program
        o_all = _scratch_head(o_part_ptr, ss_part_ptr, head, offs, eps, D, D // BV)
        _finish_head(o_all, out_ptr, n, h, stride_on, offs, cache, ch_q, ch_k, offs_j, live,
                     nxt_q, nxt_k, x_q, x_k, stride_cd, stride_cj, D, W)
        tl.atomic_xchg(ticket_ptr + head, 0, sem="relaxed", scope="gpu")


@triton.jit
def kda_decode_norm_kernel(
    proj_ptr, conv_ptr, idx_ptr, o_part_ptr, ss_part_ptr, out_ptr, P, eps,
    stride_pn, stride_on, stride_cs, stride_cd, stride_cj,
    D: tl.constexpr, W: tl.constexpr, BW: tl.constexpr, SPLITS: tl.constexpr,
    USE_PDL: tl.constexpr = False,
):
    """Program (n, h), after kda_decode_fused_kernel's programs with GATES_IN have all run
    (stream order, or griddepcontrol.wait under USE_PDL): what the head's last ticket does
    otherwise. The gated RMS norm scale of head h from its SPLITS partial sums of squares
    applied to its D gated outputs (fp32 scratch) into out, and the shift of its q / k conv
    windows by one column with the row's new pre-conv inputs (every program has read them)."""
    pdl_wait(USE_PDL)
    n = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    offs = tl.arange(0, D)
    offs_j = tl.arange(0, BW)
    o = _scratch_head(o_part_ptr, ss_part_ptr, n * (P // D) + h, offs, eps, D, SPLITS)
    slot = tl.load(idx_ptr + n).to(tl.int64)
    live = slot >= 0
    cache = conv_ptr + tl.maximum(slot, 0) * stride_cs
    row = proj_ptr + n * stride_pn
    ch_q = h * D + offs
    ch_k = P + ch_q
    _, nxt_q = _conv_load(cache, ch_q, offs_j, live, stride_cd, stride_cj, W)
    _, nxt_k = _conv_load(cache, ch_k, offs_j, live, stride_cd, stride_cj, W)
    x_q = tl.load(row + ch_q)
    x_k = tl.load(row + ch_k)
    tl.debug_barrier()                            # every window load before any store
    _finish_head(o, out_ptr, n, h, stride_on, offs, cache, ch_q, ch_k, offs_j, live, nxt_q, nxt_k,
                 x_q, x_k, stride_cd, stride_cj, D, W)
