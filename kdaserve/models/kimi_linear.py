"""KimiLinearForCausalLM over a flattened batch.

Parameter and buffer names match transformers' KimiLinearForCausalLM state_dict (>= 5.17 naming),
so checkpoints saved by transformers load by name; the loader maps the original Moonshot names.
"""

from __future__ import annotations

import torch
from torch import nn

from kdaserve.attention.forward_context import ForwardContext
from kdaserve.config.model_args import KimiLinearArgs
from kdaserve.layers.backends import LayerBackends
from kdaserve.layers.kda import KimiDeltaAttention
from kdaserve.layers.mla import MLAttention
from kdaserve.layers.mlp import MLP
from kdaserve.layers.moe import SparseMoE
from kdaserve.layers.norm import RMSNorm


class DecoderLayer(nn.Module):
    def __init__(self, args: KimiLinearArgs, layer_idx: int, backends: LayerBackends) -> None:
        super().__init__()
        self.is_kda = args.layer_types[layer_idx] == "linear_attention"
        if self.is_kda:
            self.self_attn = KimiDeltaAttention(args, args.kda_layer_ids.index(layer_idx),
                                                backends)
        else:
            self.self_attn = MLAttention(args, args.mla_layer_ids.index(layer_idx), backends)
        if args.mlp_layer_types[layer_idx] == "sparse":
            self.mlp = SparseMoE(args, backends)
        else:
            self.mlp = MLP(args.hidden_size, args.intermediate_size, backends)
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)

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
        return self.mlp(h, pdl), residual


class KimiLinearModel(nn.Module):
    def __init__(self, args: KimiLinearArgs, backends: LayerBackends) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(args, i, backends)
                                    for i in range(args.num_hidden_layers))
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        x = self.embed_tokens(input_ids)                             # [T, D]
        residual = None
        for layer in self.layers:
            x, residual = layer(x, residual, ctx)
        return self.norm.forward_residual(x, residual, pdl=ctx.plan.pdl)[0]


class KimiLinearForCausalLM(nn.Module):
    def __init__(self, args: KimiLinearArgs, backends: LayerBackends = LayerBackends()) -> None:
        """backends: each layer kind's kernel backend (layers/backends.py select_backends),
        fixed for the model's lifetime."""
        super().__init__()
        self.args = args
        self.backends = backends
        self.model = KimiLinearModel(args, backends)
        self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)
        if args.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """input_ids: [T]. Returns hidden states [T, D]; caches in ctx are read and updated.
        No positions: every layer is position-free (KDA is recurrent, MLA is NoPE)."""
        return self.model(input_ids, ctx)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [N, D] -> fp32 logits [N, vocab]."""
        return self.lm_head(hidden).float()

    def process_weights_after_loading(self) -> None:
        """Run once after every tensor is in place (the loader calls it): merges projections
        that share an input. Required before the first forward."""
        for module in self.modules():
            if module is not self and hasattr(module, "process_weights_after_loading"):
                module.process_weights_after_loading()
