"""The DSpark drafter (speculative method "dspark"; reference mxfp4_moe_specdec.md §3.3,
kimi_k3.md §4.2): a semi-autoregressive drafter conditioned on the target's hidden states.

Checkpoint: a speculators-format folder, `config.json` with `speculators_model_type: "dspark"`
and the DSpark keys (`aux_hidden_state_layer_ids`, `mask_token_id`, `target_hidden_size`,
`draft_vocab_size`, `markov_rank`, `markov_head_type`, `enable_confidence_head`, `block_size`,
`transformer_layer_config` = the draft layers' Kimi config), plus `model.safetensors` with this
module's own tensor names (the embedding and the LM head are the target's, not stored).

Dataflow per request whose committed tokens are t_0..t_{L-1}:
  - context: for every verified position p <= L-2 the target's outputs of the chosen layers
    (aux, [len(layers) * D_target]) go through `context_proj` and `context_norm`; each draft
    layer's MLA latent KV of position p is that layer's `kv_a_proj_with_mqa` of the context
    state, written into the drafter's paged MLA cache (`store_context`);
  - query block: K rows [t_{L-1}, mask, ..., mask] at positions L-1..L+K-2, one parallel pass
    of the dense MLA + MLP layers in which every row attends to the whole context and the whole
    block (non-causal: each row reads the first L-1+K cached latents), then `norm` and the
    shared LM head: base logits [K, V] (row i predicts t_{L+i});
  - Markov head (vanilla): left to right, logits_i = base_i + markov_proj(markov_embed(prev)),
    prev = the token sampled at i - 1 (t_{L-1} for row 0);
  - confidence head (optional): sigmoid(Linear([h_i, markov_embed(prev)])) per row.
The draft layers are the target's DecoderLayer (MLA NoPE, dense MLP) built from the draft args.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from dataclasses import dataclass

import torch
from torch import nn

from kdaserve.attention import mla_backend
from kdaserve.config import LoadConfig
from kdaserve.config.model_args import KimiLinearArgs
from kdaserve.layers.backends import LayerBackends
from kdaserve.layers.norm import RMSNorm
from kdaserve.models.kimi_linear import DecoderLayer

logger = logging.getLogger(__name__)

MARKOV_HEAD_TYPES = ("vanilla",)


@dataclass(frozen=True)
class DSparkConfig:
    """The DSpark keys of a speculators config.json (validated against the target)."""
    aux_hidden_state_layer_ids: tuple[int, ...]
    """Target decoder layers whose outputs condition the drafter (0-based)."""
    mask_token_id: int
    target_hidden_size: int
    draft_vocab_size: int
    markov_rank: int
    markov_head_type: str
    enable_confidence_head: bool
    block_size: int
    """The drafter's trained block length (num_speculative_tokens' default in the reference)."""
    draft_args: KimiLinearArgs
    """The draft layers: dense MLA + MLP, plain residual stream."""

    @classmethod
    def from_dict(cls, cfg: dict, target: KimiLinearArgs) -> DSparkConfig:
        """Validates every field; a bad one is a ValueError naming it."""
        if cfg.get("speculators_model_type") != "dspark":
            raise ValueError("speculators_model_type must be 'dspark', got "
                             f"{cfg.get('speculators_model_type')!r}")
        if target.attn_res_block_size:
            raise ValueError("speculative method 'dspark' needs a residual-stream target "
                             "(AttnRes targets are not supported)")

        def need(name: str):
            if name not in cfg:
                raise ValueError(f"dspark config has no {name}")
            return cfg[name]
        layers = need("aux_hidden_state_layer_ids")
        if not isinstance(layers, list) or not layers or not all(
                isinstance(i, int) and 0 <= i < target.num_hidden_layers for i in layers):
            raise ValueError(f"aux_hidden_state_layer_ids must be a non-empty list of target "
                             f"layer ids in [0, {target.num_hidden_layers}), got {layers!r}")
        if len(set(layers)) != len(layers):
            raise ValueError(f"aux_hidden_state_layer_ids has duplicates: {layers!r}")
        mask = need("mask_token_id")
        if not isinstance(mask, int) or not 0 <= mask < target.vocab_size:
            raise ValueError(f"mask_token_id must be a token id in [0, {target.vocab_size}), "
                             f"got {mask!r}")
        th = cfg.get("target_hidden_size", target.hidden_size)
        if th != target.hidden_size:
            raise ValueError(f"target_hidden_size {th} != the target's hidden_size "
                             f"{target.hidden_size}")
        dv = cfg.get("draft_vocab_size", target.vocab_size)
        if dv != target.vocab_size:
            raise ValueError(f"draft_vocab_size {dv} != the target's vocab_size "
                             f"{target.vocab_size} (a reduced draft vocabulary is not supported)")
        rank = cfg.get("markov_rank", 256)
        if not isinstance(rank, int) or rank < 1:
            raise ValueError(f"markov_rank must be >= 1, got {rank!r}")
        head = cfg.get("markov_head_type", "vanilla")
        if head not in MARKOV_HEAD_TYPES:
            raise ValueError(f"markov_head_type must be one of {MARKOV_HEAD_TYPES}, got {head!r}")
        block = cfg.get("block_size", 8)
        if not isinstance(block, int) or block < 1:
            raise ValueError(f"block_size must be >= 1, got {block!r}")
        layer_cfg = need("transformer_layer_config")
        args = KimiLinearArgs.from_hf_config(layer_cfg)
        n = args.num_hidden_layers
        if args.hidden_size != target.hidden_size:
            raise ValueError(f"transformer_layer_config hidden_size {args.hidden_size} != the "
                             f"target's {target.hidden_size} (the embedding is shared)")
        if set(args.layer_types) != {"full_attention"} or set(args.mlp_layer_types) != {"dense"}:
            raise ValueError("transformer_layer_config layer_types must all be full_attention "
                             "and mlp_layer_types all dense (DSpark layers are dense MLA + MLP)")
        args = dataclasses.replace(args, vocab_size=target.vocab_size, attn_res_block_size=None,
                                   num_nextn_predict_layers=0, layer_types=["full_attention"] * n,
                                   mlp_layer_types=["dense"] * n)
        return cls(tuple(layers), mask, th, dv, rank, head,
                   bool(cfg.get("enable_confidence_head", False)), block, args)

    @classmethod
    def from_folder(cls, path: str, target: KimiLinearArgs) -> DSparkConfig:
        cfg_path = os.path.join(path, "config.json")
        if not os.path.isfile(cfg_path):
            raise ValueError(f"dspark drafter folder {path!r} has no config.json")
        with open(cfg_path, encoding="utf-8") as f:
            return cls.from_dict(json.load(f), target)


class DSparkModel(nn.Module):
    """The drafter's own tensors; embed_tokens / lm_head are the target's (held outside this
    module's parameters)."""

    def __init__(self, cfg: DSparkConfig, backends: LayerBackends) -> None:
        super().__init__()
        args = self.args = cfg.draft_args
        self.cfg = cfg
        d, eps = args.hidden_size, args.rms_norm_eps
        self.context_proj = nn.Linear(len(cfg.aux_hidden_state_layer_ids) * cfg.target_hidden_size,
                                      d, bias=False)
        self.context_norm = RMSNorm(d, eps)
        self.layers = nn.ModuleList(DecoderLayer(args, i, backends)
                                    for i in range(args.num_hidden_layers))
        self.norm = RMSNorm(d, eps)
        self.markov_embed = nn.Embedding(args.vocab_size, cfg.markov_rank)   # W1 [V, r]
        self.markov_proj = nn.Linear(cfg.markov_rank, args.vocab_size, bias=False)  # W2
        if cfg.enable_confidence_head:
            self.confidence_head = nn.Linear(d + cfg.markov_rank, 1, bias=True)
        self._shared: tuple[nn.Embedding, nn.Linear] | None = None

    def share(self, target: nn.Module) -> None:
        """Use the target's embedding and LM head (a KimiLinearForCausalLM)."""
        self._shared = (target.model.embed_tokens, target.lm_head)

    def store_context(self, aux: torch.Tensor, kv_caches: list[torch.Tensor],
                      slots: torch.Tensor) -> None:
        """aux [T, len(layers) * D_target] (the target's chosen-layer outputs of verified
        positions) -> each layer's latent KV written at slots [T] of its cache."""
        c = self.context_norm(self.context_proj(aux.to(self.context_proj.weight.dtype)))
        for layer, cache in zip(self.layers, kv_caches):
            attn = layer.self_attn
            ckv = attn.kv_a_proj_with_mqa(c)                              # [T, rank + rope]
            mla_backend.store_latent(cache, slots, ckv, attn.kv_a_layernorm.weight,
                                     attn.kv_a_layernorm.eps)

    def forward_block(self, ids: torch.Tensor, kv_caches: list[torch.Tensor],
                      slots: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor,
                      rows_per_seq: int = 1) -> torch.Tensor:
        """The parallel pass over the query blocks: ids [R] (R = n * K rows), slots [R] (each
        row's cache slot), block_table [R, W] and seq_lens [R] (every row of a request reads
        its context plus its whole block) -> hidden [R, D] after the final norm. rows_per_seq:
        K when the rows come as n runs of one request's K rows (the MLA decode then splits the
        context by request and may fold rows, MLAttention.verify_fold); 1 otherwise."""
        x = self._shared[0](ids)                                          # [R, D]
        for layer, cache in zip(self.layers, kv_caches):
            x = x + self._attend(layer.self_attn, layer.input_layernorm(x), cache, slots,
                                 block_table, seq_lens, rows_per_seq)
            x = x + layer._mlp(layer.post_attention_layernorm(x), False)
        return self.norm(x)

    @staticmethod
    def _attend(attn, x: torch.Tensor, cache: torch.Tensor, slots: torch.Tensor,
                block_table: torch.Tensor, seq_lens: torch.Tensor, rows_per_seq: int
                ) -> torch.Tensor:
        """Non-causal MLA of the block rows: store their latents, then every row attends to
        its first seq_lens cached latents (absorbed form). x [R, D] -> [R, D]."""
        R, h = x.shape[0], attn.num_heads
        if attn.q_lora_rank is None:
            q = attn.q_proj(x)
        else:
            q = attn.q_b_proj(attn.q_a_layernorm(attn.q_a_proj(x)))
        mla_backend.store_latent(cache, slots, attn.kv_a_proj_with_mqa(x),
                                 attn.kv_a_layernorm.weight, attn.kv_a_layernorm.eps)
        out = x.new_empty(R, h, attn.v_dim)
        attn._absorbed(q.view(R, h, attn.qk_dim), cache, block_table, seq_lens, out, False,
                       rows_per_seq=rows_per_seq, fold=attn.verify_fold)
        if attn.output_gate:
            out = out * torch.sigmoid(attn.g_proj(x)).view(R, h, attn.v_dim)
        return attn.o_proj(out.reshape(R, h * attn.v_dim))

    def base_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [R, D] -> fp32 logits [R, V] through the shared LM head."""
        return self._shared[1](hidden).float()

    def markov_bias(self, prev: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """prev [n] token ids -> (markov embedding [n, r], fp32 logit bias [n, V])."""
        e = self.markov_embed(prev)
        return e, self.markov_proj(e).float()

    def confidence(self, hidden: torch.Tensor, markov: torch.Tensor) -> torch.Tensor:
        """hidden [n, D], markov embedding [n, r] -> confidence [n] in (0, 1)."""
        return torch.sigmoid(self.confidence_head(torch.cat([hidden, markov], -1))).squeeze(-1)

    def process_weights_after_loading(self) -> None:
        for module in self.modules():
            if module is not self and hasattr(module, "process_weights_after_loading"):
                module.process_weights_after_loading()


def build_dspark(target: nn.Module, cfg: DSparkConfig, dtype: torch.dtype,
                 device: torch.device | str, backends: LayerBackends | None = None
                 ) -> DSparkModel:
    """Built as models/registry.build_model builds a model (meta device, then storage on
    `device`), sharing the target's embedding and LM head; not loaded yet."""
    from kdaserve.models.registry import build_model

    model = build_model(cfg, dtype, device, DSparkModel, backends)
    model.share(target)
    return model


def load_dspark_weights(model: DSparkModel, path: str, load_config: LoadConfig) -> None:
    """Fill the drafter from the folder's safetensors (every tensor must be there) or with
    dummy weights, then process_weights_after_loading."""
    from kdaserve.models.loader import init_dummy_weights, load_safetensors_weights

    if load_config.load_format == "dummy":
        init_dummy_weights(model, load_config.seed, load_config.dummy_routing)
    else:
        load_safetensors_weights(model, path)
        logger.info("loaded the DSpark drafter from %s", os.path.basename(os.path.normpath(path)))
    model.process_weights_after_loading()


def dspark_expected_tensors(model: DSparkModel) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """name -> (shape, dtype) of the drafter's checkpoint tensors (its own state dict)."""
    return {n: (tuple(t.shape), t.dtype) for n, t in model.state_dict().items()}
