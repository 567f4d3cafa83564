"""Dense SwiGLU MLP (layer 0 and the MoE's shared experts)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kdaserve.kernels.linear.gemv import gemv
from kdaserve.layers.fuse import merge_rows
from kdaserve.layers.linear import use_gemv


class MLP(nn.Module):
    decode_gemv = False
    """KernelConfig.decode_gemv (set by the model's configure_kernels)."""
    pdl = False
    """KernelConfig.pdl (set by the model's configure_kernels)."""
    dense_gemv = False
    """KernelConfig.dense_mlp_gemv (set by the model's configure_kernels)."""

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)
        self.gate_up_weight: torch.Tensor | None = None
        """[2I, D]: gate rows then up rows, the storage gate_proj / up_proj view."""

    def process_weights_after_loading(self) -> None:
        # A shared expert folded into the fused MoE already has gate|up as one view there
        # (SparseMoE sets gate_up_weight first): merging again would copy it.
        if self.gate_up_weight is None:
            self.gate_up_weight = merge_rows(self.gate_proj.weight, self.up_proj.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [T, D] -> [T, D]. Decode rows with decode_gemv and dense_gemv: two GEMV launches,
        the gate|up projection then the down projection reading silu(gate) * up directly."""
        if (self.dense_gemv and self.gate_up_weight is not None
                and use_gemv(x, self.decode_gemv)):
            gate_up = gemv(x, self.gate_up_weight, pdl=self.pdl)               # [T, 2I]
            return gemv(gate_up, self.down_proj.weight, pdl=self.pdl, swiglu=True)  # [T, D]
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
