"""Triton kernels of the sort-free top-k / top-p threshold (imported lazily by top_p.py).

Buffers (all written before they are read, one launch after another on one stream):
- stats [B, S, 2] fp32: per split (max logit, min finite logit).
- state [L, B, P + 8] fp64, one slot per search pass, written by split 0 of the first pass and
  by narrow_kernel before every later one: [0, P) the pass's pivots, then lo, hi, row_max,
  row_min, tk, target (offsets below).
- part [B, S, P + 2] fp64, per split of the last pass: the weight of the tokens in [lo, hi) at
  or above each pivot, then the weight at or above hi, then the total weight.
  Weight = 1 per finite token (top-k search) or exp(l - row_max) for l >= tk (top-p search).

Launches: split_stats, then search passes with a narrow_kernel between two and after the last
(FINAL: it writes tau). PREV (constexpr of narrow_kernel) names the pass it narrows: 1 a top-k
pass, 2 the first top-p pass (its total weight fixes the target top_p * Z), 3 a later one.
"""

import triton
import triton.language as tl

# state slots after the P pivots
LO, HI, ROW_MAX, ROW_MIN, TK, TARGET = (tl.constexpr(i) for i in range(6))
# below row_max - 88, exp(l - row_max) carries no fp32 mass
MASS_RANGE = tl.constexpr(88.0)


@triton.jit
def split_stats_kernel(logits_ptr, stats_ptr, V, S, SPLIT_LEN, BLOCK: tl.constexpr):
    """Program (row, split): max and min finite logit of its slice -> stats[row, split]."""
    row = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1)
    start = split * SPLIT_LEN
    end = tl.minimum(start + SPLIT_LEN, V)
    mx = tl.full([BLOCK], float("-inf"), tl.float32)
    mn = tl.full([BLOCK], float("inf"), tl.float32)
    for off in range(start, end, BLOCK):
        offs = off + tl.arange(0, BLOCK)
        lg = tl.load(logits_ptr + row * V + offs, mask=offs < end, other=float("-inf"))
        mx = tl.maximum(mx, lg)
        mn = tl.minimum(mn, tl.where(lg > float("-inf"), lg, float("inf")))
    base = stats_ptr + (row * S + split) * 2
    tl.store(base, tl.max(mx, axis=0))
    tl.store(base + 1, tl.min(mn, axis=0))


@triton.jit
def _row_range(stats_row_ptr, S, RED_S: tl.constexpr):
    """stats[row] [S, 2] -> (row max, row min finite)."""
    mx = tl.full([RED_S], float("-inf"), tl.float32)
    mn = tl.full([RED_S], float("inf"), tl.float32)
    for s0 in range(0, S, RED_S):
        rows = s0 + tl.arange(0, RED_S)
        m = rows < S
        mx = tl.maximum(mx, tl.load(stats_row_ptr + rows * 2, mask=m, other=float("-inf")))
        mn = tl.minimum(mn, tl.load(stats_row_ptr + rows * 2 + 1, mask=m, other=float("inf")))
    return tl.max(mx, axis=0), tl.min(mn, axis=0)


@triton.jit
def _sum_splits(part_row_ptr, S, P: tl.constexpr, RED_S: tl.constexpr):
    """part[row] [S, P + 2] fp64 summed over the splits -> (window sums [P], edge sums [2])."""
    cols = tl.arange(0, P)
    e = tl.arange(0, 2)
    window = tl.zeros([P], tl.float64)
    edge = tl.zeros([2], tl.float64)
    for s0 in range(0, S, RED_S):
        rows = s0 + tl.arange(0, RED_S)
        base = part_row_ptr + rows[:, None] * (P + 2)
        m = rows[:, None] < S
        window += tl.sum(tl.load(base + cols[None, :], mask=m, other=0.0), axis=0)
        edge += tl.sum(tl.load(base + P + e[None, :], mask=m, other=0.0), axis=0)
    return window, edge


@triton.jit
def _pivots(lo, hi, P: tl.constexpr):
    """P pivots evenly spaced in (lo, hi], ascending, the last exactly hi."""
    j = tl.arange(0, P)
    x = lo + (hi - lo) * ((j + 1).to(tl.float32) / P)
    return tl.where(j == P - 1, hi, tl.minimum(x, hi))                  # [P] fp32


@triton.jit
def _narrow(lo, hi, piv, weight_ge, target):
    """Keep the invariant weight(l >= lo) >= target > weight(l >= hi): lo moves up to the
    highest pivot that still holds target, hi down to the lowest that does not."""
    ok = weight_ge >= target                                            # [P]
    lo = tl.maximum(lo, tl.max(tl.where(ok, piv, float("-inf")), axis=0))
    hi = tl.minimum(hi, tl.min(tl.where(ok, float("inf"), piv), axis=0))
    return lo, hi


@triton.jit
def _top_k_threshold(lo, total, top_k_ptr, row, V):
    """Finished top-k search -> tk: lo, or -inf when k is off or exceeds the finite tokens."""
    k = tl.load(top_k_ptr + row).to(tl.int64)
    enough = total >= tl.minimum(k, V).to(tl.float64)
    return tl.where((k > 0) & enough, lo, float("-inf"))


@triton.jit
def _advance(row, prev_state_ptr, prev_part_ptr, top_k_ptr, top_p_ptr, V, S,
             PREV: tl.constexpr, P: tl.constexpr, RED_S: tl.constexpr):
    """Narrow the previous launch's interval with its partial sums.

    Returns (lo, hi, row_max, row_min, tk, target, total weight of the previous pass)."""
    st = prev_state_ptr + row * (P + 8)
    piv = tl.load(st + tl.arange(0, P)).to(tl.float32)                 # [P]
    lo = tl.load(st + P + LO).to(tl.float32)
    hi = tl.load(st + P + HI).to(tl.float32)
    row_max = tl.load(st + P + ROW_MAX).to(tl.float32)
    row_min = tl.load(st + P + ROW_MIN).to(tl.float32)
    tk = tl.load(st + P + TK).to(tl.float32)
    target = tl.load(st + P + TARGET)
    part = prev_part_ptr + row * S * (P + 2)
    window, edge = _sum_splits(part, S, P, RED_S)      # [P] in [lo, hi); [2] (>= hi, all)
    e = tl.arange(0, 2)
    above = tl.sum(tl.where(e == 0, edge, 0.0), axis=0)
    total = tl.sum(tl.where(e == 1, edge, 0.0), axis=0)
    if PREV == 1:       # k > V means V; an off row (k <= 0) searches k = 1 harmlessly
        k = tl.load(top_k_ptr + row).to(tl.int64)
        target = tl.where(k > 0, tl.minimum(k, V), 1).to(tl.float64)
    if PREV == 2:
        top_p = tl.minimum(tl.load(top_p_ptr + row), 1.0).to(tl.float64)
        target = top_p * total
    lo, hi = _narrow(lo, hi, piv, above + window, target)
    return lo, hi, row_max, row_min, tk, target, total


@triton.jit
def _weights(lg, row_max, tk, MASS: tl.constexpr):
    """Each token's weight: exp(l - row_max) over l >= tk (MASS) else 1 per finite token."""
    if MASS:
        return tl.where(lg >= tk, tl.exp(lg - row_max), 0.0)
    return tl.where(lg > float("-inf"), 1.0, 0.0)


@triton.jit
def _accumulate(row_ptr, start, end, piv, lo, hi, row_max, tk,
                MASS: tl.constexpr, P: tl.constexpr, BLOCK: tl.constexpr, SUB: tl.constexpr):
    """One slice -> (weight of the tokens in [lo, hi) at or above each pivot [P],
    [weight of l >= hi, total weight] [2]).

    The slice streams by BLOCK tokens with the next block's load issued before the current
    block's work, so a program keeps a load in flight. The edge sums accumulate per element
    (fp32: a slice is a few blocks) and reduce once after the loop, in fp64. A block with a token
    in [lo, hi) (every block in the first passes, few once the window is narrow) compares its
    tokens with the pivots SUB at a time, reloaded from cache, into a [SUB, P] fp32 tile that
    is reduced once per block, in fp64: per token and pivot a compare, a select and
    an add, no cross-thread step, and SUB / BLOCK of the registers a [BLOCK, P] tile would
    take, which keeps enough programs an SM to hide the loads."""
    window = tl.zeros([P], tl.float64)
    above = tl.zeros([BLOCK], tl.float32)
    total = tl.zeros([BLOCK], tl.float32)
    offs = start + tl.arange(0, BLOCK)
    lg = tl.load(row_ptr + offs, mask=offs < end, other=float("-inf"))      # [BLOCK]
    for off in range(start, end, BLOCK):
        nxt_offs = off + BLOCK + tl.arange(0, BLOCK)
        nxt = tl.load(row_ptr + nxt_offs, mask=nxt_offs < end, other=float("-inf"))
        w = _weights(lg, row_max, tk, MASS)
        above += tl.where(lg >= hi, w, 0.0)
        total += w
        inside = (lg >= lo) & (lg < hi)
        if tl.max(inside.to(tl.int32), axis=0) > 0:
            win = tl.zeros([SUB, P], tl.float32)
            for c in range(off, off + BLOCK, SUB):
                so = c + tl.arange(0, SUB)
                sl = tl.load(row_ptr + so, mask=so < end, other=float("-inf"))   # [SUB]
                sw = tl.where((sl >= lo) & (sl < hi), _weights(sl, row_max, tk, MASS), 0.0)
                win += tl.where(sl[:, None] >= piv[None, :], sw[:, None], 0.0)  # [SUB, P]
            window += tl.sum(win.to(tl.float64), axis=0)
        lg = nxt
    e = tl.arange(0, 2)
    edge = tl.where(e == 0, tl.sum(above.to(tl.float64), axis=0),
                    tl.sum(total.to(tl.float64), axis=0))                   # [2]
    return window, edge


@triton.jit
def _store_state(st, piv, lo, hi, row_max, row_min, tk, target, mask, P: tl.constexpr):
    """One row's state slot (layout in the module docstring); stores only where mask."""
    j = tl.arange(0, P)
    tl.store(st + j, piv, mask=(j < P) & mask)
    tl.store(st + P + LO, lo, mask=mask)
    tl.store(st + P + HI, hi, mask=mask)
    tl.store(st + P + ROW_MAX, row_max, mask=mask)
    tl.store(st + P + ROW_MIN, row_min, mask=mask)
    tl.store(st + P + TK, tk, mask=mask)
    tl.store(st + P + TARGET, target, mask=mask)


@triton.jit
def search_pass_kernel(logits_ptr, stats_ptr, state_ptr, part_ptr, V, S, SPLIT_LEN,
                       FIRST: tl.constexpr, MASS: tl.constexpr, P: tl.constexpr,
                       BLOCK: tl.constexpr, SUB: tl.constexpr, RED_S: tl.constexpr):
    """Program (row, split): sum its slice's weights at the pass's P pivots into
    part[row, split]. The pivots come from state[row] (narrow_kernel wrote them), or with FIRST
    from the stats (the first pass: the row's range; split 0 stores the state).
    MASS: top-p search (weights exp(l - row_max) over l >= tk) else top-k search (counts)."""
    row = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1)
    st = state_ptr + row * (P + 8)
    if FIRST:
        row_max, row_min = _row_range(stats_ptr + row * S * 2, S, RED_S)
        tk = float("-inf")
        if MASS:
            lo = tl.maximum(row_max - MASS_RANGE, row_min)
        else:
            lo = row_min
        hi = row_max
        piv = _pivots(lo, hi, P)                                        # [P]
        _store_state(st, piv, lo, hi, row_max, row_min, tk, 0.0, split == 0, P)
    else:
        piv = tl.load(st + tl.arange(0, P)).to(tl.float32)
        lo = tl.load(st + P + LO).to(tl.float32)
        hi = tl.load(st + P + HI).to(tl.float32)
        row_max = tl.load(st + P + ROW_MAX).to(tl.float32)
        tk = tl.load(st + P + TK).to(tl.float32)
    start = split * SPLIT_LEN
    end = tl.minimum(start + SPLIT_LEN, V)
    window, edge = _accumulate(logits_ptr + row * V, start, end, piv, lo, hi, row_max, tk,
                               MASS, P, BLOCK, SUB)
    out = part_ptr + (row * S + split) * (P + 2)
    tl.store(out + tl.arange(0, P), window)
    tl.store(out + P + tl.arange(0, 2), edge)


# per-row scalars (top_k, top_p, tau) may come as row slices of larger buffers: their alignment
# must not make a new variant
@triton.jit(do_not_specialize_on_alignment=["top_k_ptr", "top_p_ptr", "tau_ptr"])
def narrow_kernel(prev_state_ptr, part_ptr, state_ptr, top_k_ptr, top_p_ptr, tau_ptr, V, S,
                  PREV: tl.constexpr, MASS: tl.constexpr, FINAL: tl.constexpr,
                  P: tl.constexpr, RED_S: tl.constexpr):
    """Program (row): the previous pass's interval narrowed with its partial sums (once a row,
    not in every search program). FINAL: tau = max(tk, tp) (off filters give -inf) into
    tau[row]; else the next pass's state into state[row] (MASS: the next pass is a top-p
    search; after a top-k one it starts over in [tk, row_max])."""
    row = tl.program_id(0).to(tl.int64)
    lo, hi, row_max, row_min, tk, target, total = _advance(
        row, prev_state_ptr, part_ptr, top_k_ptr, top_p_ptr, V, S, PREV, P, RED_S)
    if FINAL:
        if PREV == 1:
            tau = _top_k_threshold(lo, total, top_k_ptr, row, V)
        else:
            top_p = tl.load(top_p_ptr + row)
            tau = tl.maximum(tk, tl.where(top_p < 1.0, lo, float("-inf")))
        tl.store(tau_ptr + row, tau)
    else:
        if MASS:
            if PREV == 1:       # the top-k search just ended: start top-p in [tk, row_max]
                tk = _top_k_threshold(lo, total, top_k_ptr, row, V)
                lo = tl.maximum(tl.maximum(row_max - MASS_RANGE, row_min), tk)
                hi = row_max
        piv = _pivots(lo, hi, P)
        _store_state(state_ptr + row * (P + 8), piv, lo, hi, row_max, row_min, tk, target,
                     row >= 0, P)                                      # every row stores
