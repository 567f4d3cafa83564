"""Kimi Delta Attention layer. Parameter names follow transformers' KimiLinearDeltaAttention.

Kimi K3's variant (kda_full_rank_gate) replaces the low-rank output gate g_b_proj(g_a_proj(x))
by one full-rank g_proj [P, D], fused into the input projection with q, k, v, f_a and b; with
gate_lower_bound the decay is lb * sigmoid(A * (raw + dt_bias)) (kernels/reference.py kda_gate).
"""

from __future__ import annotations

import torch
from torch import nn

from kdaserve.attention import kda_backend
from kdaserve.attention.forward_context import ForwardContext
from kdaserve.config.model_args import KimiLinearArgs
from kdaserve.distributed.comm import GroupComm
from kdaserve.kernels import reference as ref
from kdaserve.layers.backends import LayerBackends
from kdaserve.layers.fuse import merge_rows
from kdaserve.layers.linear import linear
from kdaserve.layers.parallel import ColumnParallelLinear, RowParallelLinear, ShardSpec, divide
from kdaserve.layers.norm import RMSNormGated

MAX_FUSED_ROWS = 1024
"""Decode rows covered by a layer's persistent fused-decode tickets; larger steps (beyond any
captured graph) get a zeroed buffer per launch."""

GATE_GEMM_MIN_ROWS = 16
"""From this many decode rows the fused decode takes its gate projections (f_b f_a, g_b g_a)
from one GEMM over all rows instead of having every (row, head, value block) program load and
multiply the head's gate weight tiles (benchmarks/bench_batch.py kda, PERF_NOTES.md)."""


class ForgetGate(nn.Module):
    """Under TP the rank holds its heads: f_b_proj's rows, dt_bias and A_log split by head;
    the low-rank f_a_proj is replicated."""

    def __init__(self, args: KimiLinearArgs, backends: LayerBackends = LayerBackends(),
                 tp: GroupComm = GroupComm.single()) -> None:
        super().__init__()
        h = divide(args.linear_num_heads, tp.size, "linear_num_heads (KDA heads)")
        d = args.linear_head_dim
        self.num_heads, self.head_dim = h, d
        self.lower_bound = args.gate_lower_bound
        self.kernel = backends.k3_gates == "triton" and self.lower_bound is not None
        """activate_with_beta as one launch (kernels/kda/gate.py)."""
        self.f_a_proj = nn.Linear(args.hidden_size, d, bias=False)
        self.f_b_proj = ColumnParallelLinear(d, args.linear_num_heads * d, tp)
        self.dt_bias = nn.Parameter(torch.zeros(h * d, dtype=torch.float32))
        self.A_log = nn.Parameter(torch.zeros(1, 1, h, 1, dtype=torch.float32))

    def tp_shards(self) -> dict[str, ShardSpec]:
        return {"dt_bias": ShardSpec(0), "A_log": ShardSpec(2)}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [T, D] -> fp32 log decay [T, H, K]."""
        g_raw = self.f_b_proj(self.f_a_proj(x)).view(-1, self.num_heads, self.head_dim)
        return ref.kda_gate(g_raw, self.A_log, self.dt_bias, self.lower_bound)

    def activate(self, g_raw: torch.Tensor) -> torch.Tensor:
        """g_raw: [T, H, K] = f_b_proj(f_a_proj(x)) -> fp32 log decay [T, H, K]."""
        return ref.kda_gate(g_raw, self.A_log, self.dt_bias, self.lower_bound)

    def activate_with_beta(self, g_raw: torch.Tensor, beta_logits: torch.Tensor,
                           pdl: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """g_raw: [T, H, K], beta_logits: [T, H] -> (fp32 log decay [T, H, K], fp32
        sigmoid(beta_logits) [T, H]); one launch for the bounded gate under the triton k3_gates
        backend."""
        if self.kernel:
            from kdaserve.kernels.kda.gate import kda_gate_beta

            return kda_gate_beta(g_raw, self.A_log, self.dt_bias, self.lower_bound,
                                 beta_logits, pdl=pdl)
        return self.activate(g_raw), torch.sigmoid(beta_logits.float())


class KimiDeltaAttention(nn.Module):
    """Under TP (tp.size > 1) the rank holds linear_num_heads / tp heads: their rows of q, k,
    v, g (g_b), f_b, beta and the conv channels, their dt_bias / A_log, their state in the
    caches; o_proj is row-parallel (one all-reduce). The low-rank f_a / g_a and the per-head-
    dim o_norm are replicated."""

    def __init__(self, args: KimiLinearArgs, kda_index: int,
                 backends: LayerBackends = LayerBackends(),
                 tp: GroupComm = GroupComm.single()) -> None:
        super().__init__()
        self.kda_index = kda_index
        self.gemv = backends.gemv
        self.skinny = backends.skinny
        self.tp = tp
        h = divide(args.linear_num_heads, tp.size, "linear_num_heads (KDA heads)")
        d, w = args.linear_head_dim, args.linear_conv_kernel_dim
        self.num_heads, self.head_dim, self.conv_kernel = h, d, w
        p, full_p, hidden = h * d, args.linear_num_heads * d, args.hidden_size
        self.q_proj = ColumnParallelLinear(hidden, full_p, tp)
        self.k_proj = ColumnParallelLinear(hidden, full_p, tp)
        self.v_proj = ColumnParallelLinear(hidden, full_p, tp)
        # Depthwise causal conv over q|k|v channels; HF's Conv1d weight layout [3P, 1, W].
        self.conv1d = nn.Module()
        self.conv1d.weight = nn.Parameter(torch.empty(3 * p, 1, w))
        self.forget_gate = ForgetGate(args, backends, tp)
        self.b_proj = ColumnParallelLinear(hidden, args.linear_num_heads, tp)
        self.full_rank_gate = args.kda_full_rank_gate
        if self.full_rank_gate:
            self.g_proj = ColumnParallelLinear(hidden, full_p, tp)
        else:
            self.g_a_proj = nn.Linear(hidden, d, bias=False)
            self.g_b_proj = ColumnParallelLinear(d, full_p, tp)
        self.o_norm = RMSNormGated(d, eps=args.rms_norm_eps)
        self.o_proj = RowParallelLinear(full_p, hidden, tp)
        fusable = 8 <= d <= 128 and not d & (d - 1)
        self.fused_decode = backends.kda == "fla_fused_decode" and fusable
        """Decode-only steps run the one-launch decode kernel (it takes a power-of-two
        head_dim <= 128; the low-rank or Kimi K3's full-rank gate, bounded or not)."""
        self.state_prefetch = backends.kda_state_prefetch

    def tp_shards(self) -> dict[str, ShardSpec]:
        return {"conv1d.weight": ShardSpec(0, blocks=3)}   # q | k | v channels, by head

    def _out(self, o: torch.Tensor, pdl: bool) -> torch.Tensor:
        """o [T, P_rank] -> [T, D]: o_proj, all-reduced over the TP ranks."""
        return self.tp.all_reduce(linear(o, self.o_proj.weight, self.gemv, pdl=pdl,
                                           skinny=self.skinny))

    def process_weights_after_loading(self) -> None:
        if self.full_rank_gate:
            # q|k|v|g and the low-rank / scalar heads all read x: one GEMM instead of six.
            self.in_weight = merge_rows(self.q_proj.weight, self.k_proj.weight,
                                        self.v_proj.weight, self.g_proj.weight,
                                        self.forget_gate.f_a_proj.weight, self.b_proj.weight)
            f_b = self.forget_gate.f_b_proj.weight                   # [P, d]
            self.fg_b_weight = f_b.view(1, *f_b.shape)               # the fused decode's f_b
        else:
            # q|k|v and the three low-rank/scalar heads all read x: one GEMM instead of six.
            self.in_weight = merge_rows(self.q_proj.weight, self.k_proj.weight,
                                        self.v_proj.weight, self.forget_gate.f_a_proj.weight,
                                        self.g_a_proj.weight, self.b_proj.weight)
            # f_b_proj and g_b_proj (both [P, d]) read the two low-rank outputs: one batched
            # GEMM.
            p, d = self.g_b_proj.weight.shape
            self.fg_b_weight = merge_rows(self.forget_gate.f_b_proj.weight,
                                          self.g_b_proj.weight).view(2, p, d)
        # The fused decode's per-head tickets (zero between launches), allocated once: CUDA
        # graphs keep their address, so the buffer must never be replaced.
        self.decode_tickets = torch.zeros(MAX_FUSED_ROWS * self.num_heads, dtype=torch.int32,
                                          device=self.in_weight.device)

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """x: [T, D] -> [T, D]."""
        md, caches, pdl = ctx.attn, ctx.caches, ctx.plan.pdl
        T, h, d = x.shape[0], self.num_heads, self.head_dim
        proj = linear(x, self.in_weight, self.gemv, pdl=pdl,
                      skinny=self.skinny)                                 # [T, 3P + 2d + H]
        if self.fused_decode and ctx.plan.decode_only and x.is_cuda:
            o = self._fused_decode(proj, md, caches, pdl)                     # [T, P]
            return self._out(o, pdl)
        p = 3 * h * d
        if self.full_rank_gate:
            return self._forward_full_rank_gate(x, proj, ctx)
        qkv, small = proj[:, :p], proj[:, p:]                        # [T, 3P], [T, 2d + H]
        b = small[:, 2 * d:]                                         # [T, H] beta logits
        q, k, v = kda_backend.short_conv(qkv, self.conv1d.weight[:, 0], md,
                                         caches.kda_conv[self.kda_index], h, d,
                                         pdl=pdl)                       # [T, H, K]
        f_g = torch.bmm(small[:, :2 * d].view(T, 2, d).transpose(0, 1),
                        self.fg_b_weight.transpose(1, 2))            # [2, T, P]: f_b | g_b
        g_raw = f_g[0].view(T, h, d)                                 # gate pre-activation
        o = kda_backend.delta_rule(q, k, v, g_raw, b, self.forget_gate, md,
                                   caches.kda_recurrent[self.kda_index])  # [T, H, V]
        gate = f_g[1]                                                # [T, P]
        o = self.o_norm(o.reshape(T * h, d), gate.reshape(T * h, d), pdl=pdl).view(T, h * d)
        return self._out(o, pdl)

    def _forward_full_rank_gate(self, x: torch.Tensor, proj: torch.Tensor,
                                ctx: ForwardContext) -> torch.Tensor:
        """proj: [T, 4P + d + H] = q | k | v | g | f_a | b (the merged input projection)."""
        md, caches, pdl = ctx.attn, ctx.caches, ctx.plan.pdl
        T, h, d = x.shape[0], self.num_heads, self.head_dim
        p = h * d
        qkv, gate = proj[:, :3 * p], proj[:, 3 * p:4 * p]            # [T, 3P], [T, P]
        f_a, b = proj[:, 4 * p:4 * p + d], proj[:, 4 * p + d:]       # [T, d], [T, H]
        q, k, v = kda_backend.short_conv(qkv, self.conv1d.weight[:, 0], md,
                                         caches.kda_conv[self.kda_index], h, d,
                                         pdl=pdl)                       # [T, H, K]
        g_raw = linear(f_a, self.forget_gate.f_b_proj.weight).view(T, h, d)
        o = kda_backend.delta_rule(q, k, v, g_raw, b, self.forget_gate, md,
                                   caches.kda_recurrent[self.kda_index])  # [T, H, V]
        o = self.o_norm(o.reshape(T * h, d), gate.reshape(T * h, d), pdl=pdl).view(T, h * d)
        return self._out(o, pdl)

    def _fused_decode(self, proj: torch.Tensor, md, caches, pdl: bool) -> torch.Tensor:
        from kdaserve.kernels.kda.decode_fused import gate_projections, kda_decode_fused

        gate = self.forget_gate
        gates = None
        if proj.shape[0] >= GATE_GEMM_MIN_ROWS:
            gates = gate_projections(proj, self.fg_b_weight, self.num_heads, self.head_dim,
                                     self.full_rank_gate)
        return kda_decode_fused(
            proj, self.conv1d.weight[:, 0], caches.kda_conv[self.kda_index],
            caches.kda_recurrent[self.kda_index], md.state_indices[:proj.shape[0]],
            self.fg_b_weight, gate.A_log, gate.dt_bias, self.o_norm.weight, self.o_norm.eps,
            self.num_heads, self.head_dim, lower_bound=gate.lower_bound, pdl=pdl,
            tickets=self.decode_tickets if proj.shape[0] <= MAX_FUSED_ROWS else None,
            prefetch_state=self.state_prefetch,   # the previous launch: the input projection
            full_rank_gate=self.full_rank_gate, gates=gates)   # (or the gate GEMM: no cache)
