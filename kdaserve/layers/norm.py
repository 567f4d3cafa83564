"""RMS norms with HF KimiLinear numerics: Triton on CUDA, reference twins on the CPU."""

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
        return self.forward_residual(x, None)[0]

    def forward_residual(self, x: torch.Tensor, residual: torch.Tensor | None,
                         out32: torch.Tensor | None = None, pdl: bool = False
                         ) -> tuple[torch.Tensor, torch.Tensor]:
        """x: [N, D]; s = x + residual (x alone when None). Returns (norm(s), s); norm(s) is
        also written, widened, into out32 (fp32 [N, D]) when given. pdl: the CUDA kernel
        launches with programmatic dependent launch."""
        if x.is_cuda:
            from kdaserve.kernels.norm.rms_norm import add_rms_norm

            return add_rms_norm(x, self.weight, self.eps, residual, out32, pdl=pdl)
        out, s = ref.add_rms_norm(x, self.weight, self.eps, residual)
        if out32 is not None:
            out32.copy_(out)
        return out, s


class RMSNormGated(nn.Module):
    """fp32 norm times sigmoid(gate): KDA's output norm (one weight shared by all heads)."""

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor, pdl: bool = False) -> torch.Tensor:
        """x, gate: [N, D]; pdl: the CUDA kernel launches with programmatic dependent launch."""
        if x.is_cuda:
            from kdaserve.kernels.norm.rms_norm import rms_norm_gated

            return rms_norm_gated(x, gate, self.weight, self.eps, pdl=pdl)
        return ref.rms_norm_gated(x, gate, self.weight, self.eps)
