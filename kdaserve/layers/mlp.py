"""Dense gated MLP (layer 0 and the MoE's shared experts): SwiGLU, or SiTU for Kimi K3."""

from __future__ import annotations

import torch
from torch import nn

from kdaserve.distributed.comm import GroupComm
from kdaserve.kernels.linear.gemv import gemv
from kdaserve.layers.activation import SILU, GatedAct
from kdaserve.layers.backends import LayerBackends
from kdaserve.layers.fuse import merge_rows
from kdaserve.layers.linear import linear, use_gemv, use_skinny
from kdaserve.layers.parallel import ColumnParallelLinear, RowParallelLinear, divide


class MLP(nn.Module):
    """Under TP the rank holds intermediate_size / tp columns: gate / up column-parallel, down
    row-parallel; `forward` all-reduces, `partial` leaves the reduction to a caller that adds
    other partial sums first (the MoE's routed experts)."""

    def __init__(self, hidden_size: int, intermediate_size: int,
                 backends: LayerBackends = LayerBackends(), act: GatedAct = SILU,
                 tp: GroupComm = GroupComm.single()) -> None:
        super().__init__()
        self.act = act
        self.tp = tp
        self.act_gemv = backends.dense_mlp == "gemv_swiglu"
        """Decode rows: the gate|up GEMV, then the down GEMV applying the activation (silu * up
        or SiTU) in its K loop."""
        self.situ_kernel = backends.gated_act == "triton" and act.name == "situ"
        """Other rows, SiTU: the merged gate|up projection and one activation launch."""
        self.gemv = backends.gemv
        self.skinny = backends.skinny
        divide(intermediate_size, tp.size, "intermediate size (MLP columns)")
        self.gate_proj = ColumnParallelLinear(hidden_size, intermediate_size, tp)
        self.up_proj = ColumnParallelLinear(hidden_size, intermediate_size, tp)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, tp)
        self.gate_up_weight: torch.Tensor | None = None
        """[2I, D]: gate rows then up rows, the storage gate_proj / up_proj view."""

    def process_weights_after_loading(self) -> None:
        # A shared expert folded into the fused MoE already has gate|up as one view there
        # (SparseMoE sets gate_up_weight first): merging again would copy it.
        if self.gate_up_weight is None:
            self.gate_up_weight = merge_rows(self.gate_proj.weight, self.up_proj.weight)

    def forward(self, x: torch.Tensor, pdl: bool = False) -> torch.Tensor:
        """x: [T, D] -> [T, D]."""
        return self.tp.all_reduce(self.partial(x, pdl))

    def partial(self, x: torch.Tensor, pdl: bool = False) -> torch.Tensor:
        """x: [T, D] -> this rank's partial sum [T, D] (the whole output at TP=1). Decode rows
        under the gemv_swiglu backend: two GEMV launches, the gate|up projection then the down
        projection reading silu(gate) * up (or SiTU) directly (pdl: both launch with
        programmatic dependent launch). Other rows, SiTU under the triton gated_act backend:
        the gate|up projection, one SiTU launch (kernels/activation), the down projection."""
        if self.gate_up_weight is not None and use_gemv(x, self.act_gemv):
            act = self.act
            situ = None if act.is_silu else (act.beta, act.linear_beta)
            gate_up = gemv(x, self.gate_up_weight, pdl=pdl)                    # [T, 2I]
            return gemv(gate_up, self.down_proj.weight, pdl=pdl, swiglu=True,
                        situ=situ)                                             # [T, D]
        if self.gate_up_weight is not None and self.situ_kernel:
            from kdaserve.kernels.activation.activation import situ_and_mul

            gate_up = linear(x, self.gate_up_weight, self.gemv, pdl=pdl,
                             skinny=self.skinny)                               # [T, 2I]
            h = situ_and_mul(gate_up, self.act.beta, self.act.linear_beta, pdl=pdl)  # [T, I]
            return linear(h, self.down_proj.weight, self.gemv, pdl=pdl,
                          skinny=self.skinny)                                  # [T, D]
        if self.gate_up_weight is not None and use_skinny(x, self.gate_up_weight, self.skinny):
            gate_up = linear(x, self.gate_up_weight, pdl=pdl, skinny=True)     # [T, 2I]
            gate, up = gate_up.chunk(2, dim=-1)
            return linear(self.act(gate, up), self.down_proj.weight, pdl=pdl,
                          skinny=True)                                         # [T, D]
        return self.down_proj.partial(self.act(self.gate_proj(x), self.up_proj(x)))
