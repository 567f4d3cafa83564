"""Sparse MoE block: sigmoid router with selection-only correction bias, routed SwiGLU experts,
shared expert. Parameter names follow transformers' KimiLinearMoE."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kdaserve.config.model_args import KimiLinearArgs
from kdaserve.kernels import reference as ref
from kdaserve.layers.backends import LayerBackends
from kdaserve.layers.linear import linear
from kdaserve.layers.mlp import MLP


class TopkRouter(nn.Module):
    def __init__(self, args: KimiLinearArgs, backends: LayerBackends = LayerBackends()) -> None:
        super().__init__()
        self.gemv = backends.gemv
        self.top_k = args.num_experts_per_token
        self.renormalize = args.moe_renormalize
        self.scaling = args.routed_scaling_factor
        # fp32 like the checkpoint: routing decisions must not depend on the compute dtype.
        self.weight = nn.Parameter(torch.zeros(args.num_experts, args.hidden_size,
                                               dtype=torch.float32))
        self.register_buffer("e_score_correction_bias",
                             torch.zeros(args.num_experts, dtype=torch.float32))

    def forward(self, x: torch.Tensor, extra_expert: int | None = None,
                x32: torch.Tensor | None = None, pdl: bool = False
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """x: [N, D] -> (topk_weights fp32 [N, k], topk_ids [N, k]); with extra_expert (CUDA
        only) a (1.0, extra_expert) column is appended to every row. x32: x widened to fp32
        when the caller has it (the norm writes it), which saves the cast before the fp32 GEMM.
        pdl: the CUDA kernels launch with programmatic dependent launch."""
        if x32 is not None:
            logits = F.linear(x32, self.weight)                           # [N, E] fp32
        else:
            logits = linear(x, self.weight, self.gemv, torch.float32, pdl=pdl)
        if x.is_cuda:
            from kdaserve.kernels.moe.router import moe_topk_sigmoid

            return moe_topk_sigmoid(logits, self.e_score_correction_bias, self.top_k,
                                    self.renormalize, self.scaling, extra_expert=extra_expert,
                                    pdl=pdl)
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
    """On CUDA with one shared expert, the shared expert is folded into the fused MoE as expert
    E with weight 1 for every token: one grouped kernel pass computes routed + shared."""

    def __init__(self, args: KimiLinearArgs, backends: LayerBackends = LayerBackends()) -> None:
        super().__init__()
        self.num_experts = args.num_experts
        self.fold_shared = backends.moe == "triton"
        """Fold the shared expert into the fused MoE as expert E (when its width matches)."""
        self.gate = TopkRouter(args, backends)
        self.experts = Experts(args)
        self.shared_experts = MLP(args.hidden_size,
                                  args.moe_intermediate_size * args.num_shared_experts, backends)
        self.w13_all: torch.Tensor | None = None
        self.w2_all: torch.Tensor | None = None

    def process_weights_after_loading(self) -> None:
        sh_inter = self.shared_experts.gate_proj.weight.shape[0]
        if not self.fold_shared or sh_inter != self.experts.down_proj.shape[-1]:
            return
        e, sh = self.experts, self.shared_experts
        # [E+1, 2I, D] / [E+1, D, I]: the shared expert becomes the last expert; every original
        # parameter turns into a view of the merged storage.
        w13 = torch.cat([e.gate_up_proj.data, torch.cat([sh.gate_proj.weight.data,
                                                         sh.up_proj.weight.data])[None]])
        w2 = torch.cat([e.down_proj.data, sh.down_proj.weight.data[None]])
        e.gate_up_proj.data, e.down_proj.data = w13[:self.num_experts], w2[:self.num_experts]
        inter = sh.gate_proj.weight.shape[0]
        sh.gate_proj.weight.data, sh.up_proj.weight.data = w13[-1, :inter], w13[-1, inter:]
        sh.down_proj.weight.data = w2[-1]
        sh.gate_up_weight = w13[-1]                                  # [2I, D]
        self.w13_all, self.w2_all = w13, w2

    def router_input(self, x: torch.Tensor) -> torch.Tensor | None:
        """An fp32 buffer like x for the preceding norm to write the router's input into
        (CUDA, fused path only); None where the router casts x itself."""
        if self.w13_all is None or self.gate.gemv:
            return None
        return torch.empty(x.shape, dtype=torch.float32, device=x.device)

    def forward(self, x: torch.Tensor, x32: torch.Tensor | None = None,
                pdl: bool = False) -> torch.Tensor:
        """x: [N, D]; x32: x in fp32 (from router_input, filled by the norm) or None; pdl: the
        CUDA kernels launch with programmatic dependent launch."""
        if self.w13_all is not None:
            from kdaserve.kernels.moe.fused_moe import fused_moe

            w, ids = self.gate(x, extra_expert=self.num_experts, x32=x32, pdl=pdl)  # [N, k + 1]
            return fused_moe(x, self.w13_all, self.w2_all, w, ids, pdl=pdl)
        topk_weights, topk_ids = self.gate(x, pdl=pdl)
        return self.experts(x, topk_weights, topk_ids) + self.shared_experts(x, pdl)
