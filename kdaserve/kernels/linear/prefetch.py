"""L2 prefetch of a weight: read it once so the next kernel that reads it hits L2.

Decode GEMVs read their weight once at far below the copy bandwidth when it comes from DRAM
(the first bytes' latency and a short tail dominate a few-µs kernel). Run on a side stream while
latency-bound kernels (norms, conv, recurrent state, attention, router) leave DRAM idle, the read
moves those bytes earlier. Twin: `prefetch_checksum_reference` (what the sink holds).
"""

from __future__ import annotations

import torch

from kdaserve.kernels.utils import cdiv, check_kernel_device, num_sms, require_triton

BLOCK_WORDS = 8192
"""int32 words per program per loop step (32 KiB: 16 loads of 16 B in flight per thread)."""
PROGRAMS_PER_SM = 2


def _words(t: torch.Tensor) -> torch.Tensor:
    """t's storage as a flat int32 view (t must be contiguous, its byte size a multiple of 4)."""
    if not t.is_contiguous():
        raise ValueError(f"prefetch needs a contiguous tensor, got strides {t.stride()}")
    nbytes = t.numel() * t.element_size()
    if nbytes % 4:
        raise ValueError(f"prefetch needs a byte size divisible by 4, got {nbytes}")
    return t.reshape(-1).view(torch.int32)


def num_prefetch_programs(t: torch.Tensor) -> int:
    """PROGRAMS_PER_SM programs per SM, none with less than one loop step of words."""
    words = t.numel() * t.element_size() // 4
    return max(1, min(PROGRAMS_PER_SM * num_sms(t.device), cdiv(words, BLOCK_WORDS)))


def prefetch_l2(t: torch.Tensor, sink: torch.Tensor | None = None,
                num_programs: int | None = None) -> torch.Tensor:
    """Read t (any dtype, contiguous) through L2 on the current stream. Returns the sink:
    [num_programs] int32, the XOR of program p's share of t's int32 words."""
    require_triton()
    from kdaserve.kernels.linear.triton_prefetch import l2_prefetch_kernel

    check_kernel_device(t)
    words = _words(t)
    programs = num_programs or num_prefetch_programs(t)
    if sink is None:
        sink = torch.empty(programs, dtype=torch.int32, device=t.device)
    elif sink.dtype != torch.int32 or sink.numel() < programs:
        raise ValueError(f"sink must be int32 with >= {programs} elements, got "
                         f"{sink.dtype} [{sink.numel()}]")
    per_program = cdiv(cdiv(words.numel(), programs), BLOCK_WORDS) * BLOCK_WORDS
    l2_prefetch_kernel[(programs,)](words, sink, words.numel(), per_program,
                                    BLOCK=BLOCK_WORDS, num_warps=4)
    return sink


def prefetch_checksum_reference(t: torch.Tensor, num_programs: int) -> torch.Tensor:
    """What prefetch_l2(t, num_programs=num_programs) leaves in its sink."""
    import numpy as np

    words = _words(t.cpu()).numpy()
    per_program = cdiv(cdiv(words.size, num_programs), BLOCK_WORDS) * BLOCK_WORDS
    chunks = [words[p * per_program:(p + 1) * per_program] for p in range(num_programs)]
    return torch.tensor([int(np.bitwise_xor.reduce(c)) if c.size else 0 for c in chunks],
                        dtype=torch.int32)
