"""Depthwise causal conv1d (+SiLU) over the KDA q/k/v channels, with per-request state slots.

Twins: `kdaserve.kernels.reference.causal_conv1d_varlen` / `causal_conv1d_update`.
State layout: conv_states [num_slots, D, W-1] holds, per slot, the last W-1 inputs of its request
(oldest first). A state index < 0 marks a padding sequence: it is computed with a zero window and
its slot is left alone. Both calls are CUDA-graph safe (grids from shapes, no host syncs).

`pdl=True` launches every kernel with programmatic dependent launch (sm_90+): a kernel may start
while the previous one in the stream finishes and waits for it (griddepcontrol.wait) before it
reads x, the states or the indices, or stores anything (causal_conv1d_update reads the weight
before the wait, so the previous kernel must not write it), then lets the next PDL kernel start.
Same results as pdl=False; ignored on CPU tensors (the Triton interpreter cannot run the PTX).
"""

from __future__ import annotations

import torch

from kdaserve.kernels.utils import (cdiv, check_kernel_device, next_power_of_2, pdl_options,
                                    require_triton)


def _search_steps(num_seqs: int) -> int:
    """Bisection rounds over cu_seqlens, at least 5 (32 sequences): extra rounds keep the answer
    (lo stays once hi == lo + 1), and one compiled variant then covers every step of up to 32
    sequences instead of one per power of two met while serving."""
    return max(5, (num_seqs - 1).bit_length())


def _check_weight_states(x, weight, conv_states, activation):
    D = x.shape[-1]
    if weight.dim() != 2 or weight.shape[0] != D or weight.shape[1] < 2:
        raise ValueError(f"weight must be [D={D}, W>=2], got {tuple(weight.shape)}")
    W = weight.shape[1]
    if conv_states.dim() != 3 or conv_states.shape[1:] != (D, W - 1):
        raise ValueError(f"conv_states must be [num_slots, D={D}, W-1={W - 1}], "
                         f"got {tuple(conv_states.shape)}")
    if activation not in (None, "silu"):
        raise ValueError(f"activation must be None or 'silu', got {activation!r}")
    if x.stride(-1) != 1:
        raise ValueError("x needs a contiguous last dim")
    return D, W


def _out_layout(out: torch.Tensor | None, x: torch.Tensor):
    """out: None, [T, D] with a contiguous last dim, or split planes [S, T, D // S] with a
    contiguous last dim (plane s holds channels [s * D/S, (s+1) * D/S)). Returns (out, row
    stride, plane stride, plane width or 0)."""
    T, D = x.shape
    if out is None:
        out = torch.empty_like(x, memory_format=torch.contiguous_format)
    if out.dim() == 3:
        S = out.shape[0]
        if S * out.shape[2] != D or out.shape[1] != T or out.stride(2) != 1:
            raise ValueError(f"split out must be [S, T={T}, D/S] with S * D/S = {D} and a "
                             f"contiguous last dim, got {tuple(out.shape)}")
        return out, out.stride(1), out.stride(0), out.shape[2]
    if out.shape != x.shape or out.stride(-1) != 1:
        raise ValueError(f"out must be {tuple(x.shape)} with a contiguous last dim, or split "
                         f"planes [S, T, D/S]; got {tuple(out.shape)}")
    return out, out.stride(0), 0, 0


def causal_conv1d_varlen(x: torch.Tensor, weight: torch.Tensor, cu_seqlens: torch.Tensor,
                         conv_states: torch.Tensor, state_indices: torch.Tensor,
                         has_initial_state: torch.Tensor, activation: str | None = "silu",
                         out: torch.Tensor | None = None, pdl: bool = False,
                         tiles: tuple[int, int, int] | None = None) -> torch.Tensor:
    """Prefill over packed sequences; updates conv_states in place.

    x: [T, D] packed tokens; weight: [D, W]; cu_seqlens: [B+1] int32 (rows past cu_seqlens[-1]
    are padding and get y = 0); conv_states: [num_slots, D, W-1]; state_indices: [B] int32;
    has_initial_state: [B] bool (False: the window before the sequence is zeros).
    Returns y [T, D] in x.dtype. Afterwards conv_states[state_indices[b]] holds the last W-1
    inputs of sequence b (earlier state columns shift in when the sequence is shorter than W-1).
    pdl: both launches with programmatic dependent launch (module docstring). tiles: (BLOCK_T,
    BLOCK_D, num_warps) of the conv launch (powers of two), default varlen_tiles.
    """
    require_triton()
    from kdaserve.kernels.conv.triton_conv import conv_varlen_kernel, conv_varlen_state_kernel

    if x.dim() != 2:
        raise ValueError(f"x must be [T, D], got {tuple(x.shape)}")
    D, W = _check_weight_states(x, weight, conv_states, activation)
    B = cu_seqlens.shape[0] - 1
    if cu_seqlens.dim() != 1 or B < 1:
        raise ValueError(f"cu_seqlens must be [B+1] with B >= 1, got {tuple(cu_seqlens.shape)}")
    if state_indices.shape != (B,) or has_initial_state.shape != (B,):
        raise ValueError(f"state_indices/has_initial_state must be [B={B}], got "
                         f"{tuple(state_indices.shape)}/{tuple(has_initial_state.shape)}")
    for t in (x, weight, cu_seqlens, conv_states, state_indices, has_initial_state):
        check_kernel_device(t)
    T = x.shape[0]
    out, stride_yt, stride_ysplit, split = _out_layout(out, x)
    if has_initial_state.dtype == torch.bool:
        has_initial_state = has_initial_state.view(torch.uint8)
    pdl_opts = pdl_options(pdl, x)
    if T > 0:
        block_t, block_d, warps = tiles or varlen_tiles(D)
        conv_varlen_kernel[(cdiv(T, block_t), cdiv(D, block_d))](
            x, weight, out, cu_seqlens, conv_states, state_indices, has_initial_state,
            T, D, B,
            x.stride(0), stride_yt, weight.stride(0), weight.stride(1),
            conv_states.stride(0), conv_states.stride(1), conv_states.stride(2), stride_ysplit,
            W=W, SEARCH_STEPS=_search_steps(B), SILU=activation == "silu",
            BLOCK_T=block_t, BLOCK_D=block_d, SPLIT=split, num_warps=warps,
            **pdl_opts,
        )
    block_d = min(512, next_power_of_2(D))
    conv_varlen_state_kernel[(B, cdiv(D, block_d))](
        x, cu_seqlens, conv_states, state_indices, has_initial_state, D,
        x.stride(0), conv_states.stride(0), conv_states.stride(1), conv_states.stride(2),
        W=W, BLOCK_W=next_power_of_2(W - 1), BLOCK_D=block_d, num_warps=4,
        **pdl_opts,
    )
    return out


def varlen_tiles(D: int) -> tuple[int, int, int]:
    """(BLOCK_T, BLOCK_D, num_warps) of the varlen conv launch: 8 rows a program (their loads
    independent of the window, so they are all in flight), 8 bf16 channels a thread (one
    16-byte load a row), 2 warps: the fastest of benchmarks/bench_prefill.py's conv sweep at
    the 48B model's 12288 channels (PERF_NOTES.md)."""
    return 8, min(512, next_power_of_2(D)), 2


def causal_conv1d_update(x: torch.Tensor, weight: torch.Tensor, conv_states: torch.Tensor,
                         state_indices: torch.Tensor, activation: str | None = "silu",
                         out: torch.Tensor | None = None, pdl: bool = False) -> torch.Tensor:
    """One decode token per sequence; shifts x into conv_states[state_indices[b]] in place.

    x: [B, D]; weight: [D, W]; conv_states: [num_slots, D, W-1]; state_indices: [B] int32.
    Returns y [B, D] in x.dtype. pdl: programmatic dependent launch (module docstring).
    """
    require_triton()
    from kdaserve.kernels.conv.triton_conv import conv_update_kernel

    if x.dim() != 2:
        raise ValueError(f"x must be [B, D], got {tuple(x.shape)}")
    D, W = _check_weight_states(x, weight, conv_states, activation)
    B = x.shape[0]
    if state_indices.shape != (B,):
        raise ValueError(f"state_indices must be [B={B}], got {tuple(state_indices.shape)}")
    for t in (x, weight, conv_states, state_indices):
        check_kernel_device(t)
    out, stride_yt, stride_ysplit, split = _out_layout(out, x)
    if B == 0:
        return out
    block_d = min(256, next_power_of_2(D))
    pdl_opts = pdl_options(pdl, x)
    conv_update_kernel[(B, cdiv(D, block_d))](
        x, weight, out, conv_states, state_indices, D,
        x.stride(0), stride_yt, weight.stride(0), weight.stride(1),
        conv_states.stride(0), conv_states.stride(1), conv_states.stride(2), stride_ysplit,
        W=W, BLOCK_W=next_power_of_2(W - 1), SILU=activation == "silu", BLOCK_D=block_d,
        SPLIT=split, num_warps=4, **pdl_opts,
    )
    return out
