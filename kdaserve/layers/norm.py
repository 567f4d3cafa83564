"""RMS norms with HF KimiLinear numerics."""

from __future__ import annotations

import torch
from torch import nn

from kdaserve.kernels import reference as ref


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ref.rms_norm(x, self.weight, self.eps)


class RMSNormGated(nn.Module):
    """fp32 norm times sigmoid(gate): KDA's output norm (one weight shared by all heads)."""

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        return ref.rms_norm_gated(x, gate, self.weight, self.eps)
