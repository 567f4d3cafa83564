"""Sparse MoE block: sigmoid router with selection-only correction bias, routed gated experts
(SwiGLU, or SiTU; model dtype or MXFP4), shared expert. Parameter names follow transformers'
KimiLinearMoE. The router and the experts are also the parts of the latent MoE
(layers/latent_moe.py)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kdaserve.config.model_args import MXFP4_BLOCK, KimiLinearArgs
from kdaserve.distributed.comm import GroupComm
from kdaserve.kernels import reference as ref
from kdaserve.kernels.moe.router import use_router_logits, use_router_partials
from kdaserve.layers.activation import SILU, GatedAct, gated_act
from kdaserve.layers.backends import LayerBackends
from kdaserve.layers.linear import linear, use_gemv
from kdaserve.layers.mlp import MLP
from kdaserve.layers.parallel import ShardSpec, divide


class TopkRouter(nn.Module):
    def __init__(self, args: KimiLinearArgs, backends: LayerBackends = LayerBackends()) -> None:
        super().__init__()
        self.gemv = backends.gemv
        self.partials = backends.router_partials
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
        Steps where kernels/moe/router.py use_router_logits holds take the tensor-core fp32
        GEMM (router_logits) instead; with the router_partials backend, rows past the GEMV's up
        to ROUTER_PARTIALS_MAX_ROWS take router_partials (K-split partial logits, summed by
        the top-k kernel). pdl: the CUDA kernels launch with programmatic dependent launch."""
        if use_router_logits(x):
            from kdaserve.kernels.moe.router import router_logits

            logits = router_logits(x, self.weight, pdl=pdl)             # [N, E] fp32
        elif self.partials and not use_gemv(x, self.gemv) and use_router_partials(x):
            from kdaserve.kernels.moe.router import router_partials

            logits = router_partials(x, self.weight, pdl=pdl)           # [S, N, E] fp32
        elif x32 is not None:
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
    """Routed gated experts over inputs of width `in_size` (the hidden size, or a latent MoE's
    latent). Model dtype: gate_up_proj [E, 2I, D] (gate rows, then up rows), down_proj
    [E, D, I]. MXFP4 (quant="mxfp4", kernels/mxfp4/format.py): uint8 buffers
    gate_up_proj_packed [E, 2I, D/2] + gate_up_proj_scale [E, 2I, D/32] and down_proj_packed
    [E, D, I/2] + down_proj_scale [E, D, I/32], never dequantised in memory.

    Under TP every rank holds every expert's I / tp intermediate columns (gate and up rows,
    down columns; `forward` returns this rank's partial sum, the caller all-reduces); MXFP4
    experts split on whole 32-element scale groups."""

    def __init__(self, num_experts: int, in_size: int, inter_size: int,
                 quant: str | None = None, act: GatedAct = SILU,
                 tp: GroupComm = GroupComm.single(), tma_weights: bool = False) -> None:
        """tma_weights: the fused MoE's wgmma tiles read the weights by TMA (KernelConfig
        moe_tma_weights), where the bf16 rows of both weights are whole 16-byte units (TMA's
        stride rule); other shapes keep pointer tiles."""
        super().__init__()
        e, d = num_experts, in_size
        i = divide(inter_size, tp.size, "moe_intermediate_size (expert columns)")
        self.tma_weights = tma_weights and quant is None and d % 8 == 0 and i % 8 == 0
        if quant == "mxfp4" and tp.size > 1 and i % MXFP4_BLOCK:
            raise ValueError(
                f"moe_intermediate_size={inter_size} does not split into "
                f"tensor_parallel_size={tp.size} shards of whole {MXFP4_BLOCK}-element MXFP4 "
                f"scale groups ({inter_size} / {tp.size} = {i})")
        self.quant, self.act = quant, act
        if quant == "mxfp4":
            for name, shape in (("gate_up_proj_packed", (e, 2 * i, d // 2)),
                                ("gate_up_proj_scale", (e, 2 * i, d // MXFP4_BLOCK)),
                                ("down_proj_packed", (e, d, i // 2)),
                                ("down_proj_scale", (e, d, i // MXFP4_BLOCK))):
                self.register_buffer(name, torch.empty(shape, dtype=torch.uint8))
        elif quant is None:
            self.gate_up_proj = nn.Parameter(torch.empty(e, 2 * i, d))   # [E, 2I, D]
            self.down_proj = nn.Parameter(torch.empty(e, d, i))          # [E, D, I]
        else:
            raise ValueError(f"unknown expert quantization {quant!r}; known: None, mxfp4")

    def tp_shards(self) -> dict[str, ShardSpec]:
        suffixes = ("_packed", "_scale") if self.quant == "mxfp4" else ("",)
        out = {}
        for suffix in suffixes:   # gate | up rows of each expert, down columns
            out["gate_up_proj" + suffix] = ShardSpec(1, blocks=2)
            out["down_proj" + suffix] = ShardSpec(2)
        return out

    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor,
                topk_ids: torch.Tensor) -> torch.Tensor:
        """x: [N, D]; topk_*: [N, k] -> sum_j w[n, j] * expert_j(x[n]), [N, D] (this rank's
        partial sum under TP)."""
        if self.quant == "mxfp4" and x.is_cuda and x.shape[1] % 32 == 0:
            from kdaserve.kernels.moe.mxfp4_moe import moe_partials

            N, k = topk_ids.shape
            partials = moe_partials(x, self.gate_up_proj_packed, self.down_proj_packed, topk_ids,
                                    self.gate_up_proj_scale, self.down_proj_scale,
                                    self.act.name, self.act.beta, self.act.linear_beta)
            return (partials.view(N, k, -1).float()
                    * topk_weights[..., None].float()).sum(1).to(x.dtype)   # [N, D]
        if self.quant == "mxfp4":
            return ref.moe_experts_mxfp4(x, self.gate_up_proj_packed, self.gate_up_proj_scale,
                                         self.down_proj_packed, self.down_proj_scale,
                                         topk_weights, topk_ids, self.act)
        if x.is_cuda and self.act.is_silu:
            from kdaserve.kernels.moe.fused_moe import fused_moe

            return fused_moe(x, self.gate_up_proj, self.down_proj, topk_weights, topk_ids,
                             tma_weights=self.tma_weights)
        return ref.moe_experts(x, self.gate_up_proj, self.down_proj, topk_weights, topk_ids,
                               self.act)


class SparseMoE(nn.Module):
    """On CUDA with one shared expert, the shared expert is folded into the fused MoE as expert
    E with weight 1 for every token: one grouped kernel pass computes routed + shared.

    Under TP the router is replicated, routed and shared experts hold the rank's intermediate
    columns; their partial sums are added, then all-reduced once."""

    def __init__(self, args: KimiLinearArgs, backends: LayerBackends = LayerBackends(),
                 tp: GroupComm = GroupComm.single()) -> None:
        super().__init__()
        self.tp = tp
        self.num_experts = args.num_experts
        act = gated_act(args)
        self.fold_shared = (backends.moe == "triton" and act.is_silu
                            and args.expert_quantization is None)
        """Fold the shared expert into the fused MoE as expert E (when its width matches)."""
        self.gate = TopkRouter(args, backends)
        self.experts = Experts(args.num_experts, args.hidden_size, args.moe_intermediate_size,
                               args.expert_quantization, act, tp,
                               tma_weights=backends.moe_tma_weights)
        self.shared_experts = MLP(args.hidden_size,
                                  args.moe_intermediate_size * args.num_shared_experts, backends,
                                  act, tp)
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
        (CUDA, fused path only); None where the router reads x itself (the GEMV,
        router_partials, router_logits)."""
        if (self.w13_all is None or self.gate.gemv or use_router_logits(x)
                or (self.gate.partials and use_router_partials(x))):
            return None
        return torch.empty(x.shape, dtype=torch.float32, device=x.device)

    def forward(self, x: torch.Tensor, x32: torch.Tensor | None = None,
                pdl: bool = False) -> torch.Tensor:
        """x: [N, D]; x32: x in fp32 (from router_input, filled by the norm) or None; pdl: the
        CUDA kernels launch with programmatic dependent launch."""
        if self.w13_all is not None:
            from kdaserve.kernels.moe.fused_moe import fused_moe

            w, ids = self.gate(x, extra_expert=self.num_experts, x32=x32, pdl=pdl)  # [N, k + 1]
            return self.tp.all_reduce(fused_moe(x, self.w13_all, self.w2_all, w, ids, pdl=pdl,
                                                tma_weights=self.experts.tma_weights))
        topk_weights, topk_ids = self.gate(x, pdl=pdl)
        return self.tp.all_reduce(self.experts(x, topk_weights, topk_ids)
                                  + self.shared_experts.partial(x, pdl))
