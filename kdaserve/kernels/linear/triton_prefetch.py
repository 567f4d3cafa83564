"""Triton kernel of the L2 weight prefetch (imported lazily by prefetch.py)."""

import triton
import triton.language as tl


@triton.jit
def l2_prefetch_kernel(src_ptr, sink_ptr, num_words, words_per_program, BLOCK: tl.constexpr):
    """Program p reads words [p * words_per_program, (p + 1) * words_per_program) of src (int32
    view) through L2 with evict_last, and stores their XOR in sink[p] (the store keeps the loads
    alive and makes the kernel checkable)."""
    pid = tl.program_id(0)
    start = pid.to(tl.int64) * words_per_program
    end = tl.minimum(start + words_per_program, num_words)
    acc = tl.zeros([BLOCK], dtype=tl.int32)
    for w0 in range(start, end, BLOCK):
        offs = w0 + tl.arange(0, BLOCK)
        acc ^= tl.load(src_ptr + offs, mask=offs < end, other=0,
                       eviction_policy="evict_last")
    tl.store(sink_ptr + pid, tl.xor_sum(acc, axis=0))
