"""Plain-PyTorch twins of every kernel: the CPU path of the model and the tests' ground truth.

All functions compute in fp32 and return tensors in the input dtype unless stated. Shapes are for a
single sequence unless the argument says otherwise; callers loop over sequences on the CPU.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

# ---------------------------------------------------------------------------------------------
# KDA
# ---------------------------------------------------------------------------------------------


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dim (fla's convention, not F.normalize)."""
    return x / torch.sqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def kda_gate(g_raw: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor,
             lower_bound: float | None = None) -> torch.Tensor:
    """Log-space per-channel decay.

    g_raw: [T, H, K] (f_b_proj(f_a_proj(x)) viewed per head); A_log: [H] (any shape with H
    elements); dt_bias: [H * K]. Returns fp32 [T, H, K], values <= 0.
    """
    T, H, K = g_raw.shape
    g = g_raw.float() + dt_bias.float().view(1, H, K)
    A = A_log.float().reshape(1, H, 1).exp()
    if lower_bound is not None:
        return lower_bound * torch.sigmoid(A * g)
    softplus = torch.where(g > 20.0, g, torch.log(1.0 + torch.exp(g)))
    return -A * softplus


def kda_recurrent(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                  beta: torch.Tensor, initial_state: torch.Tensor | None,
                  scale: float | None = None, use_qk_l2norm: bool = True
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-by-token gated delta rule with per-key-channel decay.

    q, k: [T, H, K]; v: [T, H, V]; g: [T, H, K] log decay; beta: [T, H];
    initial_state: [H, K, V] fp32 or None. Returns (o [T, H, V] in v.dtype, state [H, K, V] fp32).
    """
    dtype = v.dtype
    q, k, v, g, beta = (x.float() for x in (q, k, v, g, beta))
    if use_qk_l2norm:
        q, k = l2norm(q), l2norm(k)
    T, H, K = k.shape
    V = v.shape[-1]
    q = q * (K ** -0.5 if scale is None else scale)
    S = (torch.zeros(H, K, V, dtype=torch.float32, device=v.device) if initial_state is None
         else initial_state.float().clone())
    o = torch.empty(T, H, V, dtype=torch.float32, device=v.device)
    for t in range(T):
        S = S * g[t].exp()[..., None]                              # decay rows (key dim)
        kv_mem = (S * k[t][..., None]).sum(dim=-2)                 # [H, V] = S^T k
        delta = (v[t] - kv_mem) * beta[t][..., None]               # [H, V]
        S = S + k[t][..., None] * delta[..., None, :]              # rank-1 write
        o[t] = (S * q[t][..., None]).sum(dim=-2)                   # read after write
    return o.to(dtype), S


def kda_chunk(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
              beta: torch.Tensor, initial_state: torch.Tensor | None,
              scale: float | None = None, use_qk_l2norm: bool = True, chunk_size: int = 64,
              return_chunk_states: bool = False):
    """Chunked (WY) form of `kda_recurrent`, same contract.

    With return_chunk_states it also returns the fp32 states at every chunk start
    ([NT, H, K, V]; entry i = state after the first i * chunk_size tokens; entry 0 = initial).
    """
    dtype = v.dtype
    q, k, v, g, beta = (x.float() for x in (q, k, v, g, beta))
    if use_qk_l2norm:
        q, k = l2norm(q), l2norm(k)
    T, H, K = k.shape
    V = v.shape[-1]
    C = chunk_size
    q = q * (K ** -0.5 if scale is None else scale)
    pad = (C - T % C) % C
    # [H, NT, C, *]
    def chunks(x):
        x = F.pad(x, (0, 0) * (x.dim() - 2) + (0, 0, 0, pad)) if x.dim() == 3 else F.pad(
            x, (0, 0, 0, pad))
        return x.transpose(0, 1).reshape(H, -1, C, *x.shape[2:])
    q, k, v, g, beta = chunks(q), chunks(k), chunks(v), chunks(g), chunks(beta)
    NT = q.shape[1]
    G = g.cumsum(dim=-2)                                           # [H, NT, C, K] inclusive
    causal = torch.tril(torch.ones(C, C, dtype=torch.bool, device=q.device))
    strict = torch.tril(torch.ones(C, C, dtype=torch.bool, device=q.device), diagonal=-1)
    # decay[r, c, d] = exp(G_r - G_c), masked to c <= r before exp to avoid overflow
    diff = (G.unsqueeze(-2) - G.unsqueeze(-3)).masked_fill(~causal[..., None], float("-inf"))
    decay = diff.exp()                                             # [H, NT, C, C, K]
    kk = (k.unsqueeze(-2) * k.unsqueeze(-3) * decay).sum(-1)       # [H, NT, C, C]
    L = (beta.unsqueeze(-1) * kk).masked_fill(~strict, 0.0)
    eye = torch.eye(C, dtype=torch.float32, device=q.device)
    Tm = torch.linalg.solve_triangular(eye + L, torch.diag_embed(beta), upper=False)
    W = Tm @ (G.exp() * k)                                         # [H, NT, C, K]
    U = Tm @ v                                                     # [H, NT, C, V]
    Aqk = (q.unsqueeze(-2) * k.unsqueeze(-3) * decay).sum(-1).masked_fill(~causal, 0.0)
    S = (torch.zeros(H, K, V, dtype=torch.float32, device=q.device) if initial_state is None
         else initial_state.float().clone())
    o = torch.empty(H, NT, C, V, dtype=torch.float32, device=q.device)
    states = []
    for n in range(NT):
        if return_chunk_states:
            states.append(S)
        v_new = U[:, n] - W[:, n] @ S                              # [H, C, V]
        o[:, n] = (q[:, n] * G[:, n].exp()) @ S + Aqk[:, n] @ v_new
        g_last = G[:, n, -1]                                       # [H, K]
        S = S * g_last.exp()[..., None] + (k[:, n] * (g_last[:, None] - G[:, n]).exp()
                                           ).transpose(-1, -2) @ v_new
    o = o.reshape(H, NT * C, V)[:, :T].transpose(0, 1).to(dtype)
    if return_chunk_states:
        return o, S, torch.stack(states)
    return o, S


def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, conv_state: torch.Tensor | None,
                  activation: str | None = "silu") -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal conv over time for one sequence.

    x: [T, D]; weight: [D, W]; conv_state: [D, W-1] (the W-1 inputs before x; None = zeros).
    Returns (y [T, D] in x.dtype, new_state [D, W-1] = the last W-1 inputs, in x.dtype).
    """
    T, D = x.shape
    W = weight.shape[-1]
    if conv_state is None:
        conv_state = x.new_zeros(D, W - 1)
    xs = torch.cat([conv_state.to(x.dtype), x.t()], dim=-1)        # [D, W-1+T]
    y = F.conv1d(xs.float().unsqueeze(0), weight.float().unsqueeze(1), groups=D)[0]  # [D, T]
    if activation == "silu":
        y = F.silu(y)
    return y.t().to(x.dtype), xs[:, -(W - 1):].clone()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF KimiLinearRMSNorm: normalise in fp32, cast back, then multiply by the weight."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def add_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
                 residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """s = x + residual (in x.dtype; x alone when residual is None) -> (rms_norm(s), s)."""
    s = x if residual is None else (x + residual)
    return rms_norm(s, weight, eps), s


def rms_norm_gated(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor,
                   eps: float) -> torch.Tensor:
    """fp32 x * rsqrt(mean(x^2) + eps) * w * sigmoid(gate), cast to x.dtype."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.float()
    return (xf * torch.sigmoid(gate.float())).to(x.dtype)


# ---------------------------------------------------------------------------------------------
# MLA over the paged latent cache
# ---------------------------------------------------------------------------------------------


def paged_gather(kv_cache: torch.Tensor, block_ids: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """The first num_tokens cached rows of one sequence. kv_cache: [num_blocks, block_size, D];
    block_ids: [>= ceil(num_tokens / block_size)]. Returns [num_tokens, D]."""
    bs = kv_cache.shape[1]
    nb = (num_tokens + bs - 1) // bs
    return kv_cache[block_ids[:nb].long()].reshape(-1, kv_cache.shape[-1])[:num_tokens]


def mla_prefill_kv(kv: torch.Tensor, k_pe: torch.Tensor, nope_dim: int,
                   v_width: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """MLA prefill's keys and values. kv: [L, H, nope + v] (kv_b_proj's output); k_pe:
    [L, rope]. Returns k [L, H, nope + rope] (the rope part shared by the heads) and v
    [L, H, v_width] (v, then zeros; None: v as is)."""
    L, H, _ = kv.shape
    k = torch.cat([kv[..., :nope_dim], k_pe[:, None].expand(L, H, k_pe.shape[-1])], dim=-1)
    v = kv[..., nope_dim:]
    if v_width is not None and v_width > v.shape[-1]:
        v = F.pad(v, (0, v_width - v.shape[-1]))
    return k, v


def mla_prefill_attention(q: torch.Tensor, kv: torch.Tensor, k_pe: torch.Tensor,
                          scale: float) -> torch.Tensor:
    """MLA prefill attention of one chunk. q: [q_len, H, nope + rope]; kv: [kv_len, H,
    nope + v] (kv_b_proj's output); k_pe: [kv_len, rope]. Query row i sees keys
    0 .. kv_len - q_len + i (the chunk follows kv_len - q_len cached tokens). Returns
    [q_len, H, v] in q's dtype, computed in fp32 (fp64 inputs stay fp64) by SDPA."""
    q_len, kv_len = q.shape[0], kv.shape[0]
    acc = torch.promote_types(q.dtype, torch.float32)
    k, v = mla_prefill_kv(kv, k_pe, q.shape[-1] - k_pe.shape[-1])
    # SDPA's fused kernels take only 4-D [B, H, L, D] inputs (3-D falls back to the math kernel)
    qi, kt, vt = (t.to(acc).transpose(0, 1)[None] for t in (q, k, v))     # [1, H, L, d]
    if q_len == kv_len:   # no cached prefix: plain causal (no mask tensor)
        o = F.scaled_dot_product_attention(qi, kt, vt, is_causal=True, scale=scale)
    else:   # bottom-right aligned causal
        o = F.scaled_dot_product_attention(qi, kt, vt, scale=scale,
                                           attn_mask=causal_lower_right(q_len, kv_len))
    return o[0].transpose(0, 1).to(q.dtype)                               # [q_len, H, v]


def mla_decode(q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
               seq_lens: torch.Tensor, scale: float, kv_lora_rank: int,
               return_lse: bool = False):
    """Absorbed MLA decode, one query token per sequence.

    q: [B, H, kv_lora_rank + rope] (q_nope already multiplied by W_UK); kv_cache:
    [num_blocks, block_size, kv_lora_rank + rope]; block_table: [B, max_blocks]; seq_lens: [B].
    Returns the latent output [B, H, kv_lora_rank] in q.dtype (before W_UV); with return_lse
    also each query's log-sum-exp over its keys, [B, H] fp32, natural log of
    sum_j exp(scale * q.k_j) (-inf for an empty sequence, whose output is 0). The lse lets
    partial outputs over disjoint key sets be merged exactly (merge_attn_states).
    """
    out = torch.empty(q.shape[0], q.shape[1], kv_lora_rank, dtype=q.dtype, device=q.device)
    lse = torch.empty(q.shape[0], q.shape[1], dtype=torch.float32, device=q.device)
    for b in range(q.shape[0]):
        kv = paged_gather(kv_cache, block_table[b], int(seq_lens[b])).float()  # [L, D]
        s = (q[b].float() @ kv.t()) * scale                                    # [H, L]
        p = torch.softmax(s, dim=-1)
        out[b] = (p @ kv[:, :kv_lora_rank]).to(q.dtype)
        lse[b] = torch.logsumexp(s, dim=-1)                                    # -inf if L == 0
    return (out, lse) if return_lse else out


def merge_attn_states(outs: torch.Tensor, lses: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge N attention outputs of the same queries over disjoint key sets.

    outs: [N, ..., D] (each normalised over its own keys); lses: [N, ...] their natural-log
    log-sum-exp (-inf = no keys: weight 0). Returns (out [..., D] in outs.dtype, lse [...] fp32):
    out = sum_n exp(lse_n - lse) * out_n with lse = log sum_n exp(lse_n), i.e. attention over
    the union of the key sets; rows with no keys anywhere give 0 and -inf.
    """
    lses = lses.float()
    m = lses.max(dim=0).values
    m = torch.where(torch.isinf(m), torch.zeros_like(m), m)     # all empty: avoid inf - inf
    w = torch.exp(lses - m)                                     # [N, ...]; 0 for empty parts
    denom = w.sum(dim=0)
    has = denom > 0
    out = (w[..., None] * outs.float()).sum(dim=0) / torch.where(has, denom, 1.0)[..., None]
    lse = torch.where(has, m + torch.log(torch.where(has, denom, 1.0)), float("-inf"))
    return out.to(outs.dtype), lse


def store_latent(kv_cache: torch.Tensor, slot_mapping: torch.Tensor, ckv: torch.Tensor,
                 norm_weight: torch.Tensor, eps: float) -> None:
    """MLA's new latents: ckv [T, rank + rope] = [c | k_pe] from kv_a_proj; c is RMS-normed
    (norm_weight [rank]), k_pe stored as is, into the slots (< 0 skipped)."""
    rank = norm_weight.shape[0]
    latent = torch.cat([rms_norm(ckv[:, :rank], norm_weight, eps), ckv[:, rank:]], dim=-1)
    store_kv(kv_cache, slot_mapping, latent)


def store_kv(kv_cache: torch.Tensor, slot_mapping: torch.Tensor, kv: torch.Tensor) -> None:
    """kv_cache.view(-1, D)[slot_mapping] = kv; slots < 0 are skipped (padding)."""
    flat = kv_cache.view(-1, kv_cache.shape[-1])
    keep = slot_mapping >= 0
    flat[slot_mapping[keep].long()] = kv[keep].to(kv_cache.dtype)


# ---------------------------------------------------------------------------------------------
# MoE
# ---------------------------------------------------------------------------------------------


def moe_topk_sigmoid(router_logits: torch.Tensor, correction_bias: torch.Tensor, top_k: int,
                     renormalize: bool, scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Sigmoid scores; the bias only picks the experts. Returns (weights fp32 [N, k], ids [N, k])."""
    scores = router_logits.float().sigmoid()
    ids = torch.topk(scores + correction_bias.float(), k=top_k, dim=-1, sorted=False)[1]
    w = scores.gather(1, ids)
    if renormalize:
        w = w / (w.sum(dim=-1, keepdim=True) + 1e-20)
    return w * scaling, ids


def silu_and_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """SwiGLU's gated activation: silu(gate) * up."""
    return F.silu(gate) * up


def situ_and_mul(gate: torch.Tensor, up: torch.Tensor, beta: float,
                 linear_beta: float | None) -> torch.Tensor:
    """Kimi K3's SiTU, a soft-clipped SwiGLU: [beta * tanh(gate / beta) * sigmoid(gate)] *
    [linear_beta * tanh(up / linear_beta)] (the up branch unclipped when linear_beta is None).
    Computed in fp32, returned in gate.dtype."""
    g, u = gate.float(), up.float()
    act = beta * torch.tanh(g / beta) * torch.sigmoid(g)
    if linear_beta is not None:
        u = linear_beta * torch.tanh(u / linear_beta)
    return (act * u).to(gate.dtype)


def sigmoid_gate(x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """An output gate: x * sigmoid(gate) in fp32, returned in x.dtype (MLA's attn_out gate)."""
    return (x.float() * torch.sigmoid(gate.float())).to(x.dtype)


def moe_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                topk_ids: torch.Tensor, act=silu_and_mul) -> torch.Tensor:
    """Routed gated experts. x: [N, D]; w13: [E, 2I, D] (gate rows then up rows);
    w2: [E, D, I]; topk_*: [N, k]; act(gate, up) -> [.., I] (default silu * up).
    Returns [N, D] in x.dtype."""
    return _moe_loop(x, lambda e: (w13[e], w2[e]), w2.shape[-1], topk_weights, topk_ids, act)


def moe_experts_mxfp4(x: torch.Tensor, w13_packed: torch.Tensor, w13_scale: torch.Tensor,
                      w2_packed: torch.Tensor, w2_scale: torch.Tensor,
                      topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                      act=silu_and_mul) -> torch.Tensor:
    """`moe_experts` over MXFP4 weights (kernels/mxfp4/format.py layout): w13_packed [E, 2I,
    D/2], w13_scale [E, 2I, D/32], w2_packed [E, D, I/2], w2_scale [E, D, I/32]. Each used
    expert is dequantised exactly to x.dtype (fp32 on the CPU), then the same math; the
    twin of the MXFP4 MoE kernel, which reads the 4-bit weights directly."""
    from kdaserve.kernels.mxfp4.format import dequantize_mxfp4

    def weights(e: int):
        return (dequantize_mxfp4(w13_packed[e], w13_scale[e], x.dtype),
                dequantize_mxfp4(w2_packed[e], w2_scale[e], x.dtype))
    return _moe_loop(x, weights, w2_packed.shape[-1] * 2, topk_weights, topk_ids, act)


def moe_partials_mxfp4(x: torch.Tensor, w13_packed: torch.Tensor, w13_scale: torch.Tensor,
                       w2_packed: torch.Tensor, w2_scale: torch.Tensor, topk_ids: torch.Tensor,
                       act=silu_and_mul) -> torch.Tensor:
    """Twin of kernels/moe/mxfp4_moe.py moe_partials with MXFP4 weights: each routing entry's
    unweighted expert output, [N * k, D] in x.dtype (row n * k + j: expert topk_ids[n, j] on
    x[n]; rows of ids outside [0, E) are zero)."""
    from kdaserve.kernels.mxfp4.format import dequantize_mxfp4

    return moe_partials(x, lambda e: (dequantize_mxfp4(w13_packed[e], w13_scale[e]),
                                      dequantize_mxfp4(w2_packed[e], w2_scale[e])),
                        w13_packed.shape[0], topk_ids, act)


def moe_partials(x: torch.Tensor, weights, num_experts: int, topk_ids: torch.Tensor,
                 act=silu_and_mul) -> torch.Tensor:
    """Twin of kernels/moe/mxfp4_moe.py moe_partials: weights(e) -> (w13 [2I, D],
    w2 [D, I]) (dense: lambda e: (w13[e], w2[e])); fp32 math, [N * k, D] in x.dtype."""
    N, k = topk_ids.shape
    out = torch.zeros(N * k, x.shape[1], dtype=x.dtype, device=x.device)
    ids = topk_ids.reshape(-1)
    for e in torch.unique(ids).tolist():
        if not 0 <= e < num_experts:
            continue
        rows = torch.where(ids == e)[0]
        w13, w2 = (w.float() for w in weights(e))
        inter = w2.shape[-1]
        h = x[rows // k].float() @ w13.t()
        out[rows] = (act(h[:, :inter], h[:, inter:]) @ w2.t()).to(x.dtype)
    return out


def latent_moe_tail(partials: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                    up_weight: torch.Tensor, norm_weight: torch.Tensor | None, eps: float,
                    residual: torch.Tensor | None = None,
                    num_experts: int | None = None) -> torch.Tensor:
    """Twin of kernels/moe/mxfp4_moe.py latent_moe_tail: lat[n] = sum_j w[n, j] *
    partials[n * k + j] (fp32; ids outside [0, num_experts) skipped), RMSNorm(lat; norm_weight)
    when given, @ up_weight^T (+ residual). Returns [N, H] in up_weight.dtype."""
    N, k = topk_ids.shape
    ok = topk_ids >= 0
    if num_experts is not None:
        ok &= topk_ids < num_experts
    w = torch.where(ok, topk_weights.float(), 0.0)                            # [N, k]
    lat = (w[..., None] * partials.float().view(N, k, -1).nan_to_num()).sum(1)  # [N, L]
    if norm_weight is not None:
        lat = lat * torch.rsqrt(lat.pow(2).mean(-1, keepdim=True) + eps) * norm_weight.float()
    out = lat @ up_weight.float().t()
    if residual is not None:
        out = out + residual.float()
    return out.to(up_weight.dtype)


def _moe_loop(x, weights, inter: int, topk_weights, topk_ids, act) -> torch.Tensor:
    """out[n] = sum_j topk_weights[n, j] * W2_e @ act(W1_e x_n, W3_e x_n), e = topk_ids[n, j];
    weights(e) -> (w13 [2I, D], w2 [D, I]). The top-k sum accumulates in fp32."""
    out = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float32, device=x.device)
    for e in torch.unique(topk_ids).tolist():
        tok, pos = torch.where(topk_ids == e)
        w13, w2 = weights(e)
        h = x[tok] @ w13.t()
        h = act(h[:, :inter], h[:, inter:])
        y = h @ w2.t()
        out.index_add_(0, tok, y.float() * topk_weights[tok, pos, None].float())
    return out.to(x.dtype)


# ---------------------------------------------------------------------------------------------
# AttnRes (attention over depth, Kimi K3)
# ---------------------------------------------------------------------------------------------


def attn_res(prefix: torch.Tensor, delta: torch.Tensor | None, blocks: torch.Tensor,
             norm_weight: torch.Tensor, query: torch.Tensor,
             out_norm_weight: torch.Tensor | None, num_blocks: int, write_idx: int,
             eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """One AttnRes read, per token (rows are independent).

    prefix: [T, D] running sum of the current block's sublayer outputs; delta: [T, D] added to
    it first (None: nothing); blocks: [T, NB, D] finished blocks (block 0 = the embedding),
    written in place at write_idx (>= 0) with the updated prefix. The sources are
    blocks[:, :num_blocks] and the prefix; logit_s = query . RMSNorm(s; norm_weight) (query:
    [D], the sublayer's res_proj row), mixed = sum_s softmax(logit)_s * s over the raw sources
    (fp32), then RMSNorm(mixed; out_norm_weight) when given.
    Returns (prefix [T, D], output [T, D]) in prefix.dtype."""
    if delta is not None:
        prefix = prefix + delta
    if write_idx >= 0:
        blocks[:, write_idx] = prefix
    src = torch.cat([blocks[:, :num_blocks], prefix[:, None]], dim=1).float()  # [T, S, D]
    if src.shape[1] == 1:
        mixed = src[:, 0]
    else:
        keys = src * torch.rsqrt(src.pow(2).mean(-1, keepdim=True) + eps) * norm_weight.float()
        p = torch.softmax((keys * query.float()).sum(-1), dim=-1)           # [T, S]
        mixed = (p[..., None] * src).sum(dim=1)                              # [T, D]
    mixed = mixed.to(prefix.dtype)
    out = mixed if out_norm_weight is None else rms_norm(mixed, out_norm_weight, eps)
    return prefix, out


# ---------------------------------------------------------------------------------------------
# Twins added for the Triton kernels
# ---------------------------------------------------------------------------------------------


def causal_conv1d_varlen(x: torch.Tensor, weight: torch.Tensor, cu_seqlens: torch.Tensor,
                         conv_states: torch.Tensor, state_indices: torch.Tensor,
                         has_initial_state: torch.Tensor, activation: str | None = "silu"
                         ) -> torch.Tensor:
    """Packed-sequence prefill conv; updates conv_states in place (twin of
    kernels.conv.causal_conv1d.causal_conv1d_varlen).

    x: [T, D]; weight: [D, W]; cu_seqlens: [B+1]; conv_states: [num_slots, D, W-1];
    state_indices: [B] (< 0: padding, slot untouched, zero window); has_initial_state: [B] bool.
    Rows past cu_seqlens[-1] get y = 0. Returns y [T, D] in x.dtype.
    """
    y = torch.zeros_like(x)
    cu = cu_seqlens.tolist()
    for b in range(len(cu) - 1):
        slot = int(state_indices[b])
        init = conv_states[slot] if slot >= 0 and bool(has_initial_state[b]) else None
        if cu[b + 1] == cu[b]:                  # empty sequence: the window stays (or is zeroed)
            new_state = init.clone() if init is not None else torch.zeros_like(conv_states[0])
        else:
            y[cu[b]:cu[b + 1]], new_state = causal_conv1d(x[cu[b]:cu[b + 1]], weight, init,
                                                          activation)
        if slot >= 0:
            conv_states[slot] = new_state.to(conv_states.dtype)
    return y


def causal_conv1d_update(x: torch.Tensor, weight: torch.Tensor, conv_states: torch.Tensor,
                         state_indices: torch.Tensor, activation: str | None = "silu"
                         ) -> torch.Tensor:
    """One decode token per sequence; shifts x into conv_states[state_indices[b]] in place (twin of
    kernels.conv.causal_conv1d.causal_conv1d_update). x: [B, D]; returns y [B, D] in x.dtype."""
    y = torch.empty_like(x)
    for b in range(x.shape[0]):
        slot = int(state_indices[b])
        init = conv_states[slot] if slot >= 0 else None
        y[b:b + 1], new_state = causal_conv1d(x[b:b + 1], weight, init, activation)
        if slot >= 0:
            conv_states[slot] = new_state.to(conv_states.dtype)
    return y


# ---------------------------------------------------------------------------------------------
# Twins for speculative decoding (RecoverSSM)
# ---------------------------------------------------------------------------------------------
# A spec request brings T_i = 1 + K_i tokens (its last sampled token, then its drafts), packed by
# cu_seqlens [N+1]. After sampling, n_i = accepted drafts + 1 of them are real (vLLM's
# num_accepted_tokens; 0 <= n_i <= T_i). Two ways to leave no trace of the rest:
#   RecoverSSM: verify reads S_0 and never writes it, recording per token
#     u_t = beta_t (v_t - S'_t^T k_t) (S'_t = decayed state before token t), k_t (normalised) and
#     g_t; commit then folds exactly n_i tokens: S <- S * exp(g_t) + k_t u_t^T for t < n_i.
#   per-position (baseline): verify writes the state after token t to slot idx[i, t]; the slot
#     after the last accepted token is then the request's state.
# The conv window works the same way over the step's pre-conv inputs x: the window after m
# tokens is columns m .. m + W-2 of cat(window_before, x^T).


def _pad_by_request(x: torch.Tensor, cu: list[int], t_max: int) -> torch.Tensor:
    """[T, *] packed -> [N, t_max, *]: each request's first t_max rows, zero-padded."""
    out = x.new_zeros(len(cu) - 1, t_max, *x.shape[1:])
    for i in range(len(cu) - 1):
        n = min(cu[i + 1] - cu[i], t_max)
        out[i, :n] = x[cu[i]:cu[i] + n]
    return out


def _unpad(x: torch.Tensor, cu: list[int]) -> torch.Tensor:
    return torch.cat([x[i, :cu[i + 1] - cu[i]] for i in range(len(cu) - 1)])


def kda_spec_verify(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                    beta: torch.Tensor, cu_seqlens: torch.Tensor, state_pool: torch.Tensor,
                    state_indices: torch.Tensor, initial_cols: torch.Tensor | None = None,
                    per_position: bool = False, scale: float | None = None,
                    use_qk_l2norm: bool = True):
    """Gated delta rule over each spec request's window, batched over requests.

    q, k: [T, H, K]; v: [T, H, V]; g: [T, H, K] fp32 log decay; beta: [T, H] fp32;
    cu_seqlens: [N+1]; state_pool: [slots, H, K, V] fp32; state_indices: [N] (RecoverSSM) or
    [N, 1+K] (per-position: column t receives the state after token t); initial_cols: [N], the
    column S_0 is read from (default 0; vLLM's num_accepted_prev - 1).
    Returns (o [T, H, V] in v.dtype, u [T, H, V] fp32, k_hat [T, H, K] fp32). The pool is left
    untouched unless per_position.
    """
    dtype = v.dtype
    idx = state_indices.long().view(len(cu_seqlens) - 1, -1)                  # [N, C]
    cols = (torch.zeros(idx.shape[0], dtype=torch.long, device=idx.device)
            if initial_cols is None else initial_cols.long())
    cu = cu_seqlens.tolist()
    lens = [cu[i + 1] - cu[i] for i in range(len(cu) - 1)]
    if per_position and max(lens, default=0) > idx.shape[1]:
        raise ValueError(f"a request has {max(lens)} tokens but state_indices has only "
                         f"{idx.shape[1]} columns")
    qf, kf, vf, gf, bf = (x.float() for x in (q, k, v, g, beta))
    if use_qk_l2norm:
        qf, kf = l2norm(qf), l2norm(kf)
    K = kf.shape[-1]
    qf = qf * (K ** -0.5 if scale is None else scale)
    t_max = max(lens, default=0)
    qp, kp, vp, gp, bp = (_pad_by_request(x, cu, t_max) for x in (qf, kf, vf, gf, bf))
    S = state_pool[idx.gather(1, cols[:, None]).squeeze(1)].float()           # [N, H, K, V]
    o = torch.zeros_like(vp)
    u = torch.zeros_like(vp)
    lens_t = torch.tensor(lens, device=S.device)
    for t in range(t_max):
        S = S * gp[:, t].exp()[..., None]                                      # decay key rows
        kv_mem = (S * kp[:, t][..., None]).sum(dim=-2)                         # [N, H, V]
        u[:, t] = (vp[:, t] - kv_mem) * bp[:, t][..., None]
        S = S + kp[:, t][..., None] * u[:, t][..., None, :]
        o[:, t] = (S * qp[:, t][..., None]).sum(dim=-2)
        if per_position:
            live = (lens_t > t).nonzero().squeeze(1)
            state_pool[idx[live, t]] = S[live].to(state_pool.dtype)
    return _unpad(o, cu).to(dtype), _unpad(u, cu), kf


def kda_recover_commit(state_pool: torch.Tensor, state_indices: torch.Tensor, u: torch.Tensor,
                       k_hat: torch.Tensor, g: torch.Tensor, cu_seqlens: torch.Tensor,
                       num_accepted: torch.Tensor) -> None:
    """Fold the first num_accepted[i] tokens of request i into state_pool[state_indices[i]]:
    S_n = S_0 * prod_{t<n} D_t + sum_{t<n} (k_t u_t^T) * prod_{t<s<n} D_s, D_t = exp(g_t) per
    key row, computed forward. u, k_hat from `kda_spec_verify`; g: [T, H, K] fp32."""
    cu = cu_seqlens.tolist()
    n = num_accepted.tolist()
    for i in range(len(cu) - 1):
        if not 0 <= n[i] <= cu[i + 1] - cu[i]:
            raise ValueError(f"num_accepted[{i}]={n[i]} outside [0, {cu[i + 1] - cu[i]}]")
    t_max = max(n, default=0)
    if t_max == 0:
        return
    slots = state_indices.long().view(-1)
    up, kp, gp = (_pad_by_request(x.float(), cu, t_max) for x in (u, k_hat, g))
    S = state_pool[slots].float()                                              # [N, H, K, V]
    n_t = torch.tensor(n, device=S.device)
    for t in range(t_max):
        live = (n_t > t)[:, None, None, None]
        upd = S * gp[:, t].exp()[..., None] + kp[:, t][..., None] * up[:, t][..., None, :]
        S = torch.where(live, upd, S)
    state_pool[slots] = S.to(state_pool.dtype)


def conv_window_after(window: torch.Tensor, x: torch.Tensor, m: int) -> torch.Tensor:
    """window: [D, W-1] before the step; x: [T, D] the step's pre-conv inputs. Returns the
    window after the first m tokens (0 <= m <= T)."""
    if not 0 <= m <= x.shape[0]:
        raise ValueError(f"m={m} outside [0, {x.shape[0]}]")
    w1 = window.shape[-1]
    xs = torch.cat([window, x.t().to(window.dtype)], dim=-1)                  # [D, W-1+T]
    return xs[:, m:m + w1].clone()


def conv_spec_verify(x: torch.Tensor, weight: torch.Tensor, cu_seqlens: torch.Tensor,
                     conv_pool: torch.Tensor, state_indices: torch.Tensor,
                     initial_cols: torch.Tensor | None = None, per_position: bool = False,
                     activation: str | None = "silu") -> torch.Tensor:
    """Causal conv over each spec request's window from conv_pool[idx[i, initial_cols[i]]].
    RecoverSSM: the pool is read only. per_position: column t of state_indices [N, 1+K]
    receives the window after token t. x: [T, D]; weight: [D, W]. Returns y [T, D]."""
    idx = state_indices.long().view(len(cu_seqlens) - 1, -1)
    cols = [0] * idx.shape[0] if initial_cols is None else initial_cols.tolist()
    cu = cu_seqlens.tolist()
    y = torch.empty_like(x)
    windows = [conv_pool[int(idx[i, cols[i]])].clone() for i in range(idx.shape[0])]
    for i, window in enumerate(windows):
        s, e = cu[i], cu[i + 1]
        if e == s:
            continue
        y[s:e], _ = causal_conv1d(x[s:e], weight, window, activation)
        if per_position:
            if e - s > idx.shape[1]:
                raise ValueError(f"request {i} has {e - s} tokens but state_indices has only "
                                 f"{idx.shape[1]} columns")
            for t in range(e - s):
                conv_pool[int(idx[i, t])] = conv_window_after(window, x[s:e], t + 1)
    return y


def conv_recover_commit(conv_pool: torch.Tensor, state_indices: torch.Tensor, x: torch.Tensor,
                        cu_seqlens: torch.Tensor, num_accepted: torch.Tensor) -> None:
    """conv_pool[state_indices[i]] <- its window after the first num_accepted[i] tokens of the
    step (x: [T, D] the step's pre-conv inputs, as given to `conv_spec_verify`)."""
    cu = cu_seqlens.tolist()
    for i, (slot, m) in enumerate(zip(state_indices.view(-1).tolist(), num_accepted.tolist())):
        conv_pool[slot] = conv_window_after(conv_pool[slot], x[cu[i]:cu[i + 1]], m)


def select_per_position(pools: list[torch.Tensor], state_indices: torch.Tensor,
                        num_accepted: torch.Tensor) -> None:
    """Per-position mode, after sampling: copy column num_accepted[i] - 1 of state_indices
    [N, 1+K] into column 0 (the request's own slot) in every pool (recurrent and conv state of
    each KDA layer). Requests with num_accepted == 1 need no copy (n == 0 is not allowed:
    column 0 was already overwritten by the state after token 0)."""
    n = num_accepted.long()
    if bool((n < 1).any()) or bool((n > state_indices.shape[1]).any()):
        raise ValueError(f"num_accepted must be in [1, {state_indices.shape[1]}] in "
                         f"per-position mode, got {n.tolist()}")
    idx = state_indices.long()
    src = idx.gather(1, (n - 1)[:, None]).squeeze(1)
    dst = idx[:, 0]
    move = src != dst
    for pool in pools:
        pool[dst[move]] = pool[src[move]]


# ---------------------------------------------------------------------------------------------
# Sampling
# ---------------------------------------------------------------------------------------------


def top_k_top_p_threshold_ref(logits: torch.Tensor, top_k: torch.Tensor | None = None,
                              top_p: torch.Tensor | None = None) -> torch.Tensor:
    """logits [B, V] (-inf allowed), top_k [B] int or None (<= 0 off, > V means V), top_p [B]
    or None (>= 1 off) -> tau [B] fp32; keep the tokens with logits >= tau.

    tk = the k-th largest logit (-inf when off). With p = softmax(logits) and Z = the mass of
    l >= tk: tp = the largest logit t with mass(l >= max(t, tk)) >= top_p * Z (-inf when off).
    tau = max(tk, tp): ties with the boundary are kept, the row max always is. Masses in fp64.
    """
    B, V = logits.shape
    desc = logits.double().sort(dim=-1, descending=True).values  # [B, V]
    off = torch.full((B,), float("-inf"), dtype=torch.float64, device=logits.device)
    tk = off
    if top_k is not None:
        k = top_k.long().clamp(max=V)
        kth = desc.gather(1, (k.clamp(min=1) - 1).unsqueeze(1)).squeeze(1)  # [B]
        tk = torch.where(k > 0, kth, off)
    tp = off
    if top_p is not None:
        probs = torch.softmax(desc, dim=-1).masked_fill(desc < tk.unsqueeze(1), 0.0)
        cum = probs.cumsum(dim=-1)  # [B, V]
        neg = -desc  # ascending; a tie group's mass is the cum at its last position
        last = torch.searchsorted(neg, neg, right=True) - 1  # [B, V]
        mass_ge = cum.gather(1, last)  # [B, V] mass of l >= desc[:, j]
        enough = mass_ge >= top_p.double().unsqueeze(1) * cum[:, -1:]
        first = enough.int().argmax(dim=-1)  # mass_ge grows with j: the first True
        tp = torch.where(top_p < 1, desc.gather(1, first.unsqueeze(1)).squeeze(1), off)
    return torch.maximum(tk, tp).float()
