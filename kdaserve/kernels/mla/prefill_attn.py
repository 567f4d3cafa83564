"""MLA prefill attention straight from the expanded latents.

A prefill chunk's queries [q_len, H, nope + rope] attend causally (bottom-right aligned: the
chunk's rows follow kv_len - q_len cached keys) to keys k = [kv_b's nope columns | the latents'
rope columns, shared by the heads] and values = kv_b's v columns. Handing that to a fused SDPA
kernel needs k materialised per head and v padded to k's width (flash takes one head dim), and
the padded v makes the PV product half again as wide. This kernel reads kv_b's output and the
rope columns in place: no k, no padded v, the PV product at v's own width. Same contract as
`kdaserve.kernels.reference.mla_prefill_attention`.
"""

from __future__ import annotations

import math

import torch

from kdaserve.kernels.utils import cdiv, check_kernel_device, next_power_of_2, require_triton

BLOCK_M, BLOCK_N, NUM_WARPS, NUM_STAGES = 128, 64, 8, 3
"""Query rows and keys a step of a program (head dims 128 nope + 64 rope, v 128; bf16)."""
FP32_TILES = (64, 32, 4, 2)
"""fp32 inputs' default tiles: the bf16 tiles' staged key / value blocks would not fit in
shared memory at 4 bytes. The fp32 dots are exact (ieee), not fast: the engine sends fp32 to
SDPA (attention/mla_backend.py)."""


def mla_prefill_attention(q: torch.Tensor, kv: torch.Tensor, k_pe: torch.Tensor,
                          scale: float, out: torch.Tensor | None = None,
                          tiles: tuple[int, int, int, int] | None = None) -> torch.Tensor:
    """q: [q_len, H, nope + rope]; kv: [kv_len, H, nope + v] (kv_b_proj's output); k_pe:
    [kv_len, rope] (the latents' rope columns; rope may be 0); every last dim contiguous,
    kv_len >= q_len. Query row i attends to keys 0 .. kv_len - q_len + i. Writes and returns
    out [q_len, H, v] (any row / head strides). tiles: (block_m, block_n, warps, stages)."""
    require_triton()
    from kdaserve.kernels.mla.triton_prefill_attn import mla_prefill_attn_kernel

    if q.dim() != 3 or kv.dim() != 3 or k_pe.dim() != 2 or k_pe.shape[0] != kv.shape[0] \
            or kv.shape[1] != q.shape[1]:
        raise ValueError(f"q must be [q_len, H, nope + rope], kv [kv_len, H, nope + v] and k_pe "
                         f"[kv_len, rope]; got {tuple(q.shape)}, {tuple(kv.shape)}, "
                         f"{tuple(k_pe.shape)}")
    q_len, H, qk = q.shape
    kv_len, rope = kv.shape[0], k_pe.shape[1]
    nope = qk - rope
    v_dim = kv.shape[2] - nope
    if nope <= 0 or v_dim <= 0 or kv_len < q_len:
        raise ValueError(f"q's {qk} columns less rope {rope} must split kv's {kv.shape[2]}, and "
                         f"kv_len {kv_len} must be >= q_len {q_len}")
    if out is None:
        out = q.new_empty(q_len, H, v_dim)
    if tuple(out.shape) != (q_len, H, v_dim):
        raise ValueError(f"out must be [{q_len}, {H}, {v_dim}]; got {tuple(out.shape)}")
    for t in (q, kv, k_pe, out):
        check_kernel_device(t)
        if t.stride(-1) != 1:
            raise ValueError("q, kv, k_pe and out need a contiguous last dim")
    fp32 = q.dtype == torch.float32
    block_m, block_n, warps, stages = tiles or (FP32_TILES if fp32 else
                                                (BLOCK_M, BLOCK_N, NUM_WARPS, NUM_STAGES))
    if q_len > 0:
        mla_prefill_attn_kernel[(cdiv(q_len, block_m), H)](
            q, kv, k_pe, out, q_len, kv_len, scale * math.log2(math.e),
            q.stride(0), q.stride(1), kv.stride(0), kv.stride(1), k_pe.stride(0),
            out.stride(0), out.stride(1),
            NOPE=nope, ROPE=rope, V=v_dim, B_NOPE=max(16, next_power_of_2(nope)),
            B_ROPE=max(16, next_power_of_2(max(rope, 1))), B_V=max(16, next_power_of_2(v_dim)),
            BLOCK_M=block_m, BLOCK_N=block_n, NUM_STAGES=stages,
            DOT_PRECISION="ieee" if fp32 else "tf32", num_warps=warps,
        )
    return out
