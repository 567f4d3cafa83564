"""KDA over a flattened batch: short conv + gated delta rule, with per-request state slots.

Two paths behind one contract. CPU: the plain-PyTorch twins of kernels/reference.py, one request
at a time. CUDA: decodes (the first num_decodes requests, one token each) go through fla-core's
fused recurrent kernel updating the state pool in place; prefill chunks go through fla-core's
chunk_kda with cu_seqlens, states gathered from and scattered back to their slots.
"""

from __future__ import annotations

import torch

from kdaserve.attention import kda_checkpoint, kda_spec
from kdaserve.attention.metadata import STATE_INDEX_COLUMNS, AttentionMetadata
from kdaserve.kernels import reference as ref


def _spans(md: AttentionMetadata):
    qsl = md.query_start_loc_cpu.tolist()
    for i in range(md.num_reqs):
        yield i, qsl[i], qsl[i + 1]


# ---------------------------------------------------------------------------------------------
# Short convolution
# ---------------------------------------------------------------------------------------------


def short_conv(x: torch.Tensor, weight: torch.Tensor, md: AttentionMetadata,
               conv_cache: torch.Tensor, num_heads: int, head_dim: int, pdl: bool = False):
    """x: [T, 3P] projections (q|k|v channels); weight: [3P, W]; conv_cache: [slots, 3P, W-1].
    Returns SiLU(causal depthwise conv) as q, k, v [T, H, K] views; each request's window is
    updated in its slot. On CUDA the kernels write three contiguous planes, so q, k, v feed the
    KDA kernels without copies. With md.spec, the spec rows are verified (kda_spec)."""
    T = x.shape[0]
    out = x.new_empty(3, T, x.shape[1] // 3) if x.is_cuda else torch.empty_like(x)
    if md.spec is not None:
        kda_spec.short_conv(x, weight, md.spec, conv_cache, out, _short_conv_into)
    else:
        _short_conv_into(x, weight, md, conv_cache, out, pdl)
    if x.is_cuda:
        return tuple(plane.view(T, num_heads, head_dim) for plane in out)
    return out.view(T, 3, num_heads, head_dim).unbind(1)


def _short_conv_into(x: torch.Tensor, weight: torch.Tensor, md: AttentionMetadata,
                     conv_cache: torch.Tensor, out: torch.Tensor, pdl: bool = False) -> None:
    """out: [3, T, P] planes on CUDA, [T, 3P] on the CPU. pdl: launch the CUDA kernels with
    programmatic dependent launch."""
    kda_checkpoint.export_conv_windows(x, md, conv_cache)  # prefix checkpoints (no-op if none)
    if x.is_cuda:
        from kdaserve.kernels.conv.causal_conv1d import causal_conv1d_update, causal_conv1d_varlen

        nd = md.num_decodes
        if nd:
            causal_conv1d_update(x[:nd], weight, conv_cache, md.state_indices[:nd],
                                 out=out[:, :nd], pdl=pdl)
        if md.num_prefills:
            qsl = md.query_start_loc[nd:] - md.query_start_loc[nd]
            t0 = int(md.query_start_loc_cpu[nd])
            t1 = md.num_actual_tokens
            causal_conv1d_varlen(x[t0:t1], weight, qsl, conv_cache, md.state_indices[nd:],
                                 md.has_initial_state[nd:], out=out[:, t0:t1], pdl=pdl)
        return
    state_ids = md.state_indices.tolist()
    has_init = md.has_initial_state.tolist()
    for i, s, e in _spans(md):
        slot = state_ids[i]
        init = conv_cache[slot] if has_init[i] else None
        out[s:e], new_state = ref.causal_conv1d(x[s:e], weight, init)
        conv_cache[slot].copy_(new_state)


# ---------------------------------------------------------------------------------------------
# Gated delta rule
# ---------------------------------------------------------------------------------------------


def delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g_raw: torch.Tensor,
               beta_logits: torch.Tensor, gate, md: AttentionMetadata,
               rec_cache: torch.Tensor) -> torch.Tensor:
    """q, k: [T, H, K] (not normalised); v: [T, H, V]; g_raw: [T, H, K] gate pre-activation;
    beta_logits: [T, H]; gate: the layer's ForgetGate (A_log, dt_bias, lower_bound, activate());
    rec_cache: [slots, H, K, V] fp32. Returns o [T, H, V]; final states go to the slots.

    The CUDA path activates gate and beta inside the fla kernels (one pass fewer over [T, H, K]).
    With md.spec, the spec rows are verified (kda_spec)."""
    o = torch.empty_like(v)
    if md.spec is not None:
        kda_spec.delta_rule(q, k, v, g_raw, beta_logits, gate, md.spec, rec_cache, o,
                            _delta_rule_into)
    else:
        _delta_rule_into(q, k, v, g_raw, beta_logits, gate, md, rec_cache, o)
    return o


def _delta_rule_into(q, k, v, g_raw, beta_logits, gate, md: AttentionMetadata, rec_cache,
                     o: torch.Tensor) -> None:
    if q.is_cuda:
        _delta_rule_cuda(q, k, v, g_raw, beta_logits, gate, md, rec_cache, o)
        return
    g = gate.activate(g_raw)                                          # [T, H, K] fp32
    beta = torch.sigmoid(beta_logits.float())                         # [T, H]
    state_ids = md.state_indices.tolist()
    has_init = md.has_initial_state.tolist()
    exports = kda_checkpoint.exports_by_request(md)
    for i, s, e in _spans(md):
        slot = state_ids[i]
        init = rec_cache[slot] if has_init[i] else None
        if i in exports:
            o[s:e], state = kda_checkpoint.chunk_exporting(
                q[s:e], k[s:e], v[s:e], g[s:e], beta[s:e], init, exports[i], rec_cache)
            rec_cache[slot].copy_(state)
            continue
        fn = ref.kda_recurrent if (e - s == 1 and init is not None) else ref.kda_chunk
        o[s:e], state = fn(q[s:e], k[s:e], v[s:e], g[s:e], beta[s:e], init)
        rec_cache[slot].copy_(state)


SHORT_PREFILL_MAX = STATE_INDEX_COLUMNS
"""Rows of at most this many tokens that continue a state (a draft model's catch-up over the
accepted tokens, a chunked prefill's short tail) run token by token in fla's fused recurrent
kernel: one launch, where chunk_kda takes about ten and autotunes per shape (through
chunk_kda the draft catch-up was half of a speculative step's time)."""


def _all_short_with_state(md: AttentionMetadata) -> bool:
    """Host-side test: every row is at most SHORT_PREFILL_MAX tokens and continues a state."""
    return md.max_query_len <= SHORT_PREFILL_MAX and md.all_continue_state


def _fla_rows(x: torch.Tensor, a: int, b: int) -> torch.Tensor:
    """x[a:b] as a contiguous [1, b - a, ...] input of fla's kernels: the view when it is
    contiguous and 16-byte aligned, else a copy. Triton specialises on pointer alignment, and a
    view's follows a: beta [T, H], a column slice of the input projection, is a contiguous view
    when b - a == 1, aligned only at some a where the projection's row is not a multiple of 16
    bytes. The pointer test is host-side: no sync, CUDA-graph safe."""
    y = x[None, a:b]
    if y.is_contiguous() and y.data_ptr() % 16 == 0:
        return y
    return y.clone(memory_format=torch.contiguous_format)


def _short_rows_recurrent(q, k, v, g, beta, in_kernel: dict, md: AttentionMetadata,
                          rec_cache: torch.Tensor, o: torch.Tensor) -> None:
    """Every row (decodes and short prefills alike) in one fused recurrent launch. The kernel's
    continuous-batching mode reads row i's state from ssm_state_indices[i, 0] and writes the
    state after its token t to ssm_state_indices[i, t]: all columns hold the row's own slot, so
    the slot ends with the state after the row's last token."""
    from fla.ops.kda.fused_recurrent import fused_recurrent_kda_fwd

    n, t = md.num_reqs, md.num_actual_tokens
    fused_recurrent_kda_fwd(
        *(_fla_rows(x, 0, t) for x in (q, k, v, g, beta)), out=o[None, :t],
        initial_state=rec_cache, inplace_final_state=True,
        cu_seqlens=md.query_start_loc[:n + 1], ssm_state_indices=md.state_indices_per_token,
        use_qk_l2norm_in_kernel=True, **in_kernel)


def _delta_rule_cuda(q, k, v, g, beta, gate, md: AttentionMetadata, rec_cache, o):
    from fla.ops.kda import chunk_kda
    from fla.ops.kda.fused_recurrent import fused_recurrent_kda_fwd

    if gate.lower_bound is None:
        in_kernel = dict(use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True,
                         A_log=gate.A_log.view(-1), dt_bias=gate.dt_bias)
    else:   # bounded gate variant (K3-style): activate here
        g, beta = gate.activate_with_beta(g, beta)
        in_kernel = {}
    if md.num_prefills and md.kda_checkpoints is None and _all_short_with_state(md):
        _short_rows_recurrent(q, k, v, g, beta, in_kernel, md, rec_cache, o)
        return
    nd = md.num_decodes
    if nd:
        # [1, nd, H, *]: one token per sequence; the kernel reads and writes the pool in place.
        fused_recurrent_kda_fwd(
            *(_fla_rows(x, 0, nd) for x in (q, k, v, g, beta)), out=o[None, :nd],
            initial_state=rec_cache, inplace_final_state=True,
            # int32 as they are: the kernel widens each loaded index itself (two launches
            # fewer per layer than .long())
            cu_seqlens=md.query_start_loc[:nd + 1],
            ssm_state_indices=md.state_indices[:nd],
            use_qk_l2norm_in_kernel=True, **in_kernel)
    if md.num_prefills:
        t0 = int(md.query_start_loc_cpu[nd])
        t1 = md.num_actual_tokens
        slots = md.state_indices[nd:].long()
        init = rec_cache[slots] * md.has_initial_state[nd:, None, None, None]
        cu, cu_cpu = md.prefill_cu_seqlens
        run = (chunk_kda if md.kda_checkpoints is None
               else kda_checkpoint.exporting(chunk_kda, md, rec_cache))
        op, final = run(
            *(_fla_rows(x, t0, t1) for x in (q, k, v, g, beta)),
            initial_state=init, output_final_state=True, use_qk_l2norm_in_kernel=True,
            **in_kernel, cu_seqlens=cu, cu_seqlens_cpu=cu_cpu)
        o[t0:t1] = op[0]
        rec_cache.index_copy_(0, slots, final)
