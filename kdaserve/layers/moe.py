"""Sparse MoE block: sigmoid router with selection-only correction bias, routed SwiGLU experts,
shared expert. Parameter names follow transformers' KimiLinearMoE."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kdaserve.kernels import reference as ref
from kdaserve.layers.mlp import MLP
from kdaserve.models.hf_config import KimiLinearArgs


class TopkRouter(nn.Module):
    def __init__(self, args: KimiLinearArgs) -> None:
        super().__init__()
        self.top_k = args.num_experts_per_token
        self.renormalize = args.moe_renormalize
        self.scaling = args.routed_scaling_factor
        # fp32 like the checkpoint: routing decisions must not depend on the compute dtype.
        self.weight = nn.Parameter(torch.zeros(args.num_experts, args.hidden_size,
                                               dtype=torch.float32))
        self.register_buffer("e_score_correction_bias",
                             torch.zeros(args.num_experts, dtype=torch.float32))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x: [N, D] -> (topk_weights fp32 [N, k], topk_ids [N, k])."""
        logits = F.linear(x.float(), self.weight)                  # [N, E] fp32
        return ref.moe_topk_sigmoid(logits, self.e_score_correction_bias, self.top_k,
                                    self.renormalize, self.scaling)


class Experts(nn.Module):
    def __init__(self, args: KimiLinearArgs) -> None:
        super().__init__()
        e, d, i = args.num_experts, args.hidden_size, args.moe_intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(e, 2 * i, d))   # [E, 2I, D]: gate | up
        self.down_proj = nn.Parameter(torch.empty(e, d, i))          # [E, D, I]

    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor,
                topk_ids: torch.Tensor) -> torch.Tensor:
        if x.is_cuda:
            from kdaserve.kernels.moe.fused_moe import fused_moe

            return fused_moe(x, self.gate_up_proj, self.down_proj, topk_weights, topk_ids)
        return ref.moe_experts(x, self.gate_up_proj, self.down_proj, topk_weights, topk_ids)


class SparseMoE(nn.Module):
    def __init__(self, args: KimiLinearArgs) -> None:
        super().__init__()
        self.gate = TopkRouter(args)
        self.experts = Experts(args)
        self.shared_experts = MLP(args.hidden_size,
                                  args.moe_intermediate_size * args.num_shared_experts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        topk_weights, topk_ids = self.gate(x)
        return self.experts(x, topk_weights, topk_ids) + self.shared_experts(x)
