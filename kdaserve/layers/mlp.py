"""Dense gated MLP (layer 0 and the MoE's shared experts): SwiGLU, or SiTU for Kimi K3."""

from __future__ import annotations

import torch
from torch import nn

from kdaserve.distributed.comm import GroupComm
from kdaserve.kernels.linear.gemv import gemv
from kdaserve.layers.activation import SILU, GatedAct
from kdaserve.layers.backends import LayerBackends
from kdaserve.layers.fuse import merge_rows
from kdaserve.layers.linear import use_gemv
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
        self.swiglu_gemv = backends.dense_mlp == "gemv_swiglu" and act.is_silu
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
        projection reading silu(gate) * up directly (pdl: both launch with programmatic
        dependent launch)."""
        if self.gate_up_weight is not None and use_gemv(x, self.swiglu_gemv):
            gate_up = gemv(x, self.gate_up_weight, pdl=pdl)                    # [T, 2I]
            return gemv(gate_up, self.down_proj.weight, pdl=pdl, swiglu=True)  # [T, D]
        return self.down_proj.partial(self.act(self.gate_proj(x), self.up_proj(x)))
