"""A KDA layer's whole one-token decode after its input projection, in one launch:
causal conv update -> f_b / g_b up-projections -> gate activation -> l2norm(q, k), sigmoid(beta)
-> gated delta rule on the state slot -> gated RMS norm. The output feeds o_proj directly.

For decode rows only (each row one token continuing its state). Twin:
`kda_decode_fused_reference` below (composes kernels/reference.py, fp32).

Layouts (the engine's, kdaserve/attention/caches.py):
    proj          [N, 3P + 2d + H]   q | k | v (3P, P = H * d) | f_a (d) | g_a (d) | beta logits (H)
    conv_weight   [3P, W]            the depthwise conv taps (conv1d.weight[:, 0])
    conv_cache    [slots, 3P, W-1]   per slot, the last W-1 pre-conv inputs (oldest first)
    rec_cache     [slots, H, d, d]   fp32 [K, V] states
    fg_b_weight   [2, P, d]          f_b_proj.weight | g_b_proj.weight
Kimi K3 (full_rank_gate): proj [N, 4P + d + H] = q | k | v | g (the full-rank output gate, P) |
f_a (d) | beta logits (H), fg_b_weight [1, P, d] = f_b_proj.weight; with lower_bound the
bounded decay of kernels/reference.py kda_gate.
"""

from __future__ import annotations

import torch

from kdaserve.kernels import reference as ref
from kdaserve.kernels.utils import (check_device, check_kernel_device, next_power_of_2,
                                    num_sms, pdl_options, require_triton)

DTYPES = (torch.bfloat16, torch.float16, torch.float32)
MAX_HEAD_DIM = 128
"""A program holds a head's [d, d] f_b tile and up to [d, d] of its fp32 state in registers."""


def default_num_warps(head_dim: int, gates_in: bool = False) -> int:
    """8 warps at d = 128 (64 f_b values per thread); fewer for small heads. With the gates
    computed beforehand (no f_b tile to hold), 4 at d = 128. Both measured fastest at 4-64
    rows in bench_batch.py (PERF_NOTES.md)."""
    warps = max(1, min(8, head_dim * head_dim // 2048))
    return min(warps, 4) if gates_in else warps


def default_v_block(num_rows: int, num_heads: int, head_dim: int, num_sms: int,
                    gates_in: bool = False) -> int:
    """Value columns per program: 32 (or head_dim, if smaller) while the grid stays within ~2
    programs per SM, else 64 (or head_dim). At 32 heads of 128 on 132 SMs: 32 at 1-2 rows,
    64 from 3: at 16-64 rows 64 columns beat one program per head (bench_batch.py,
    benchmarks/PERF_NOTES.md). With the gates computed beforehand (and the head finished by
    the norm launch), 64 as well: the fastest at 16-64 rows in bench_batch.py."""
    bv = min(32, head_dim)
    if gates_in or num_rows * num_heads * (head_dim // bv) > 2 * num_sms:
        bv = min(64, head_dim)
    return bv


def _check_gate(lower_bound: float | None, num_heads: int, head_dim: int) -> None:
    if lower_bound is not None and not -5.0 <= lower_bound < 0.0:
        raise ValueError(f"lower_bound must be None or in [-5, 0), got {lower_bound}")
    if num_heads < 1:
        raise ValueError(f"num_heads must be >= 1, got {num_heads}")
    if head_dim < 8 or head_dim > MAX_HEAD_DIM or head_dim & (head_dim - 1):
        raise ValueError(f"head_dim must be a power of two in [8, {MAX_HEAD_DIM}], "
                         f"got {head_dim}")


def _check_shape(name: str, t: torch.Tensor, shape: tuple) -> None:
    if tuple(t.shape) != shape:
        raise ValueError(f"{name} must be {list(shape)}, got {list(t.shape)}")


def _check_inputs(proj, conv_weight, conv_cache, rec_cache, state_indices, fg_b_weight, A_log,
                  dt_bias, o_norm_weight, num_heads, head_dim, out,
                  full_rank_gate: bool = False) -> int:
    """Every shape, dtype, layout and device; returns the conv width W."""
    H, d = num_heads, head_dim
    P = H * d
    if full_rank_gate:
        width, what = 4 * P + d + H, "4P + d + H"
    else:
        width, what = 3 * P + 2 * d + H, "3P + 2d + H"
    if proj.dim() != 2 or proj.shape[1] != width:
        raise ValueError(f"proj must be [N, {what} = {width}] (H={H}, d={d}), "
                         f"got {list(proj.shape)}")
    if proj.stride(1) != 1:
        raise ValueError(f"proj must have a contiguous last dim, got strides {proj.stride()}")
    if proj.dtype not in DTYPES:
        raise ValueError(f"proj dtype {proj.dtype} not in {DTYPES}")
    N = proj.shape[0]
    if conv_weight.dim() != 2 or conv_weight.shape[0] != 3 * P or conv_weight.shape[1] < 2:
        raise ValueError(f"conv_weight must be [3P = {3 * P}, W >= 2], "
                         f"got {list(conv_weight.shape)}")
    W = conv_weight.shape[1]
    if conv_cache.dim() != 3:
        raise ValueError(f"conv_cache must be [slots, 3P, W-1], got {list(conv_cache.shape)}")
    _check_shape("conv_cache", conv_cache, (conv_cache.shape[0], 3 * P, W - 1))
    if rec_cache.dim() != 4 or rec_cache.shape[1] != H:
        raise ValueError(f"rec_cache must be [slots, H={H}, K, V], got {list(rec_cache.shape)}")
    if rec_cache.shape[2] != rec_cache.shape[3]:
        raise ValueError(f"rec_cache K={rec_cache.shape[2]} != V={rec_cache.shape[3]}: the "
                         f"fused decode needs K == V == head_dim")
    _check_shape("rec_cache", rec_cache, (rec_cache.shape[0], H, d, d))
    if rec_cache.dtype != torch.float32:
        raise ValueError(f"rec_cache must be fp32, got {rec_cache.dtype}")
    _check_shape("state_indices", state_indices, (N,))
    if state_indices.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"state_indices must be int32 or int64, got {state_indices.dtype}")
    _check_shape("fg_b_weight", fg_b_weight, (1 if full_rank_gate else 2, P, d))
    if fg_b_weight.stride(2) != 1:
        raise ValueError(f"fg_b_weight must have a contiguous last dim, "
                         f"got strides {fg_b_weight.stride()}")
    if A_log.numel() != H:
        raise ValueError(f"A_log must have H={H} elements, got {list(A_log.shape)}")
    if dt_bias.numel() != P:
        raise ValueError(f"dt_bias must have P={P} elements, got {list(dt_bias.shape)}")
    _check_shape("o_norm_weight", o_norm_weight, (d,))
    if out is not None:
        _check_shape("out", out, (N, P))
        if out.dtype != proj.dtype or out.stride(1) != 1:
            raise ValueError(f"out must be {proj.dtype} with a contiguous last dim, got "
                             f"{out.dtype} strides {out.stride()}")
    for name, t in (("conv_weight", conv_weight), ("conv_cache", conv_cache),
                    ("rec_cache", rec_cache), ("state_indices", state_indices),
                    ("fg_b_weight", fg_b_weight), ("A_log", A_log), ("dt_bias", dt_bias),
                    ("o_norm_weight", o_norm_weight), ("out", out)):
        if t is not None:
            check_device(name, t, proj.device)
    return W


def kda_decode_fused(proj: torch.Tensor, conv_weight: torch.Tensor, conv_cache: torch.Tensor,
                     rec_cache: torch.Tensor, state_indices: torch.Tensor,
                     fg_b_weight: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor,
                     o_norm_weight: torch.Tensor, eps: float, num_heads: int, head_dim: int,
                     lower_bound: float | None = None, out: torch.Tensor | None = None,
                     pdl: bool = False, num_warps: int | None = None,
                     tickets: torch.Tensor | None = None,
                     v_block: int | None = None, prefetch_state: bool = False,
                     full_rank_gate: bool = False,
                     gates: tuple[torch.Tensor, torch.Tensor | None] | None = None
                     ) -> torch.Tensor:
    """One decode token per row through a KDA layer, from its input projection to o_proj's
    input. Layouts in the module docstring; proj: bf16 / fp16 / fp32, last dim contiguous (rows
    may be strided); state_indices: [N] int32 / int64, distinct among rows >= 0.

    Returns o [N, P] in proj.dtype (or `out`, an [N, P] buffer with a contiguous last dim): the
    gated-normed attention output. conv_cache and rec_cache are updated in place at
    state_indices as the unfused path (causal_conv1d_update + fla's fused_recurrent_kda)
    updates them: the same windows bit for bit; the states up to rounding, since q, k, v, the
    gates and the delta rule stay in fp32 here (the unfused path rounds q/k/v, the f_b / g_b
    outputs and o to proj.dtype between its kernels). A row with a state index < 0 computes
    from a zero window and state and writes neither. Rows sharing a slot (CUDA-graph padding
    rows on the scratch slot) race on it, as in the unfused path: their outputs and that
    slot's contents are unspecified.

    A_log: H elements (any shape); dt_bias: P elements; o_norm_weight: [d]; lower_bound: None
    or in [-5, 0) (Kimi K3's bounded decay); full_rank_gate: Kimi K3's layouts (module
    docstring: the output gate read from proj, f_b alone in fg_b_weight). head_dim: a power
    of two in [8, 128]. num_warps: default 8 at head_dim 128 (default_num_warps; 16 also fits,
    unmeasured).
    pdl: programmatic dependent launch (sm_90+; ignored on CPU tensors): only weights are read
    before griddepcontrol.wait, so the previous kernel must not write them; same results as
    pdl=False. CUDA-graph safe: grid (N, H, d // v_block), and (N, H) for the norm launch,
    from shapes, no host syncs.
    tickets: int32, >= N * H elements, all zero (the kernel leaves them zero): the per-head
    counters that elect the program finishing a head without gates (kernel docstring). Owned
    by the caller, one buffer per launch that may run concurrently with another; None
    allocates a zeroed one.
    v_block: value columns per program, a power of two dividing head_dim (default_v_block).
    prefetch_state (with pdl): state_indices and both caches are also read before the wait, so
    the previous kernel must not write them either (in the layer it is the input projection).
    gates: (g_raw [N, P], gate [N, P] or None under full_rank_gate), f_b f_a and g_b g_a
    computed beforehand (gate_projections): the kernel reads them instead of multiplying
    fg_b_weight's tiles (fg_b_weight is still checked, not read). Any float dtype, last dim
    contiguous. With gates, a head split over several programs is finished (its RMS norm, the
    shift of its q / k windows) by a second launch (kda_decode_norm_kernel, PDL with pdl)
    instead of its last program's ticket: the programs end at their stores, no atomic round
    trip (faster at 16-64 rows in bench_batch.py, benchmarks/PERF_NOTES.md); tickets go unused.
    """
    _check_gate(lower_bound, num_heads, head_dim)
    W = _check_inputs(proj, conv_weight, conv_cache, rec_cache, state_indices, fg_b_weight,
                      A_log, dt_bias, o_norm_weight, num_heads, head_dim, out, full_rank_gate)
    if num_warps is not None and (num_warps < 1 or num_warps > 16 or num_warps & (num_warps - 1)):
        raise ValueError(f"num_warps must be a power of two in [1, 16], got {num_warps}")
    check_kernel_device(proj)
    N, P = proj.shape[0], num_heads * head_dim
    bv = v_block or default_v_block(N, num_heads, head_dim, num_sms(proj.device),
                                    gates is not None)
    warps = default_num_warps(head_dim, gates is not None) if num_warps is None else num_warps
    if bv < 1 or head_dim % bv or bv & (bv - 1):
        raise ValueError(f"v_block must be a power of two dividing head_dim={head_dim}, "
                         f"got {v_block}")
    splits = head_dim // bv
    norm_launch = gates is not None and splits > 1
    if tickets is None:   # drawn only by split heads without gates
        tickets = torch.zeros(N * num_heads if splits > 1 and gates is None else 1,
                              dtype=torch.int32, device=proj.device)
    elif tickets.dtype != torch.int32 or tickets.numel() < N * num_heads:
        raise ValueError(f"tickets must be int32 with >= N * H = {N * num_heads} elements, got "
                         f"{tickets.dtype} {list(tickets.shape)}")
    check_device("tickets", tickets, proj.device)
    if out is None:
        out = torch.empty(N, P, dtype=proj.dtype, device=proj.device)
    if N == 0:
        return out
    require_triton()
    from kdaserve.kernels.kda.triton_decode_fused import kda_decode_fused_kernel

    g_raw, gate = _check_gates(gates, N, P, full_rank_gate, proj.device)
    # the split programs' scratch (kernel docstring); unread with one program a head
    scratch = (N, num_heads) if splits > 1 else (1, 1)
    o_part = torch.empty(*scratch, head_dim, dtype=torch.float32, device=proj.device)
    ss_part = torch.empty(*scratch, splits, dtype=torch.float32, device=proj.device)
    pdl_opts = pdl_options(pdl, proj)
    kda_decode_fused_kernel[(N, num_heads, splits)](
        proj, conv_weight, conv_cache, rec_cache, state_indices, fg_b_weight,
        A_log.reshape(-1), dt_bias.reshape(-1), o_norm_weight, out, o_part, ss_part, tickets,
        g_raw if g_raw is not None else proj, gate if gate is not None else proj,
        P, float(eps), head_dim ** -0.5,
        proj.stride(0), out.stride(0), conv_weight.stride(0), conv_weight.stride(1),
        conv_cache.stride(0), conv_cache.stride(1), conv_cache.stride(2),
        rec_cache.stride(0), rec_cache.stride(1), rec_cache.stride(2), rec_cache.stride(3),
        fg_b_weight.stride(0), fg_b_weight.stride(1),
        g_raw.stride(0) if g_raw is not None else 0, gate.stride(0) if gate is not None else 0,
        D=head_dim, W=W, BW=next_power_of_2(W - 1), BV=bv, num_warps=warps,
        PREFETCH_STATE=bool(prefetch_state), FULL_RANK_GATE=bool(full_rank_gate),
        LOWER_BOUND=float(lower_bound or 0.0), GATES_IN=g_raw is not None, **pdl_opts)
    if norm_launch:
        from kdaserve.kernels.kda.triton_decode_fused import kda_decode_norm_kernel

        kda_decode_norm_kernel[(N, num_heads)](
            proj, conv_cache, state_indices, o_part, ss_part, out, P, float(eps),
            proj.stride(0), out.stride(0), conv_cache.stride(0), conv_cache.stride(1),
            conv_cache.stride(2), D=head_dim, W=W, BW=next_power_of_2(W - 1), SPLITS=splits,
            num_warps=4, **pdl_opts)
    return out


def gate_projections(proj: torch.Tensor, fg_b_weight: torch.Tensor, num_heads: int,
                     head_dim: int, full_rank_gate: bool = False
                     ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """kda_decode_fused's `gates` for every row in one GEMM: (f_a @ f_b.T, g_a @ g_b.T) as
    [N, P] each in proj.dtype (under full_rank_gate, (f_a @ f_b.T, None): the output gate is in
    proj). The unfused path rounds these products to proj.dtype too."""
    H, d = num_heads, head_dim
    P, N = H * d, proj.shape[0]
    if full_rank_gate:
        return proj[:, 4 * P:4 * P + d] @ fg_b_weight[0].T, None
    f_g = torch.bmm(proj[:, 3 * P:3 * P + 2 * d].view(N, 2, d).transpose(0, 1),
                    fg_b_weight.transpose(1, 2))                       # [2, N, P]
    return f_g[0], f_g[1]


def _check_gates(gates, N: int, P: int, full_rank_gate: bool, device: torch.device):
    """(g_raw, gate) of kda_decode_fused's `gates` after checks; (None, None) without them."""
    if gates is None:
        return None, None
    g_raw, gate = gates
    if gate is None and not full_rank_gate:
        raise ValueError("gates needs the output gate [N, P] unless full_rank_gate is set")
    for name, t in (("gates[0]", g_raw), ("gates[1]", gate)):
        if t is None:
            continue
        _check_shape(name, t, (N, P))
        if t.stride(1) != 1 or t.dtype not in DTYPES:
            raise ValueError(f"{name} must be a float tensor with a contiguous last dim, got "
                             f"{t.dtype} strides {t.stride()}")
        check_device(name, t, device)
    return g_raw, None if full_rank_gate else gate


def kda_decode_fused_reference(proj: torch.Tensor, conv_weight: torch.Tensor,
                               conv_cache: torch.Tensor, rec_cache: torch.Tensor,
                               state_indices: torch.Tensor, fg_b_weight: torch.Tensor,
                               A_log: torch.Tensor, dt_bias: torch.Tensor,
                               o_norm_weight: torch.Tensor, eps: float, num_heads: int,
                               head_dim: int, lower_bound: float | None = None,
                               full_rank_gate: bool = False,
                               gates: tuple[torch.Tensor, torch.Tensor | None] | None = None
                               ) -> torch.Tensor:
    """The same contract from kernels/reference.py, everything in fp32 (caches updated in
    place, output in proj.dtype): conv update -> kda_gate -> kda_recurrent -> rms_norm_gated.
    gates: as kda_decode_fused's (used instead of the fp32 f_b / g_b products)."""
    _check_gate(lower_bound, num_heads, head_dim)
    _check_inputs(proj, conv_weight, conv_cache, rec_cache, state_indices, fg_b_weight, A_log,
                  dt_bias, o_norm_weight, num_heads, head_dim, None, full_rank_gate)
    H, d = num_heads, head_dim
    P, N = H * d, proj.shape[0]
    x = proj.float()                                 # [N, 3P + 2d + H] or [N, 4P + d + H]
    qkv = ref.causal_conv1d_update(x[:, :3 * P], conv_weight.float(), conv_cache,
                                   state_indices)                      # [N, 3P]
    q, k, v = qkv.view(N, 3, H, d).unbind(1)                           # [N, H, d] each
    if full_rank_gate:
        gate = x[:, 3 * P:4 * P]                                       # [N, P]
        g_raw = x[:, 4 * P:4 * P + d] @ fg_b_weight[0].float().T       # [N, P]
        beta = torch.sigmoid(x[:, 4 * P + d:])                         # [N, H]
    else:
        g_raw = x[:, 3 * P:3 * P + d] @ fg_b_weight[0].float().T       # [N, P]
        gate = x[:, 3 * P + d:3 * P + 2 * d] @ fg_b_weight[1].float().T  # [N, P]
        beta = torch.sigmoid(x[:, 3 * P + 2 * d:])                     # [N, H]
    if gates is not None:
        g_raw = gates[0].float()
        gate = gate if full_rank_gate else gates[1].float()
    g = ref.kda_gate(g_raw.view(N, H, d), A_log, dt_bias, lower_bound)  # [N, H, d]
    o = torch.empty(N, H, d, dtype=torch.float32, device=proj.device)
    for i, slot in enumerate(state_indices.tolist()):
        init = rec_cache[slot] if slot >= 0 else None
        o[i:i + 1], state = ref.kda_recurrent(q[i:i + 1], k[i:i + 1], v[i:i + 1], g[i:i + 1],
                                              beta[i:i + 1], init)
        if slot >= 0:
            rec_cache[slot] = state
    o = ref.rms_norm_gated(o.view(N * H, d), gate.reshape(N * H, d), o_norm_weight, eps)
    return o.view(N, P).to(proj.dtype)
