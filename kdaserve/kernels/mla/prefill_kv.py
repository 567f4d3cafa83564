"""MLA prefill keys and values from the expanded latents, in one launch.

Prefill attention runs on flash (attention/mla_backend.py), which takes one head dim for q, k and
v: k is [nope | rope] per head (the rope part shared by the heads) and v is padded with zeros to
k's width. Built with torch ops that is a concatenation and a pad, two copies of the same rows
(kv read twice); here one program per (token block, head) reads its kv_b rows and rope columns
once and writes k and the padded v. Same contract as `kdaserve.kernels.reference.mla_prefill_kv`.
"""

from __future__ import annotations

import torch

from kdaserve.kernels.utils import cdiv, check_kernel_device, next_power_of_2, require_triton

BLOCK_L = 16
"""Tokens a program: 16 rows x (nope + rope + 2 v widths) bf16 of one head, about 12 KB."""


def mla_prefill_kv(kv: torch.Tensor, k_pe: torch.Tensor, nope_dim: int,
                   v_width: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """kv: [L, H, nope + v] (kv_b_proj's output, a contiguous last dim); k_pe: [L, rope] (the
    latents' rope columns, a contiguous last dim). Returns k [L, H, nope + rope] and v
    [L, H, v_width] (kv's v columns, then zeros; v_width None: v's own width), contiguous."""
    require_triton()
    from kdaserve.kernels.mla.triton_prefill_kv import mla_prefill_kv_kernel

    if kv.dim() != 3 or k_pe.dim() != 2 or k_pe.shape[0] != kv.shape[0]:
        raise ValueError(f"kv must be [L, H, nope + v] and k_pe [L, rope]; got "
                         f"{tuple(kv.shape)} and {tuple(k_pe.shape)}")
    if kv.stride(-1) != 1 or k_pe.stride(-1) != 1:
        raise ValueError("kv and k_pe need a contiguous last dim")
    L, H, width = kv.shape
    rope = k_pe.shape[1]
    v_dim = width - nope_dim
    v_width = v_dim if v_width is None else v_width
    if not 0 < nope_dim < width or v_width < v_dim:
        raise ValueError(f"nope_dim {nope_dim} must split kv's {width} columns, and v_width "
                         f"{v_width} must hold v's {v_dim}")
    for t in (kv, k_pe):
        check_kernel_device(t)
    k = kv.new_empty(L, H, nope_dim + rope)
    v = kv.new_empty(L, H, v_width)
    if L > 0:
        mla_prefill_kv_kernel[(cdiv(L, BLOCK_L), H)](
            kv, k_pe, k, v, L, kv.stride(0), kv.stride(1), k_pe.stride(0),
            NOPE=nope_dim, ROPE=rope, V=v_dim, V_WIDTH=v_width,
            B_NOPE=next_power_of_2(nope_dim), B_ROPE=next_power_of_2(max(rope, 1)),
            B_V=next_power_of_2(v_width), BLOCK_L=BLOCK_L, num_warps=4,
        )
    return k, v
