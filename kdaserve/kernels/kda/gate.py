"""KDA's bounded decay gate (Kimi K3's gate_lower_bound) and beta in one launch.

Twins: `kdaserve.kernels.reference.kda_gate` (with lower_bound) and sigmoid(beta) in fp32.
"""

from __future__ import annotations

import torch

from kdaserve.kernels.utils import (cdiv, check_kernel_device, next_power_of_2, pdl_options,
                                    require_triton)

BLOCK = 1024


def kda_gate_beta(g_raw: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor,
                  lower_bound: float, beta_logits: torch.Tensor, pdl: bool = False
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """g_raw: [T, H, K] (contiguous rows of H * K; any row stride); A_log: H elements; dt_bias:
    [H * K]; beta_logits: [T, H] (any row stride). Returns (the fp32 log decay [T, H, K] =
    reference.kda_gate(g_raw, A_log, dt_bias, lower_bound), sigmoid(beta_logits) fp32 [T, H]),
    both contiguous. pdl: launch with programmatic dependent launch (A_log and dt_bias are
    read before the wait)."""
    require_triton()
    from kdaserve.kernels.kda.triton_gate import kda_gate_beta_kernel

    T, H, K = g_raw.shape
    if g_raw.stride(2) != 1 or g_raw.stride(1) != K or beta_logits.shape != (T, H) \
            or beta_logits.stride(1) != 1 or A_log.numel() != H or dt_bias.numel() != H * K:
        raise ValueError(f"g_raw [T, H, K] with contiguous rows, beta_logits [T, H], A_log "
                         f"[H], dt_bias [H * K]; got {tuple(g_raw.shape)}, "
                         f"{tuple(beta_logits.shape)}, {tuple(A_log.shape)}, "
                         f"{tuple(dt_bias.shape)}")
    check_kernel_device(g_raw)
    g = torch.empty(T, H, K, dtype=torch.float32, device=g_raw.device)
    beta = torch.empty(T, H, dtype=torch.float32, device=g_raw.device)
    if T:
        kda_gate_beta_kernel[(T, cdiv(H * K, BLOCK))](
            g_raw, A_log.reshape(-1), dt_bias, beta_logits, g, beta, H * K, K, H,
            float(lower_bound), g_raw.stride(0), beta_logits.stride(0), g.stride(0),
            beta.stride(0), BLOCK=BLOCK, BLOCK_H=next_power_of_2(H), num_warps=4,
            **pdl_options(pdl, g_raw))
    return g, beta
