"""Multi-head latent attention (NoPE). Parameter names follow transformers' KimiLinearAttention.

Kimi K3's pieces: q-LoRA (q_lora_rank: q = q_b_proj(RMSNorm(q_a_proj(x))) instead of a full-rank
q_proj) and the output gate (mla_use_output_gate: the attention output [T, H, v] times
sigmoid(g_proj(x)) before o_proj). Every projection that reads x is one merged GEMM.
"""

from __future__ import annotations

import torch
from torch import nn

from kdaserve.attention import mla_backend
from kdaserve.attention.forward_context import ForwardContext
from kdaserve.config.model_args import KimiLinearArgs
from kdaserve.distributed.comm import GroupComm
from kdaserve.kernels.linear.gemv import gemv_batched
from kdaserve.layers.backends import LayerBackends
from kdaserve.layers.fuse import merge_rows
from kdaserve.layers.linear import linear, use_gemv
from kdaserve.layers.norm import RMSNorm
from kdaserve.layers.parallel import ColumnParallelLinear, RowParallelLinear, divide


class MLAttention(nn.Module):
    """Under TP (tp.size > 1) the rank holds num_attention_heads / tp query heads: their rows
    of q (q_b), kv_b and the output gate; o_proj is row-parallel (one all-reduce). The latent
    path (q_a and its norm, kv_a and its norm) and so the latent KV cache are replicated."""

    def __init__(self, args: KimiLinearArgs, mla_index: int,
                 backends: LayerBackends = LayerBackends(),
                 tp: GroupComm = GroupComm.single()) -> None:
        super().__init__()
        self.mla_index = mla_index
        self.gemv = backends.gemv
        self.skinny = backends.skinny
        self.absorb_gemv = backends.mla == "triton_absorb_gemv"
        self.verify_fold = backends.mla_verify_fold
        """Uniform verify windows fold 2 rows into one MLA decode program (KernelConfig)."""
        self.tp = tp
        full_h = args.num_attention_heads
        self.num_heads = divide(full_h, tp.size, "num_attention_heads (MLA heads)")
        self.nope_dim, self.rope_dim = args.qk_nope_head_dim, args.qk_rope_head_dim
        self.v_dim, self.kv_lora_rank = args.v_head_dim, args.kv_lora_rank
        self.qk_dim = self.nope_dim + self.rope_dim
        self.scale = self.qk_dim ** -0.5
        h = self.num_heads
        self.q_lora_rank = args.q_lora_rank
        if self.q_lora_rank is None:
            self.q_proj = ColumnParallelLinear(args.hidden_size, full_h * self.qk_dim, tp)
        else:
            self.q_a_proj = nn.Linear(args.hidden_size, self.q_lora_rank, bias=False)
            self.q_a_layernorm = RMSNorm(self.q_lora_rank, eps=args.rms_norm_eps)
            self.q_b_proj = ColumnParallelLinear(self.q_lora_rank, full_h * self.qk_dim, tp)
        self.output_gate = args.mla_use_output_gate
        self.gate_kernel = backends.k3_gates == "triton"
        """The output gate as one in-place launch (kernels/activation sigmoid_gate)."""
        if self.output_gate:
            self.g_proj = ColumnParallelLinear(args.hidden_size, full_h * self.v_dim, tp)
        self.kv_a_proj_with_mqa = nn.Linear(args.hidden_size, self.kv_lora_rank + self.rope_dim,
                                            bias=False)
        # HF builds this norm without passing rms_norm_eps: its default 1e-6 is what runs.
        self.kv_a_layernorm = RMSNorm(self.kv_lora_rank, eps=1e-6)
        self.kv_b_proj = ColumnParallelLinear(self.kv_lora_rank,
                                              full_h * (self.nope_dim + self.v_dim), tp)
        self.o_proj = RowParallelLinear(full_h * self.v_dim, args.hidden_size, tp)
        self.w_uk_t: torch.Tensor | None = None
        """W_UK as [H, rank, nope] (CUDA, after loading): the batched GEMV's weight rows."""

    def _w_uk_uv(self) -> tuple[torch.Tensor, torch.Tensor]:
        """kv_b_proj split per head: W_UK [H, nope, rank], W_UV [H, v, rank]."""
        w = self.kv_b_proj.weight.view(self.num_heads, self.nope_dim + self.v_dim,
                                       self.kv_lora_rank)
        return w[:, :self.nope_dim], w[:, self.nope_dim:]

    def _expand(self, latent: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """latent [L, rank + rope] -> (kv [L, H, nope + v]: kv_b_proj's output, k_pe [L, rope]:
        the latents' rope columns); the backend builds k and v from them."""
        L, h = latent.shape[0], self.num_heads
        kv = self.kv_b_proj(latent[:, :self.kv_lora_rank]).view(L, h, self.nope_dim + self.v_dim)
        return kv, latent[:, self.kv_lora_rank:]

    def _absorbed(self, q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
                  seq_lens: torch.Tensor, out: torch.Tensor, pdl: bool, dcp=None,
                  rows_per_seq: int = 1, fold: bool = False) -> None:
        """q [R, H, qk] -> out [R, H, v]: row r attends to the first seq_lens[r] cached
        latents of block_table[r], in the latent space (W_UK folded into q, W_UV applied
        after). With absorb_gemv (CUDA, <= GEMV_MAX_ROWS rows) both per-head products run as
        one batched GEMV launch each (kernels/linear/gemv.py gemv_batched) instead of cuBLAS,
        and the decode kernel prefetches its first cache tile before its PDL wait. dcp (a
        DCPGroup): the cache holds this rank's shard and seq_lens are its local lengths.
        rows_per_seq > 1: uniform verify windows (the decode kernel splits their context by
        sequence), folded 2 rows a program with fold (verify_fold)."""
        w_uk, w_uv = self._w_uk_uv()
        R, h = q.shape[:2]
        by_gemv = use_gemv(q, self.absorb_gemv) and self.w_uk_t is not None
        if by_gemv:
            q_nope = q.new_empty(R, h, self.kv_lora_rank)                     # [R, H, rank]
            gemv_batched(q[..., :self.nope_dim].transpose(0, 1), self.w_uk_t,
                         out=q_nope.transpose(0, 1), pdl=pdl)
        else:
            q_nope = torch.einsum("bhn,hnr->bhr", q[..., :self.nope_dim], w_uk)   # [R, H, rank]
        # With the W_UK GEMV (a PDL launch after store_latent) in between, the decode kernel
        # may read the cache before its wait.
        o_lat = mla_backend.absorbed_attention(q_nope, q[..., self.nope_dim:], kv_cache,
                                               block_table, seq_lens, self.scale,
                                               pdl=pdl, prefetch_kv=by_gemv and dcp is None,
                                               dcp=dcp, rows_per_seq=rows_per_seq,
                                               fold=fold)
        if by_gemv:
            gemv_batched(o_lat.transpose(0, 1), w_uv, out=out.transpose(0, 1), pdl=pdl)
        else:
            out.copy_(torch.einsum("bhr,hvr->bhv", o_lat, w_uv))

    def process_weights_after_loading(self) -> None:
        q = self.q_proj if self.q_lora_rank is None else self.q_a_proj
        gate = (self.g_proj.weight,) if self.output_gate else ()
        # [q (or q_a) | kv_a | g]: every projection of x in one GEMM
        self.q_kva_weight = merge_rows(q.weight, self.kv_a_proj_with_mqa.weight, *gate)
        if self.kv_b_proj.weight.is_cuda:   # W_UK as [H, rank, nope] rows for the GEMV
            self.w_uk_t = self._w_uk_uv()[0].transpose(1, 2).contiguous()

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """x: [T, D] -> [T, D]."""
        md, pdl = ctx.attn, ctx.plan.pdl
        kv_cache = ctx.caches.mla_kv[self.mla_index]
        T, h = x.shape[0], self.num_heads
        q_ckv = linear(x, self.q_kva_weight, self.gemv, pdl=pdl,
                       skinny=self.skinny)                       # [T, nq + rank + rope (+ H*v)]
        nq = h * self.qk_dim if self.q_lora_rank is None else self.q_lora_rank
        nc = self.kv_lora_rank + self.rope_dim
        q, ckv = q_ckv[:, :nq], q_ckv[:, nq:nq + nc]                      # ckv: [T, rank + rope]
        if self.q_lora_rank is not None:
            q_a = self.q_a_layernorm(q.contiguous())                      # [T, q_lora_rank]
            q = linear(q_a, self.q_b_proj.weight, self.gemv, pdl=pdl,
                       skinny=self.skinny)                                # [T, H*qk]
        out = self._attend(q.reshape(T, h, self.qk_dim), ckv, kv_cache, md, pdl)  # [T, H, v]
        if self.output_gate and self.gate_kernel:
            from kdaserve.kernels.activation.activation import sigmoid_gate

            sigmoid_gate(out.view(T, h * self.v_dim), q_ckv[:, nq + nc:], pdl=pdl)
        elif self.output_gate:
            out = out * torch.sigmoid(q_ckv[:, nq + nc:]).view(T, h, self.v_dim)
        return self.tp.all_reduce(linear(out.reshape(T, h * self.v_dim), self.o_proj.weight,
                                         self.gemv, pdl=pdl, skinny=self.skinny))

    def _attend(self, q: torch.Tensor, ckv: torch.Tensor, kv_cache: torch.Tensor,
                md, pdl: bool) -> torch.Tensor:
        """Stores the new latent rows, then attends: absorbed rows (decodes, spec
        verification) and prefills. q: [T, H, qk_dim]; ckv: [T, rank + rope]."""
        T, h = q.shape[0], self.num_heads
        mla_backend.store_latent(kv_cache, md.slot_mapping[:T], ckv,
                                 self.kv_a_layernorm.weight, self.kv_a_layernorm.eps, pdl=pdl)
        out = q.new_empty(T, h, self.v_dim)
        nd = md.num_decodes
        if nd:
            if md.dcp is None:
                self._absorbed(q[:nd], kv_cache, md.block_table[:nd], md.seq_lens[:nd],
                               out[:nd], pdl)
            else:   # this rank's shard of each context
                self._absorbed(q[:nd], kv_cache, md.block_table[:nd],
                               md.dcp.local_seq_lens[:nd], out[:nd], pdl, md.dcp.group)
        absorbed = md.mla_absorbed
        skip = set()
        if absorbed is not None:   # spec verification rows: one absorbed row per token
            rows = absorbed.rows()
            q_rows = q[rows]                                              # [rows, H, qk]
            o_rows = q.new_empty(q_rows.shape[0], h, self.v_dim)          # [rows, H, v]
            window = absorbed.rows_per_seq if md.dcp is None else 1
            self._absorbed(q_rows, kv_cache, absorbed.block_table, absorbed.seq_lens, o_rows,
                           pdl, rows_per_seq=window, fold=self.verify_fold)
            out[rows] = o_rows
            skip = set(absorbed.reqs)
        prefills = [i for i in range(nd, md.num_reqs) if i not in skip]
        if prefills:
            mla_backend.prefill_attention(q, kv_cache, md, self._expand, self.scale, out,
                                          prefills)
        t1 = md.num_actual_tokens
        if t1 < T:
            out[t1:] = 0
        return out
