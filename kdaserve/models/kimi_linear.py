"""KimiLinearForCausalLM over a flattened batch: Kimi Linear and the text model of Kimi K3.

Parameter and buffer names match transformers' KimiLinearForCausalLM state_dict (>= 5.17 naming),
so checkpoints saved by transformers load by name; the loader maps the original Moonshot names
and Kimi K3's (models/loader.py). The K3 pieces switch on from the config (config/model_args.py):
AttnRes in place of the residual stream (layers/attn_res.py), the latent MoE
(layers/latent_moe.py), SiTU, MXFP4 experts, the KDA full-rank gate, MLA q-LoRA and output
gate. The MTP layers of a checkpoint are a separate module (models/mtp.py: the "mtp" drafter),
which reads this model's pre-final-norm hidden states (forward with return_prenorm); the
"dspark" drafter (models/dspark.py) reads the outputs of chosen layers (forward with aux_layers).

Tensor parallelism (tp, a GroupComm of the TP ranks): every layer holds its rank's heads and
columns (layers/parallel.py and each layer's docstring); the hidden states between layers, the
norms and AttnRes are replicated, so every rank sees the same [T, D] activations, the embedding
and LM head split the vocabulary, and compute_logits returns the full logits on every rank.
"""

from __future__ import annotations

import torch
from torch import nn

from kdaserve.attention.forward_context import ForwardContext
from kdaserve.config.model_args import MXFP4_BLOCK, KimiLinearArgs
from kdaserve.distributed.comm import GroupComm
from kdaserve.layers.activation import gated_act
from kdaserve.layers.attn_res import DepthState, attn_res_read
from kdaserve.layers.backends import LayerBackends
from kdaserve.layers.kda import KimiDeltaAttention
from kdaserve.layers.latent_moe import LatentMoE
from kdaserve.layers.mla import MLAttention
from kdaserve.layers.mlp import MLP
from kdaserve.layers.moe import SparseMoE
from kdaserve.layers.norm import RMSNorm
from kdaserve.layers.parallel import ParallelLMHead, VocabParallelEmbedding, divide


def check_tensor_parallel(args: KimiLinearArgs, tp_size: int) -> None:
    """ValueError naming the first head count or size of `args` that does not split over
    tp_size ranks (the layers check the same when they are built; this runs before any rank
    process starts)."""
    types = set(args.mlp_layer_types)
    sizes = [("linear_num_heads (KDA heads)", args.linear_num_heads, bool(args.kda_layer_ids)),
             ("num_attention_heads (MLA heads)", args.num_attention_heads,
              bool(args.mla_layer_ids)),
             ("intermediate_size", args.intermediate_size, "dense" in types),
             ("moe_intermediate_size", args.moe_intermediate_size, "sparse" in types),
             ("vocab_size", args.vocab_size, True)]
    for what, n, used in sizes:
        if used:
            divide(n, tp_size, what)
    inter = args.moe_intermediate_size // tp_size
    if (tp_size > 1 and "sparse" in types and args.expert_quantization == "mxfp4"
            and inter % MXFP4_BLOCK):
        raise ValueError(
            f"moe_intermediate_size={args.moe_intermediate_size} does not split into "
            f"tensor_parallel_size={tp_size} shards of whole {MXFP4_BLOCK}-element MXFP4 "
            f"scale groups ({args.moe_intermediate_size} / {tp_size} = {inter})")


class DecoderLayer(nn.Module):
    def __init__(self, args: KimiLinearArgs, layer_idx: int, backends: LayerBackends,
                 tp: GroupComm = GroupComm.single()) -> None:
        super().__init__()
        self.is_kda = args.layer_types[layer_idx] == "linear_attention"
        if self.is_kda:
            self.self_attn = KimiDeltaAttention(args, args.kda_layer_ids.index(layer_idx),
                                                backends, tp)
        else:
            self.self_attn = MLAttention(args, args.mla_layer_ids.index(layer_idx), backends,
                                         tp)
        if args.mlp_layer_types[layer_idx] == "sparse":
            moe = LatentMoE if args.is_latent_moe else SparseMoE
            self.mlp = moe(args, backends, tp)
        else:
            self.mlp = MLP(args.hidden_size, args.intermediate_size, backends, gated_act(args),
                           tp)
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.layer_idx = layer_idx
        self.block_size = args.attn_res_block_size
        if self.block_size:
            d, eps = args.hidden_size, args.rms_norm_eps
            self.self_attention_res_norm = RMSNorm(d, eps)
            self.self_attention_res_proj = nn.Linear(d, 1, bias=False)
            self.mlp_res_norm = RMSNorm(d, eps)
            self.mlp_res_proj = nn.Linear(d, 1, bias=False)

    def forward_attn_res(self, mlp_out: torch.Tensor | None, state: DepthState,
                         ctx: ForwardContext) -> torch.Tensor:
        """AttnRes form (layers/attn_res.py): mlp_out is the previous layer's MLP output (None
        at layer 0); returns this layer's MLP output; state is updated in place."""
        i, b = self.layer_idx, self.block_size
        starts_block = i % b == 0
        done = -(-i // b)                                  # finished blocks before this layer
        h = attn_res_read(state, mlp_out, self.self_attention_res_norm,
                          self.self_attention_res_proj, self.input_layernorm, done,
                          i // b if starts_block else -1)
        a = self.self_attn(h, ctx)
        if starts_block:   # the block restarts from this attention output
            state.prefix, a, done = a, None, done + 1
        h = attn_res_read(state, a, self.mlp_res_norm, self.mlp_res_proj,
                          self.post_attention_layernorm, done)
        return self._mlp(h, ctx.plan.pdl)

    def _mlp(self, h: torch.Tensor, pdl: bool) -> torch.Tensor:
        if isinstance(self.mlp, MLP):
            return self.mlp(h, pdl)
        return self.mlp(h, pdl=pdl)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None,
                ctx: ForwardContext) -> tuple[torch.Tensor, torch.Tensor]:
        """Pre-norm block in residual-stream form: returns (branch output, residual); the
        next norm adds the two (fused on the GPU)."""
        pdl = ctx.plan.pdl
        h, residual = self.input_layernorm.forward_residual(x, residual, pdl=pdl)
        h = self.self_attn(h, ctx)
        if isinstance(self.mlp, SparseMoE):
            router_x = self.mlp.router_input(h)        # [T, D] fp32, or None
            h, residual = self.post_attention_layernorm.forward_residual(h, residual, router_x,
                                                                         pdl=pdl)
            return self.mlp(h, router_x, pdl=pdl), residual
        h, residual = self.post_attention_layernorm.forward_residual(h, residual, pdl=pdl)
        return self._mlp(h, pdl), residual


class KimiLinearModel(nn.Module):
    def __init__(self, args: KimiLinearArgs, backends: LayerBackends,
                 tp: GroupComm = GroupComm.single()) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(args.vocab_size, args.hidden_size, tp)
        self.layers = nn.ModuleList(DecoderLayer(args, i, backends, tp)
                                    for i in range(args.num_hidden_layers))
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.num_attn_res_blocks = args.num_attn_res_blocks
        if self.num_attn_res_blocks:
            self.output_attn_res_norm = RMSNorm(args.hidden_size, args.rms_norm_eps)
            self.output_attn_res_proj = nn.Linear(args.hidden_size, 1, bias=False)

    def forward(self, input_ids: torch.Tensor, ctx: ForwardContext,
                aux_layers: tuple[int, ...] | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (normed hidden [T, D], the pre-final-norm hidden [T, D]); with aux_layers
        (residual-stream models only) the second is instead the outputs of those decoder layers
        (the residual stream after each), concatenated [T, len(aux_layers) * D]."""
        x = self.embed_tokens(input_ids)                             # [T, D]
        if self.num_attn_res_blocks:
            if aux_layers is not None:
                raise ValueError("aux_layers needs a residual-stream model (not AttnRes)")
            return self._forward_attn_res(x, ctx)
        residual, aux = None, []
        for i, layer in enumerate(self.layers):
            x, residual = layer(x, residual, ctx)
            if aux_layers is not None and i in aux_layers:
                aux.append(x if residual is None else x + residual)
        hidden, prenorm = self.norm.forward_residual(x, residual, pdl=ctx.plan.pdl)
        if aux_layers is not None:
            order = sorted(aux_layers)
            return hidden, torch.cat([aux[order.index(i)] for i in aux_layers], dim=-1)
        return hidden, prenorm

    def _forward_attn_res(self, x: torch.Tensor, ctx: ForwardContext
                          ) -> tuple[torch.Tensor, torch.Tensor]:
        """x: [T, D] embeddings -> (normed hidden, pre-norm hidden) [T, D]; the final read
        mixes every block and the last block's running sum (no input norm), then model.norm."""
        state = DepthState.start(x, self.num_attn_res_blocks)
        out = None
        for layer in self.layers:
            out = layer.forward_attn_res(out, state, ctx)
        h = attn_res_read(state, out, self.output_attn_res_norm, self.output_attn_res_proj,
                          None, self.num_attn_res_blocks)
        return self.norm(h), h


class KimiLinearForCausalLM(nn.Module):
    def __init__(self, args: KimiLinearArgs, backends: LayerBackends = LayerBackends(),
                 tp: GroupComm = GroupComm.single()) -> None:
        """backends: each layer kind's kernel backend (layers/backends.py select_backends),
        fixed for the model's lifetime. tp: the tensor-parallel group (size 1: the whole
        model on this rank)."""
        super().__init__()
        self.args = args
        self.backends = backends
        self.tp = tp
        self.model = KimiLinearModel(args, backends, tp)
        self.lm_head = ParallelLMHead(args.hidden_size, args.vocab_size, tp)
        if args.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, ctx: ForwardContext,
                return_prenorm: bool = False, aux_layers: tuple[int, ...] | None = None):
        """input_ids: [T]. Returns hidden states [T, D] (after the final norm); caches in ctx
        are read and updated. return_prenorm: returns (hidden, pre-final-norm hidden [T, D])
        instead (what the MTP drafter reads); with aux_layers as well, the second is the chosen
        layers' outputs [T, len(aux_layers) * D] (what the DSpark drafter reads). No positions:
        every layer is position-free (KDA is recurrent, MLA is NoPE)."""
        hidden, prenorm = self.model(input_ids, ctx, aux_layers if return_prenorm else None)
        return (hidden, prenorm) if return_prenorm else hidden

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [N, D] -> fp32 logits [N, vocab]."""
        return self.lm_head(hidden).float()

    def process_weights_after_loading(self) -> None:
        """Run once after every tensor is in place (the loader calls it): merges projections
        that share an input. Required before the first forward."""
        for module in self.modules():
            if module is not self and hasattr(module, "process_weights_after_loading"):
                module.process_weights_after_loading()
