"""Kimi K3's elementwise pieces as one launch each: SiTU over the merged gate|up projection,
and the sigmoid output gate (MLA's attn_out * sigmoid(g)).

Twins: `kdaserve.kernels.reference.situ_and_mul` (on the two halves) and
`reference.sigmoid_gate`.
"""

from __future__ import annotations

import torch

from kdaserve.kernels.utils import cdiv, check_kernel_device, pdl_options, require_triton

BLOCK = 1024


def situ_and_mul(gate_up: torch.Tensor, beta: float, linear_beta: float | None,
                 pdl: bool = False) -> torch.Tensor:
    """gate_up: [T, 2I] = [gate | up] (one merged projection; any row stride) -> SiTU(gate) *
    up' [T, I] in gate_up.dtype (reference.situ_and_mul(gate, up, beta, linear_beta)).
    pdl: launch with programmatic dependent launch (it waits before reading anything)."""
    require_triton()
    from kdaserve.kernels.activation.triton_activation import situ_and_mul_kernel

    if gate_up.dim() != 2 or gate_up.shape[1] % 2 or gate_up.stride(1) != 1:
        raise ValueError(f"gate_up must be [T, 2I] with a contiguous last dim, got "
                         f"{tuple(gate_up.shape)}")
    check_kernel_device(gate_up)
    T, inter = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty(T, inter, dtype=gate_up.dtype, device=gate_up.device)
    if T:
        situ_and_mul_kernel[(T, cdiv(inter, BLOCK))](
            gate_up, out, inter, float(beta), float(linear_beta or 1.0), gate_up.stride(0),
            out.stride(0), CLIP_UP=linear_beta is not None, BLOCK=BLOCK, num_warps=4,
            **pdl_options(pdl, gate_up))
    return out


def sigmoid_gate(x: torch.Tensor, gate: torch.Tensor, pdl: bool = False) -> torch.Tensor:
    """x: [T, N] (contiguous last dim) *= sigmoid(gate [T, N], any row stride), in place;
    returns x (reference.sigmoid_gate). pdl: as situ_and_mul."""
    require_triton()
    from kdaserve.kernels.activation.triton_activation import sigmoid_gate_kernel

    if x.dim() != 2 or gate.shape != x.shape or x.stride(1) != 1 or gate.stride(1) != 1:
        raise ValueError(f"x and gate must be [T, N] with contiguous last dims, got "
                         f"{tuple(x.shape)} / {tuple(gate.shape)}")
    check_kernel_device(x)
    T, n = x.shape
    if T:
        sigmoid_gate_kernel[(T, cdiv(n, BLOCK))](x, gate, n, x.stride(0), gate.stride(0),
                                                 BLOCK=BLOCK, num_warps=4,
                                                 **pdl_options(pdl, x))
    return x
