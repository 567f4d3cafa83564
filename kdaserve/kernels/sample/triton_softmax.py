"""Triton kernels of the row softmax over a vocabulary (imported lazily by softmax.py).

softmax_stats_kernel: program (row, split) -> the max of its slice's tempered logits and the
sum of exp(l / T - max) there ([B, S, 2]). softmax_write_kernel: program (row, split) merges
the row's S pairs (max m = the largest, Z = sum z_s exp(m_s - m)) and writes
exp(l / T - m) / Z over its slice, or the one-hot of the row's id where T < 1e-5.
"""

import triton
import triton.language as tl


@triton.jit
def _inv_temp(temp_ptr, row, HAS_TEMP: tl.constexpr):
    """(1 / T, whether the row is sampled (T >= 1e-5)); (1, True) without temperatures."""
    if HAS_TEMP:
        t = tl.load(temp_ptr + row)
        sampled = t >= 1e-5
        return 1.0 / tl.where(sampled, t, 1.0), sampled
    return 1.0, True


# the per-row temperature / id may come as row slices of larger buffers: their alignment must
# not make a new variant
@triton.jit(do_not_specialize=["V", "split_len", "stride_lb"],
            do_not_specialize_on_alignment=["temp_ptr"])
def softmax_stats_kernel(logits_ptr, temp_ptr, stats_ptr, V, split_len, stride_lb,
                         HAS_TEMP: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1)
    S = tl.num_programs(1)
    start = split * split_len
    end = tl.minimum(start + split_len, V)
    inv_t, _ = _inv_temp(temp_ptr, row, HAS_TEMP)
    m = tl.full([BLOCK], float("-inf"), tl.float32)
    z = tl.zeros([BLOCK], tl.float32)
    for off in range(start, end, BLOCK):
        offs = off + tl.arange(0, BLOCK)
        x = tl.load(logits_ptr + row * stride_lb + offs, mask=offs < end,
                    other=float("-inf")) * inv_t                          # [BLOCK]
        m_new = tl.maximum(m, x)
        # lanes still at -inf keep z = 0 (no -inf - -inf)
        safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        z = z * tl.exp(m - safe) + tl.exp(x - safe)
        m = m_new
    mx = tl.max(m, axis=0)
    safe = tl.where(mx == float("-inf"), 0.0, mx)
    tot = tl.sum(z * tl.exp(m - safe), axis=0)
    out = stats_ptr + (row * S + split) * 2
    tl.store(out, mx)
    tl.store(out + 1, tot)


@triton.jit(do_not_specialize=["V", "split_len", "stride_lb", "stride_ob", "S"],
            do_not_specialize_on_alignment=["temp_ptr", "ids_ptr"])
def softmax_write_kernel(logits_ptr, temp_ptr, ids_ptr, stats_ptr, out_ptr, V, split_len,
                         stride_lb, stride_ob, S, HAS_TEMP: tl.constexpr,
                         HAS_IDS: tl.constexpr, BLOCK: tl.constexpr,
                         BLOCK_S: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1)
    start = split * split_len
    end = tl.minimum(start + split_len, V)
    inv_t, sampled = _inv_temp(temp_ptr, row, HAS_TEMP)
    s = tl.arange(0, BLOCK_S)
    ms = tl.load(stats_ptr + (row * S + s) * 2, mask=s < S, other=float("-inf"))
    zs = tl.load(stats_ptr + (row * S + s) * 2 + 1, mask=s < S, other=0.0)
    m = tl.max(ms, axis=0)
    safe = tl.where(m == float("-inf"), 0.0, m)
    inv_z = 1.0 / tl.sum(zs * tl.exp(ms - safe), axis=0)
    one = -1
    if HAS_IDS:
        one = tl.load(ids_ptr + row)
    for off in range(start, end, BLOCK):
        offs = off + tl.arange(0, BLOCK)
        mask = offs < end
        x = tl.load(logits_ptr + row * stride_lb + offs, mask=mask,
                    other=float("-inf")) * inv_t
        q = tl.exp(x - safe) * inv_z
        if HAS_TEMP:
            q = tl.where(sampled, q, tl.where(offs == one, 1.0, 0.0))
        tl.store(out_ptr + row * stride_ob + offs, q, mask=mask)
