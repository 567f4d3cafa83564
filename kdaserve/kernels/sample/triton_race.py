"""Triton kernels of the exponential race (imported lazily by race.py).

race_partial_kernel: program (row, split) scans its slice of the row once: token v is kept
when its logit l_v is finite and at or above the row's threshold, and scores l_v - log(E_v)
with E_v ~ Exp(1) from Philox keyed by the row's seed, word v % 4 at counter v // 4 (so a
token's noise depends on its row's seed and its index only, not on the batch or the split).
The slice's best (score, index) goes to part_val / part_idx [B, S]. race_reduce_kernel:
program (row) takes the best of its S partials, the lowest index among equal scores.
"""

import triton
import triton.language as tl

# v = (r + 0.5) * 2^-32 for a 32-bit Philox draw r: uniform on (0, 1), finest near 0, where
# E = -log(1 - v) is small, i.e. where the race's winners are
_INV_2_32 = tl.constexpr(2.3283064365386963e-10)
_HALF_ULP = tl.constexpr(1.1641532182693481e-10)
_SERIES_BELOW = tl.constexpr(0.0078125)


@triton.jit
def _exp1(seed, off, BLOCK: tl.constexpr):
    """Exp(1) draws for tokens off .. off + BLOCK - 1 (off a multiple of 4) under key seed: token
    v takes word v % 4 of Philox4x32 at counter v // 4 (one Philox evaluation per 4 tokens, a
    token's draw still a function of its seed and index alone), by inversion E = -log(1 - v):
    the series v + v^2 / 2 + v^3 / 3 below 2^-7 (exact to fp32 rounding there, where 1 - v
    would lose v's low bits), the log above. v rounds to 1 for the largest few r: E = inf, a
    score of -inf (that token sits the draw out, with probability 2^-25)."""
    c = off // 4 + tl.arange(0, BLOCK // 4)
    r0, r1, r2, r3 = tl.randint4x(seed, c)                               # uint32 [BLOCK / 4]
    r = tl.interleave(tl.interleave(r0, r2), tl.interleave(r1, r3))      # [BLOCK]: word v % 4
    v = r.to(tl.float32) * _INV_2_32 + _HALF_ULP
    series = v + v * v * (0.5 + v * 0.3333333333333333)
    return tl.where(v < _SERIES_BELOW, series, -tl.log(1.0 - v))


# per-row scalars (tau, temperature, seed, previous token) may come as row slices of larger
# buffers: their alignment must not make a new variant
@triton.jit(do_not_specialize=["V", "split_len", "stride_lb", "stride_prev"],
            do_not_specialize_on_alignment=["tau_ptr", "temp_ptr", "seed_ptr", "prev_ptr"])
def race_partial_kernel(logits_ptr, tau_ptr, temp_ptr, seed_ptr, part_val_ptr, part_idx_ptr,
                        emb_ptr, proj_ptr, prev_ptr, V, split_len, stride_lb, stride_prev,
                        HAS_TAU: tl.constexpr, HAS_TEMP: tl.constexpr, MARKOV: tl.constexpr,
                        RANK: tl.constexpr, BLOCK: tl.constexpr):
    """Program (row, split): the best race score over tokens [split * split_len, +split_len)
    of the row, and its index (the row's first kept token of that slice on ties within a
    block, the earliest block across blocks); (-inf, slice start) when nothing is kept.
    HAS_TEMP: the row's logits are divided by its temperature first, and a row with T < 1e-5
    scores its raw logits without noise (greedy: the argmax).
    MARKOV (a DSpark Markov head position): first the logits get the bias of the row's
    previous token p = prev[row * stride_prev], proj[v] . emb[p] (a rank-RANK product, fp32,
    rounded to the weights' dtype as a GEMM's output would be), and are written back."""
    row = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1)
    S = tl.num_programs(1)
    start = split * split_len
    end = tl.minimum(start + split_len, V)
    seed = tl.load(seed_ptr + row)
    tau = float("-inf")
    if HAS_TAU:
        tau = tl.load(tau_ptr + row)
    inv_t = 1.0
    noisy = True
    if HAS_TEMP:
        t = tl.load(temp_ptr + row)
        noisy = t >= 1e-5
        inv_t = 1.0 / tl.where(noisy, t, 1.0)
    r = tl.arange(0, RANK)
    e = tl.zeros([RANK], tl.float32)
    if MARKOV:
        prev = tl.load(prev_ptr + row * stride_prev).to(tl.int64)
        e = tl.load(emb_ptr + prev * RANK + r).to(tl.float32)               # [RANK]
    best_val = float("-inf")
    best_idx = start
    for off in range(start, end, BLOCK):
        offs = off + tl.arange(0, BLOCK)
        lg = tl.load(logits_ptr + row * stride_lb + offs, mask=offs < end,
                     other=float("-inf"))                                 # [BLOCK]
        if MARKOV:
            w = tl.load(proj_ptr + offs[:, None].to(tl.int64) * RANK + r[None, :],
                        mask=(offs < end)[:, None], other=0.0)              # [BLOCK, RANK]
            bias = tl.sum(w.to(tl.float32) * e[None, :], axis=1)
            lg += bias.to(proj_ptr.dtype.element_ty).to(tl.float32)
            tl.store(logits_ptr + row * stride_lb + offs, lg, mask=offs < end)
        if HAS_TEMP:
            lg = lg * inv_t
        keep = (lg >= tau) & (lg > float("-inf"))
        if HAS_TEMP:
            noise = tl.where(noisy, tl.log(_exp1(seed, off, BLOCK)), 0.0)
        else:
            noise = tl.log(_exp1(seed, off, BLOCK))
        score = tl.where(keep, lg - noise, float("-inf"))
        val, j = tl.max(score, axis=0, return_indices=True)
        better = val > best_val
        best_idx = tl.where(better, off + j, best_idx)
        best_val = tl.where(better, val, best_val)
    tl.store(part_val_ptr + row * S + split, best_val)
    tl.store(part_idx_ptr + row * S + split, best_idx)


@triton.jit(do_not_specialize=["S"])   # S follows the batch size: one build for all
def race_reduce_kernel(part_val_ptr, part_idx_ptr, out_ptr, S, BLOCK_S: tl.constexpr):
    """Program (row): out[row] = the index of the best of the row's S partials (the lowest
    index among equal scores)."""
    row = tl.program_id(0).to(tl.int64)
    s = tl.arange(0, BLOCK_S)
    val = tl.load(part_val_ptr + row * S + s, mask=s < S, other=float("-inf"))
    idx = tl.load(part_idx_ptr + row * S + s, mask=s < S, other=2147483647)
    best = tl.max(val, axis=0)
    pick = tl.min(tl.where((val == best) & (s < S), idx, 2147483647), axis=0)
    tl.store(out_ptr + row, pick.to(tl.int64))
