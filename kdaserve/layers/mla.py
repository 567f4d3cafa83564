"""Multi-head latent attention (NoPE). Parameter names follow transformers' KimiLinearAttention."""

from __future__ import annotations

import torch
from torch import nn

from kdaserve.attention import mla_backend
from kdaserve.attention.metadata import ForwardContext
from kdaserve.layers.fuse import merge_rows
from kdaserve.layers.linear import linear
from kdaserve.layers.norm import RMSNorm
from kdaserve.models.hf_config import KimiLinearArgs


class MLAttention(nn.Module):
    decode_gemv = False
    """KernelConfig.decode_gemv (set by the model's configure_kernels)."""

    def __init__(self, args: KimiLinearArgs, mla_index: int) -> None:
        super().__init__()
        self.mla_index = mla_index
        self.num_heads = args.num_attention_heads
        self.nope_dim, self.rope_dim = args.qk_nope_head_dim, args.qk_rope_head_dim
        self.v_dim, self.kv_lora_rank = args.v_head_dim, args.kv_lora_rank
        self.qk_dim = self.nope_dim + self.rope_dim
        self.scale = self.qk_dim ** -0.5
        h = self.num_heads
        self.q_proj = nn.Linear(args.hidden_size, h * self.qk_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(args.hidden_size, self.kv_lora_rank + self.rope_dim,
                                            bias=False)
        # HF builds this norm without passing rms_norm_eps: its default 1e-6 is what runs.
        self.kv_a_layernorm = RMSNorm(self.kv_lora_rank, eps=1e-6)
        self.kv_b_proj = nn.Linear(self.kv_lora_rank, h * (self.nope_dim + self.v_dim), bias=False)
        self.o_proj = nn.Linear(h * self.v_dim, args.hidden_size, bias=False)

    def _w_uk_uv(self) -> tuple[torch.Tensor, torch.Tensor]:
        """kv_b_proj split per head: W_UK [H, nope, rank], W_UV [H, v, rank]."""
        w = self.kv_b_proj.weight.view(self.num_heads, self.nope_dim + self.v_dim,
                                       self.kv_lora_rank)
        return w[:, :self.nope_dim], w[:, self.nope_dim:]

    def _expand(self, latent: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """latent [L, rank + rope] -> k [L, H, qk_dim], v [L, H, v_dim]."""
        L, h = latent.shape[0], self.num_heads
        kv = self.kv_b_proj(latent[:, :self.kv_lora_rank]).view(L, h, self.nope_dim + self.v_dim)
        k_pe = latent[:, None, self.kv_lora_rank:].expand(L, h, self.rope_dim)
        k = torch.cat([kv[..., :self.nope_dim], k_pe], dim=-1)
        return k, kv[..., self.nope_dim:]

    def process_weights_after_loading(self) -> None:
        self.q_kva_weight = merge_rows(self.q_proj.weight, self.kv_a_proj_with_mqa.weight)

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """x: [T, D] -> [T, D]."""
        md = ctx.attn
        kv_cache = ctx.caches.mla_kv[self.mla_index]
        T, h = x.shape[0], self.num_heads
        q_ckv = linear(x, self.q_kva_weight, self.decode_gemv)     # [T, H*qk + rank + rope]
        q = q_ckv[:, :h * self.qk_dim].view(T, h, self.qk_dim)
        ckv = q_ckv[:, h * self.qk_dim:]                                  # [T, rank + rope]
        latent = torch.cat([self.kv_a_layernorm(ckv[:, :self.kv_lora_rank]),
                            ckv[:, self.kv_lora_rank:]], dim=-1)
        mla_backend.store_latent(kv_cache, md.slot_mapping[:T], latent)
        out = x.new_empty(T, h, self.v_dim)
        nd = md.num_decodes
        if nd:
            w_uk, w_uv = self._w_uk_uv()
            q_nope = torch.einsum("bhn,hnr->bhr", q[:nd, :, :self.nope_dim], w_uk)
            q_lat = torch.cat([q_nope, q[:nd, :, self.nope_dim:]], dim=-1)  # [B, H, rank+rope]
            o_lat = mla_backend.decode_attention(q_lat, kv_cache, md, self.scale,
                                                 self.kv_lora_rank)       # [B, H, rank]
            out[:nd] = torch.einsum("bhr,hvr->bhv", o_lat, w_uv)
        t0 = int(md.query_start_loc_cpu[nd])
        t1 = md.num_actual_tokens
        if t1 > t0:
            out[t0:t1] = mla_backend.prefill_attention(q[t0:t1], kv_cache, md, self._expand,
                                                       self.scale)
        if t1 < T:
            out[t1:] = 0
        return linear(out.view(T, h * self.v_dim), self.o_proj.weight, self.decode_gemv)
