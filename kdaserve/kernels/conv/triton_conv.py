"""Triton kernels for the depthwise causal conv of KDA (imported lazily by causal_conv1d.py).

Varlen prefill runs in two launches: `conv_varlen_kernel` (a row at a time) reads the initial
windows from the state slots, then `conv_varlen_state_kernel` overwrites those slots with each
sequence's last W-1 inputs (a later launch, so no program reads a slot another program already
rewrote).

USE_PDL (every kernel; programmatic dependent launch, sm_90+): griddepcontrol.wait, then
griddepcontrol.launch_dependents, before any load of x, the states, the indices or lengths and
before any store; only conv_update_kernel reads the conv weight (immutable) before the wait.
USE_PDL=False generates the same code as before the flag existed.
"""

import triton
import triton.language as tl

from kdaserve.kernels.triton_pdl import pdl_wait


@triton.jit
def _silu(x):
    return x / (1.0 + tl.exp(-x))


@triton.jit
def _out_col(offs_d, stride_ysplit, SPLIT: tl.constexpr):
    """Output column offset of channel d: plain, or split into SPLIT-wide planes (y[d // SPLIT]
    is its own contiguous [T, SPLIT] tensor: q, k, v come out ready for the KDA kernels)."""
    col = offs_d.to(tl.int64)
    if SPLIT > 0:
        col = (offs_d // SPLIT).to(tl.int64) * stride_ysplit + offs_d % SPLIT
    return col


@triton.jit
def _last_taps(w_ptr, offs_d, mask_d, stride_wd, stride_wj, W: tl.constexpr):
    """The row-walking kernels' taps, fp32 [BLOCK_D] each, for W <= 4: (the newest input's,
    the one before, two before, three before); the ones past W repeat w_1 (unread)."""
    w_last = tl.load(w_ptr + offs_d * stride_wd + (W - 1) * stride_wj, mask=mask_d,
                     other=0.0).to(tl.float32)
    w_1 = tl.load(w_ptr + offs_d * stride_wd + (W - 2) * stride_wj, mask=mask_d,
                  other=0.0).to(tl.float32)
    w_2 = w_1
    w_3 = w_1
    if W >= 3:
        w_2 = tl.load(w_ptr + offs_d * stride_wd + (W - 3) * stride_wj, mask=mask_d,
                      other=0.0).to(tl.float32)
    if W >= 4:
        w_3 = tl.load(w_ptr + offs_d * stride_wd, mask=mask_d, other=0.0).to(tl.float32)
    return w_last, w_1, w_2, w_3


@triton.jit
def _window_out(x_0, x_1, x_2, x_3, w_last, w_1, w_2, w_3, W: tl.constexpr, SILU: tl.constexpr):
    """One output row of a W <= 4 window: x_0 the row's input, x_1 .. x_3 the inputs before."""
    acc = x_0 * w_last + x_1 * w_1
    if W >= 3:
        acc += x_2 * w_2
    if W >= 4:
        acc += x_3 * w_3
    if SILU:
        acc = _silu(acc)
    return acc


@triton.jit
def _seq_of(cu_seqlens_ptr, t, num_seqs, SEARCH_STEPS: tl.constexpr):
    """The sequence holding token t: the last b with cu_seqlens[b] <= t (an empty sequence
    starting at t gives way to the one after it)."""
    lo = t * 0
    hi = lo + num_seqs
    for _ in tl.static_range(SEARCH_STEPS):
        mid = (lo + hi) // 2
        right = tl.load(cu_seqlens_ptr + mid) <= t
        lo = tl.where(right, mid, lo)
        hi = tl.where(right, hi, mid)
    return lo


@triton.jit(do_not_specialize=["num_tokens", "num_seqs"])
def conv_varlen_kernel(
    x_ptr, w_ptr, y_ptr, cu_seqlens_ptr, states_ptr, state_idx_ptr, has_init_ptr,
    num_tokens, dim, num_seqs,
    stride_xt, stride_yt, stride_wd, stride_wj, stride_ss, stride_sd, stride_sj, stride_ysplit,
    W: tl.constexpr, SEARCH_STEPS: tl.constexpr, SILU: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, SPLIT: tl.constexpr = 0,
    USE_PDL: tl.constexpr = False,
):
    """y of the varlen prefill, a row at a time: program (row tile, channel block) walks its
    BLOCK_T rows in order over BLOCK_D channels, each input row loaded once and the last W-1
    kept in registers (a [BLOCK_T, BLOCK_D] tile kernel loads every row W times and holds W
    tiles, which spill at the 48B's shapes; it measured slower and is gone). Tiles inside one
    sequence, at least W-1 rows past its start (all but a few in a prefill), take that path
    for W <= 4; the others compute each row from its own window (the sequence's state columns
    before its first token, zeros without an initial state, zeros past cu_seqlens[-1])."""
    pdl_wait(USE_PDL)
    t0 = tl.program_id(0) * BLOCK_T
    offs_d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    mask_d = offs_d < dim
    col = _out_col(offs_d, stride_ysplit, SPLIT)
    total = tl.load(cu_seqlens_ptr + num_seqs)
    seq = _seq_of(cu_seqlens_ptr, t0, num_seqs, SEARCH_STEPS)
    start = tl.load(cu_seqlens_ptr + seq)
    end = tl.load(cu_seqlens_ptr + seq + 1)
    fast = (t0 - start >= W - 1) & (t0 + BLOCK_T <= end) & (W <= 4)
    if fast:
        w_last, w_1, w_2, w_3 = _last_taps(w_ptr, offs_d, mask_d, stride_wd, stride_wj, W)
        x_rows = x_ptr + offs_d
        x_1 = tl.load(x_rows + (t0 - 1).to(tl.int64) * stride_xt, mask=mask_d,
                      other=0.0).to(tl.float32)                          # row t - 1
        x_2 = x_1
        x_3 = x_1
        if W >= 3:
            x_2 = tl.load(x_rows + (t0 - 2).to(tl.int64) * stride_xt, mask=mask_d,
                          other=0.0).to(tl.float32)                      # row t - 2
        if W >= 4:
            x_3 = tl.load(x_rows + (t0 - 3).to(tl.int64) * stride_xt, mask=mask_d,
                          other=0.0).to(tl.float32)                      # row t - 3
        # every row's load first, in program order: y may alias x as far as the compiler
        # knows, so a load written after a store would wait for it (one row in flight)
        rows = ()
        for t in tl.static_range(BLOCK_T):
            rows = rows + (tl.load(x_rows + (t0 + t).to(tl.int64) * stride_xt, mask=mask_d,
                                   other=0.0),)
        for t in tl.static_range(BLOCK_T):
            row = (t0 + t).to(tl.int64)
            x_0 = rows[t].to(tl.float32)
            acc = _window_out(x_0, x_1, x_2, x_3, w_last, w_1, w_2, w_3, W, SILU)
            tl.store(y_ptr + row * stride_yt + col, acc.to(y_ptr.dtype.element_ty), mask=mask_d)
            x_3 = x_2
            x_2 = x_1
            x_1 = x_0
    else:
        for t in range(BLOCK_T):
            row = t0 + t
            if row < num_tokens:
                live = row < total                     # rows past cu_seqlens[-1]: zeros
                b = _seq_of(cu_seqlens_ptr, row, num_seqs, SEARCH_STEPS)
                pos = row - tl.load(cu_seqlens_ptr + b)
                slot = tl.load(state_idx_ptr + b).to(tl.int64)
                has = (tl.load(has_init_ptr + b) != 0) & (slot >= 0)
                acc = tl.zeros([BLOCK_D], dtype=tl.float32)
                for j in tl.static_range(W):
                    w_j = tl.load(w_ptr + offs_d * stride_wd + j * stride_wj, mask=mask_d,
                                  other=0.0).to(tl.float32)
                    src = pos - (W - 1) + j                    # position in the sequence
                    xv = tl.load(x_ptr + (row - (W - 1) + j).to(tl.int64) * stride_xt + offs_d,
                                 mask=mask_d & live & (src >= 0), other=0.0)
                    sv = tl.load(states_ptr + slot * stride_ss + offs_d * stride_sd
                                 + (W - 1 + src) * stride_sj,
                                 mask=mask_d & live & (src < 0) & has, other=0.0)
                    acc += (xv.to(tl.float32) + sv.to(tl.float32)) * w_j
                if SILU:
                    acc = _silu(acc)
                acc = tl.where(live, acc, 0.0)
                tl.store(y_ptr + row.to(tl.int64) * stride_yt + col,
                         acc.to(y_ptr.dtype.element_ty), mask=mask_d)


@triton.jit
def conv_varlen_state_kernel(
    x_ptr, cu_seqlens_ptr, states_ptr, state_idx_ptr, has_init_ptr, dim,
    stride_xt, stride_ss, stride_sd, stride_sj,
    W: tl.constexpr, BLOCK_W: tl.constexpr, BLOCK_D: tl.constexpr,
    USE_PDL: tl.constexpr = False,
):
    pdl_wait(USE_PDL)
    seq = tl.program_id(0)
    slot = tl.load(state_idx_ptr + seq).to(tl.int64)
    if slot < 0:
        return
    offs_d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    mask_d = offs_d < dim
    start = tl.load(cu_seqlens_ptr + seq)
    length = tl.load(cu_seqlens_ptr + seq + 1) - start
    has = tl.load(has_init_ptr + seq) != 0
    j = tl.arange(0, BLOCK_W)
    mask_j = j < W - 1
    src = length - (W - 1) + j                     # sequence position of new window column j
    from_x = (src >= 0) & mask_j
    xv = tl.load(x_ptr + (start + src).to(tl.int64)[None, :] * stride_xt + offs_d[:, None],
                 mask=mask_d[:, None] & from_x[None, :], other=0.0)
    base = states_ptr + slot * stride_ss + offs_d[:, None] * stride_sd
    # the old window is read whole before any store: column j of the new window may come from old
    # column length + j, which another thread of this program overwrites
    old = tl.load(base + j[None, :] * stride_sj,
                  mask=mask_d[:, None] & mask_j[None, :] & has, other=0.0).to(tl.float32)
    pick = (j[None, :] == (length + j)[:, None]) & (src < 0)[:, None]   # [new col, old col]
    sv = tl.sum(tl.where(pick[None, :, :], old[:, None, :], 0.0), axis=2)
    new = xv.to(tl.float32) + sv                  # [BLOCK_D, BLOCK_W]
    tl.store(base + j[None, :] * stride_sj, new.to(states_ptr.dtype.element_ty),
             mask=mask_d[:, None] & mask_j[None, :])


@triton.jit
def _update_weights(w_ptr, offs_d, mask_d, stride_wd, stride_wj, W: tl.constexpr,
                    BLOCK_W: tl.constexpr):
    """(the taps applied to the W-1 state columns [BLOCK_D, BLOCK_W], the tap applied to x
    [BLOCK_D]) of channels offs_d, in fp32."""
    j = tl.arange(0, BLOCK_W)
    w_win = tl.load(w_ptr + offs_d[:, None] * stride_wd + j[None, :] * stride_wj,
                    mask=mask_d[:, None] & (j < W - 1)[None, :], other=0.0).to(tl.float32)
    w_last = tl.load(w_ptr + offs_d * stride_wd + (W - 1) * stride_wj, mask=mask_d,
                     other=0.0).to(tl.float32)
    return w_win, w_last


@triton.jit
def conv_update_kernel(
    x_ptr, w_ptr, y_ptr, states_ptr, state_idx_ptr, dim,
    stride_xb, stride_yb, stride_wd, stride_wj, stride_ss, stride_sd, stride_sj, stride_ysplit,
    W: tl.constexpr, BLOCK_W: tl.constexpr, SILU: tl.constexpr, BLOCK_D: tl.constexpr,
    SPLIT: tl.constexpr = 0, USE_PDL: tl.constexpr = False,
):
    """Program (b, channel block): y[b] = the window of W-1 state columns and x[b] times the
    weight (+ SiLU), then the state shifted left by one with x[b] appended. USE_PDL: the weight
    (immutable) is loaded before griddepcontrol.wait; the index, state, x and stores after it."""
    b = tl.program_id(0)
    offs_d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    mask_d = offs_d < dim
    if USE_PDL:   # the weight is immutable: load it while the previous kernel finishes
        w_win, w_last = _update_weights(w_ptr, offs_d, mask_d, stride_wd, stride_wj, W, BLOCK_W)
        pdl_wait(USE_PDL)
    slot = tl.load(state_idx_ptr + b).to(tl.int64)
    live = slot >= 0                               # slot < 0: padding row, zero window, no write
    j = tl.arange(0, BLOCK_W)
    mask_j = j < W - 1
    base = states_ptr + tl.maximum(slot, 0) * stride_ss + offs_d[:, None] * stride_sd
    m2 = mask_d[:, None] & mask_j[None, :] & live
    win = tl.load(base + j[None, :] * stride_sj, mask=m2, other=0.0).to(tl.float32)  # [BD, BW]
    xv = tl.load(x_ptr + b.to(tl.int64) * stride_xb + offs_d, mask=mask_d, other=0.0)
    if not USE_PDL:
        w_win, w_last = _update_weights(w_ptr, offs_d, mask_d, stride_wd, stride_wj, W, BLOCK_W)
    acc = tl.sum(win * w_win, axis=1) + xv.to(tl.float32) * w_last
    if SILU:
        acc = _silu(acc)
    tl.store(y_ptr + b.to(tl.int64) * stride_yb + _out_col(offs_d, stride_ysplit, SPLIT),
             acc.to(y_ptr.dtype.element_ty), mask=mask_d)
    # shift the window left by one (in registers: no re-read of columns being rewritten), append x
    shift = j[None, :] == (j + 1)[:, None]                                # [new col, old col]
    new = tl.sum(tl.where(shift[None, :, :], win[:, None, :], 0.0), axis=2)
    new = tl.where((j == W - 2)[None, :], xv[:, None].to(tl.float32), new)
    tl.store(base + j[None, :] * stride_sj, new.to(states_ptr.dtype.element_ty), mask=m2)
