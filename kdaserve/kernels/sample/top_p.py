"""Sort-free top-k / top-p logit threshold: a multi-pivot search in a few Triton launches.

Twin: `kdaserve.kernels.reference.top_k_top_p_threshold_ref` (a sort). The kernel's threshold
is at most the reference's (it never drops nucleus mass) and every extra token it keeps lies
within (row range) / num_pivots ** passes of the reference's threshold (about 1 ulp at the
defaults). No host sync: the launches depend only on shapes and on which arguments are None,
so the call can be captured in a CUDA graph.
"""

from __future__ import annotations

import torch

from kdaserve.kernels.utils import (cdiv, check_kernel_device, next_power_of_2, num_sms,
                                    require_triton)


def top_k_top_p_threshold(logits: torch.Tensor, top_k: torch.Tensor | None = None,
                          top_p: torch.Tensor | None = None, *, num_pivots: int = 32,
                          passes: int = 6, tiles: tuple[int, int] | None = None
                          ) -> torch.Tensor:
    """logits [B, V] fp32 contiguous (temperature applied, -inf for bans, one finite value per
    row); top_k [B] int32/int64 or None (<= 0: off for the row; k > V means V); top_p [B] fp32
    or None (>= 1: off for the row; values in (0, 1]).

    Returns tau [B] fp32: keep the tokens with logits >= tau. tau = max(tk, tp) with tk the
    k-th largest logit and tp the highest logit whose tokens at or above it (and at or above tk)
    hold top_p of the mass of the tokens at or above tk; -inf for a row with both filters off.
    tiles: (tokens a search program takes per step, its warps), powers of two, for benchmarks;
    default SEARCH_TILES on CUDA. The threshold does not depend on them beyond fp rounding.
    """
    _check_inputs(logits, top_k, top_p, num_pivots, passes)
    if tiles is not None and not all(isinstance(t, int) and t >= 1 and t & (t - 1) == 0
                                     for t in tiles):
        raise ValueError(f"tiles must be two powers of two (block, num_warps), got {tiles}")
    B, V = logits.shape
    tau = torch.full((B,), float("-inf"), dtype=torch.float32, device=logits.device)
    if (top_k is None and top_p is None) or B == 0:
        return tau
    require_triton()
    check_kernel_device(logits)
    from kdaserve.kernels.sample.triton_top_p import (narrow_kernel, search_pass_kernel,
                                                      split_stats_kernel)

    S, split_len, block, red_s = _launch_config(B, V, logits.device,
                                                tiles[0] if tiles else None)
    warps = tiles[1] if tiles else SEARCH_TILES[1]
    searches = [False] * (passes if top_k is not None else 0) + \
        [True] * (passes if top_p is not None else 0)                   # MASS flag per pass
    P = num_pivots
    dev = logits.device
    stats = torch.empty(B, S, 2, dtype=torch.float32, device=dev)
    state = torch.empty(len(searches), B, P + 8, dtype=torch.float64, device=dev)
    part = torch.empty(B, S, P + 2, dtype=torch.float64, device=dev)
    k_arg = top_k if top_k is not None else tau                         # unread when None
    p_arg = top_p if top_p is not None else tau

    split_stats_kernel[(B, S)](logits, stats, V, S, split_len, BLOCK=block)
    prev = 0
    for t, mass in enumerate(searches):
        if t > 0:
            narrow_kernel[(B,)](state[t - 1], part, state[t], k_arg, p_arg, tau, V, S,
                                PREV=prev, MASS=mass, FINAL=False, P=P, RED_S=red_s,
                                num_warps=4)
        search_pass_kernel[(B, S)](
            logits, stats, state[t], part, V, S, split_len, FIRST=t == 0, MASS=mass, P=P,
            BLOCK=block, SUB=min(block, SUB_BLOCK), RED_S=red_s, num_warps=warps)
        prev = _prev_mode(mass, prev)
    last = len(searches) - 1
    narrow_kernel[(B,)](state[last], part, state[last], k_arg, p_arg, tau, V, S,
                        PREV=prev, MASS=False, FINAL=True, P=P, RED_S=red_s, num_warps=4)
    return tau


def _prev_mode(mass: bool, prev: int) -> int:
    """What the narrowing after a pass sees behind it (see triton_top_p's PREV): 1 after a
    top-k pass, 2 after the first top-p pass, 3 after a later one."""
    if not mass:
        return 1
    return 3 if prev >= 2 else 2


SEARCH_TILES = (1024, 4)
"""(tokens per step, warps) of a search program on CUDA."""

SUB_BLOCK = 128
"""Tokens a search program compares with the pivots at a time (the [SUB_BLOCK, P] compare's
registers bound the programs an SM holds)."""


def _launch_config(B: int, V: int, device: torch.device,
                   block: int | None = None) -> tuple[int, int, int, int]:
    """(splits S, tokens per split, BLOCK, splits reduced per step).

    S depends on V only, not on B: the kernels' integer arguments then specialise the same way
    at every batch size, so a new batch size never JIT-compiles a new variant in the middle of
    serving (suspected in multi-second stalls of early server runs). On CUDA
    S = min(SM count / 2, 64) splits per row: B = 1 still spreads over many SMs, and the
    narrowing's reduction over S partials (one program a row) stays small. On the interpreter
    everything is small so every loop runs several times."""
    if device.type == "cuda":
        red_s, want = 32, max(1, min(num_sms(device) // 2, 64))
        block = block or SEARCH_TILES[0]
    else:
        red_s, want = 2, 3
        block = block or 256
    blocks = cdiv(V, block)
    split_len = cdiv(blocks, min(want, blocks)) * block
    return cdiv(V, split_len), split_len, block, red_s


def _check_inputs(logits, top_k, top_p, num_pivots, passes) -> None:
    if logits.dim() != 2 or logits.dtype != torch.float32 or not logits.is_contiguous():
        raise ValueError(f"logits must be a contiguous fp32 [B, V] tensor, got "
                         f"{logits.dtype} {tuple(logits.shape)} (contiguous="
                         f"{logits.is_contiguous()})")
    B, V = logits.shape
    if V < 1:
        raise ValueError(f"logits must have a vocabulary of at least 1, got V={V}")
    if top_k is not None and (top_k.shape != (B,) or top_k.dtype not in (torch.int32, torch.int64)
                              or top_k.device != logits.device):
        raise ValueError(f"top_k must be int32/int64 [B={B}] on {logits.device}, got "
                         f"{top_k.dtype} {tuple(top_k.shape)} on {top_k.device}")
    if top_p is not None and (top_p.shape != (B,) or top_p.dtype != torch.float32
                              or top_p.device != logits.device):
        raise ValueError(f"top_p must be fp32 [B={B}] on {logits.device}, got "
                         f"{top_p.dtype} {tuple(top_p.shape)} on {top_p.device}")
    if not (isinstance(num_pivots, int) and 2 <= num_pivots <= 128
            and next_power_of_2(num_pivots) == num_pivots):
        raise ValueError(f"num_pivots must be a power of two in [2, 128], got {num_pivots}")
    if not (isinstance(passes, int) and passes >= 1):
        raise ValueError(f"passes must be an int >= 1, got {passes}")


__all__ = ["top_k_top_p_threshold"]
