"""Latent MoE (Kimi K3): routing on the hidden state, routed experts in a narrower latent.

    out = up_proj(norm(sum_k w_k * E_k(down_proj(x)))) + shared_experts(x)

The router (sigmoid + selection bias, top-k, routed scaling folded into the weights) and the
shared experts read the hidden state x [T, H]; routed_expert_down_proj maps x to the latent
[T, L], the routed experts (model dtype or MXFP4) run entirely in L, their top-k weighted sum
is normed (routed_expert_norm, when latent_moe_use_norm) and mapped back by
routed_expert_up_proj. The norm + up projection is the "latent tail": the MXFP4 MoE kernel is to
fuse the top-k sum into it (no [T, L] round trip). Parameter names follow the K3 checkpoints
under `mlp.` (`block_sparse_moe.` there).

Tensor parallelism: the router, routed_expert_down_proj, the norm and routed_expert_up_proj are
replicated; the routed experts and the shared experts hold the rank's intermediate columns. The
routed partial sum [T, L] is all-reduced before the norm (which needs the whole sum), the shared
experts' partial [T, H] after; the fused tail (which sums inside the norm) runs at TP=1 only.

Backends (layers/backends.py latent_moe): reference (the CPU twins); unfused (experts, top-k
sum, norm, up projection as separate ops); fused_tail on CUDA (kernels/moe/mxfp4_moe.py: the
expert GEMMs read MXFP4 or bf16 weights directly and return each routing entry's output; one
tail launch sums them with the routing weights inside the norm + up projection and adds the
shared experts' output).
"""

from __future__ import annotations

import torch
from torch import nn

from kdaserve.config.model_args import KimiLinearArgs
from kdaserve.distributed.comm import GroupComm
from kdaserve.layers.activation import gated_act
from kdaserve.layers.backends import LayerBackends
from kdaserve.layers.linear import linear
from kdaserve.layers.mlp import MLP
from kdaserve.layers.moe import Experts, TopkRouter
from kdaserve.layers.norm import RMSNorm


class LatentMoE(nn.Module):
    def __init__(self, args: KimiLinearArgs, backends: LayerBackends = LayerBackends(),
                 tp: GroupComm = GroupComm.single()) -> None:
        super().__init__()
        self.tp = tp
        h, lat = args.hidden_size, args.routed_expert_hidden_size
        act = gated_act(args)
        self.gemv = backends.gemv
        self.skinny = backends.skinny
        self.gate = TopkRouter(args, backends)
        self.routed_expert_down_proj = nn.Linear(h, lat, bias=False)
        self.experts = Experts(args.num_experts, lat, args.moe_intermediate_size,
                               args.expert_quantization, act, tp)
        self.routed_expert_norm = (RMSNorm(lat, args.rms_norm_eps) if args.latent_moe_use_norm
                                   else None)
        self.routed_expert_up_proj = nn.Linear(lat, h, bias=False)
        self.shared_experts = MLP(h, args.moe_intermediate_size * args.num_shared_experts,
                                  backends, act, tp)
        self.fused_tail = backends.latent_moe == "fused_tail" and tp.size == 1

    def forward(self, x: torch.Tensor, pdl: bool = False) -> torch.Tensor:
        """x: [T, H] -> [T, H]."""
        topk_weights, topk_ids = self.gate(x, pdl=pdl)                      # [T, k]
        latent = linear(x, self.routed_expert_down_proj.weight, self.gemv, pdl=pdl,
                        skinny=self.skinny)                                 # [T, L]
        if self.fused_tail and x.is_cuda:
            return self._fused_tail(x, latent, topk_weights, topk_ids, pdl)
        routed = self.tp.all_reduce(self.experts(latent, topk_weights, topk_ids))  # [T, L]
        if self.routed_expert_norm is not None:
            routed = self.routed_expert_norm(routed)
        out = linear(routed, self.routed_expert_up_proj.weight, self.gemv, pdl=pdl,
                     skinny=self.skinny)                                    # [T, H]
        return out + self.shared_experts(x, pdl)

    def _fused_tail(self, x: torch.Tensor, latent: torch.Tensor, topk_weights: torch.Tensor,
                    topk_ids: torch.Tensor, pdl: bool) -> torch.Tensor:
        from kdaserve.kernels.moe.mxfp4_moe import latent_moe_tail, moe_partials

        ex, act = self.experts, self.experts.act
        if ex.quant == "mxfp4":
            weights = (ex.gate_up_proj_packed, ex.down_proj_packed, ex.gate_up_proj_scale,
                       ex.down_proj_scale)
        else:
            weights = (ex.gate_up_proj, ex.down_proj, None, None)
        w13, w2, s13, s2 = weights
        partials = moe_partials(latent, w13, w2, topk_ids, s13, s2, act.name, act.beta,
                                act.linear_beta, pdl=pdl)                   # [T * k, L]
        shared = self.shared_experts(x, pdl)                                # [T, H]
        norm = self.routed_expert_norm
        return latent_moe_tail(partials, topk_weights, topk_ids,
                               self.routed_expert_up_proj.weight,
                               None if norm is None else norm.weight,
                               1e-6 if norm is None else norm.eps, shared,
                               num_experts=w13.shape[0], pdl=pdl)
