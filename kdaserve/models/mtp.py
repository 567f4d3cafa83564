"""The target's multi-token-prediction (MTP) layer as a drafter module (DeepSeek-V3 / Kimi K3
MTP; reference kimi_k3.md §1.10).

A checkpoint with `num_nextn_predict_layers = M` keeps M extra layers at
`model.layers.{num_hidden_layers + i}`: `enorm`, `hnorm` (RMSNorm), `eh_proj` (2H -> H),
`shared_head.norm`, `shared_head.head` and one decoder block (MLA + MoE, plain pre-norm
residual, no AttnRes) whose tensors sit directly under the layer prefix. One MTP step at
position p reads the target's pre-final-norm hidden h_p and the token t_{p+1}:
    x = eh_proj([enorm(embed(t_{p+1})), hnorm(h_p)])     (the embedding is zeroed at p == 0)
    s = block(x)                                          (the pre-norm output: the next h)
    logits = head(shared_head.norm(s))                    (predicts t_{p+2})
The embedding and the LM head are the target's own modules (shared, not copied: the
checkpoint's `shared_head.head` is not loaded). Only the first MTP layer is built: every draft
step reuses it (vLLM's rule for K > M; the served checkpoints have M = 1).
"""

from __future__ import annotations

import dataclasses
import logging
import os
from typing import Iterator

import torch
from torch import nn

from kdaserve.attention.forward_context import ForwardContext
from kdaserve.config import LoadConfig
from kdaserve.config.model_args import KimiLinearArgs
from kdaserve.layers.backends import LayerBackends
from kdaserve.layers.norm import RMSNorm
from kdaserve.models.kimi_linear import DecoderLayer

logger = logging.getLogger(__name__)

_NOT_LOADED = ("shared_head.head.", "embed_tokens.")
"""MTP-layer tensors of a checkpoint the drafter takes from the target instead."""


def mtp_args(target: KimiLinearArgs) -> KimiLinearArgs:
    """The MTP drafter's own args: one MLA + MoE layer with a plain residual stream (its cache
    is one MLA layer's paged KV and no KDA state)."""
    if target.num_nextn_predict_layers < 1:
        raise ValueError("speculative method 'mtp' needs a target with MTP layers "
                         f"(num_nextn_predict_layers >= 1), got num_nextn_predict_layers="
                         f"{target.num_nextn_predict_layers}")
    return dataclasses.replace(target, num_hidden_layers=1, layer_types=["full_attention"],
                               mlp_layer_types=["sparse"], attn_res_block_size=None,
                               num_nextn_predict_layers=0)


class MTPLayer(DecoderLayer):
    """One MTP layer: the decoder block's tensors at the layer's top level (the checkpoint
    layout) plus the input fusion and the head's norm."""

    def __init__(self, args: KimiLinearArgs, backends: LayerBackends) -> None:
        super().__init__(args, 0, backends)
        d, eps = args.hidden_size, args.rms_norm_eps
        self.enorm = RMSNorm(d, eps)
        self.hnorm = RMSNorm(d, eps)
        self.eh_proj = nn.Linear(2 * d, d, bias=False)
        self.shared_head = nn.Module()
        self.shared_head.norm = RMSNorm(d, eps)

    def forward_mtp(self, embeds: torch.Tensor, hidden: torch.Tensor, ctx: ForwardContext
                    ) -> torch.Tensor:
        """embeds [T, D] (the next tokens' embeddings, already zeroed at position 0), hidden
        [T, D] (pre-norm hidden of the previous depth) -> the pre-norm output [T, D]."""
        x = self.eh_proj(torch.cat([self.enorm(embeds), self.hnorm(hidden)], dim=-1))
        out, residual = DecoderLayer.forward(self, x, None, ctx)
        return out + residual


class KimiMTPModel(nn.Module):
    """The drafter: layers.0 = the MTP layer; embed_tokens / lm_head are the target's (held
    outside this module's parameters)."""

    def __init__(self, args: KimiLinearArgs, backends: LayerBackends) -> None:
        super().__init__()
        self.args = args
        """mtp_args(target args): num_hidden_layers = 1, one MLA layer."""
        self.layers = nn.ModuleList([MTPLayer(args, backends)])
        self._shared: tuple[nn.Embedding, nn.Linear] | None = None

    def share(self, target: nn.Module) -> None:
        """Use the target's embedding and LM head (a KimiLinearForCausalLM)."""
        self._shared = (target.model.embed_tokens, target.lm_head)

    def forward(self, next_ids: torch.Tensor, hidden: torch.Tensor, is_first: torch.Tensor,
                ctx: ForwardContext) -> torch.Tensor:
        """next_ids [T] (t_{p+1} per row), hidden [T, D] (pre-norm h_p), is_first [T] bool
        (p == 0) -> the pre-norm output [T, D]."""
        embeds = self._shared[0](next_ids)                                   # [T, D]
        embeds = torch.where(is_first[:, None], torch.zeros_like(embeds), embeds)
        return self.layers[0].forward_mtp(embeds, hidden.to(embeds.dtype), ctx)

    def compute_logits(self, prenorm: torch.Tensor) -> torch.Tensor:
        """prenorm [N, D] -> fp32 logits [N, V] through shared_head.norm and the LM head."""
        return self._shared[1](self.layers[0].shared_head.norm(prenorm)).float()

    def process_weights_after_loading(self) -> None:
        for module in self.modules():
            if module is not self and hasattr(module, "process_weights_after_loading"):
                module.process_weights_after_loading()


def build_mtp(target: nn.Module, target_args: KimiLinearArgs, dtype: torch.dtype,
              device: torch.device | str, backends: LayerBackends | None = None
              ) -> KimiMTPModel:
    """The MTP drafter built as models/registry.build_model builds a model (meta device, then
    storage on `device`), sharing the target's embedding and LM head. Not loaded yet
    (load_mtp_weights)."""
    from kdaserve.models.registry import build_model

    model = build_model(mtp_args(target_args), dtype, device, KimiMTPModel, backends)
    model.share(target)
    return model


def mtp_checkpoint_tensors(model_path: str, target_args: KimiLinearArgs
                           ) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, CPU tensor) of the first MTP layer's checkpoint tensors, renamed
    `model.layers.{num_hidden_layers}.X` -> `model.layers.0.X` (either scheme's prefix kept
    otherwise); only these tensors are read from the files."""
    from safetensors import safe_open

    from kdaserve.models.loader import TEXT_PREFIX, checkpoint_files

    layer = f"model.layers.{target_args.num_hidden_layers}."
    for path in checkpoint_files(model_path):
        with safe_open(path, framework="pt", device="cpu") as f:
            for name in f.keys():
                bare = name.removeprefix(TEXT_PREFIX)
                if not bare.startswith(layer):
                    continue
                rest = bare[len(layer):]
                if rest.startswith(_NOT_LOADED):
                    continue
                yield name[:len(name) - len(bare)] + "model.layers.0." + rest, f.get_tensor(name)


def load_mtp_weights(model: KimiMTPModel, model_path: str, target_args: KimiLinearArgs,
                     load_config: LoadConfig) -> None:
    """Fill the drafter from the target's checkpoint (or dummy weights), then
    process_weights_after_loading. Every drafter tensor must be in the checkpoint."""
    from kdaserve.models.loader import init_dummy_weights, load_safetensors_weights

    fmt = load_config.load_format
    if fmt == "dummy":
        init_dummy_weights(model, load_config.seed, load_config.dummy_routing)
    else:
        load_safetensors_weights(model, model_path,
                                 mtp_checkpoint_tensors(model_path, target_args))
        logger.info("loaded the MTP drafter from %s (model.layers.%d)",
                    os.path.basename(os.path.normpath(model_path)),
                    target_args.num_hidden_layers)
    if target_args.num_nextn_predict_layers > 1:
        logger.info("the checkpoint has %d MTP layers: the drafter uses the first one for "
                    "every draft step", target_args.num_nextn_predict_layers)
    model.process_weights_after_loading()
