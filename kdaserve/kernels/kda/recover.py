"""KDA state under speculative verification: RecoverSSM (records + commit) and the baseline
per-position mode, for the recurrent state and the short-conv window.

A spec request brings T_i = 1 + K_i tokens (its last sampled token, then its drafts), packed by
cu_seqlens [N+1]; after sampling, num_accepted[i] = accepted drafts + 1 of them are real
(0 <= num_accepted <= T_i; vLLM's num_accepted_tokens).

RecoverSSM (one state slot per request):
    o, records = kda_spec_verify(q, k, v, g, beta, cu, rec_pool, slots)    # pool untouched
    y = conv_spec_verify(x, w, cu, conv_pool, slots)                        # pool untouched
    ... sample ...
    kda_recover_commit(rec_pool, slots, records, cu, num_accepted)
    conv_recover_commit(conv_pool, slots, x, cu, num_accepted)
Per-position (baseline, 1 + K slots per request, state_indices [N, 1+K], column 0 = own slot):
    o, _ = kda_spec_verify(..., idx, per_position=True)      # column t <- state after token t
    y = conv_spec_verify(..., idx, per_position=True)
    ... sample ...
    select_per_position([rec_pool, conv_pool], idx, num_accepted)   # column n-1 -> column 0

Dispatch: CUDA tensors (or use_triton=True with TRITON_INTERPRET=1) run the Triton kernels of
triton_recover.py; CPU tensors run the twins in kernels/reference.py. No host syncs on the
Triton path (CUDA-graph safe).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kdaserve.kernels import reference as ref
from kdaserve.kernels.utils import (
    cdiv,
    check_kernel_device,
    next_power_of_2,
    num_sms,
    require_triton,
)


def _use_triton(t: torch.Tensor, use_triton: bool | None) -> bool:
    return t.is_cuda if use_triton is None else use_triton


def _check_shapes(q, k, v, g, beta, cu_seqlens, state_pool, state_indices, per_position):
    T, H, K = k.shape
    V = v.shape[-1]
    if q.shape != (T, H, K) or g.shape != (T, H, K) or v.shape[:2] != (T, H):
        raise ValueError(f"q/k/g must be [T, H, K] and v [T, H, V]; got q {tuple(q.shape)}, "
                         f"k {tuple(k.shape)}, g {tuple(g.shape)}, v {tuple(v.shape)}")
    if beta.shape != (T, H):
        raise ValueError(f"beta must be [T={T}, H={H}], got {tuple(beta.shape)}")
    if state_pool.dim() != 4 or state_pool.shape[1:] != (H, K, V):
        raise ValueError(f"state_pool must be [slots, H={H}, K={K}, V={V}], "
                         f"got {tuple(state_pool.shape)}")
    N = cu_seqlens.shape[0] - 1
    want = 2 if per_position else 1
    if state_indices.dim() != want or state_indices.shape[0] != N:
        raise ValueError(f"state_indices must be {'[N, 1+K]' if per_position else '[N]'} with "
                         f"N={N}, got {tuple(state_indices.shape)}")
    return T, H, K, V, N


@dataclass
class KDAGateParams:
    """The layer's gate parameters, for activating g and beta inside the verify kernel."""

    A_log: torch.Tensor
    """[H] elements (any shape), fp32."""
    dt_bias: torch.Tensor
    """[H * K] fp32."""
    lower_bound: float | None = None


@dataclass
class KDARecoverRecords:
    """What each window token would add to the state (RecoverSSM), one KDA layer's step."""

    u: torch.Tensor
    """[T, H, V] fp32: beta_t (v_t - S'_t^T k_t), the delta-rule correction."""
    k_hat: torch.Tensor
    """[T, H, K] fp32: l2-normalised keys."""
    g: torch.Tensor
    """[T, H, K] fp32: activated log decay."""

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.u, self.k_hat, self.g))


@dataclass(frozen=True)
class KDAVerifyConfig:
    """kda_spec_verify's launch: block_v state columns per program (grid N x H x V / block_v)
    and num_warps."""
    block_v: int = 32
    num_warps: int = 4


def default_verify_config(num_requests: int, num_heads: int, V: int,
                          device: torch.device) -> KDAVerifyConfig:
    """64 state columns and 2 warps a program once those programs fill the SMs, else 32 columns
    and 4 warps (more programs for few windows). bench_batch.py --cases kda_verify at 32 heads
    of 128, 9-token windows (benchmarks/PERF_NOTES.md): at 16 windows (64, 2) was the fastest
    tile, 1.2x (32, 2) and 1.5x (32, 4); at one window (32, 4) was, 1.2x (64, 2). Shapes only,
    so a captured graph keeps its launch."""
    if num_requests * num_heads * cdiv(V, 64) >= num_sms(device):
        return KDAVerifyConfig(block_v=64, num_warps=2)
    return KDAVerifyConfig(block_v=32, num_warps=4)


def kda_spec_verify(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                    beta: torch.Tensor, cu_seqlens: torch.Tensor, state_pool: torch.Tensor,
                    state_indices: torch.Tensor, initial_cols: torch.Tensor | None = None,
                    per_position: bool = False, scale: float | None = None,
                    use_qk_l2norm: bool = True, gate: KDAGateParams | None = None,
                    out: torch.Tensor | None = None, use_triton: bool | None = None,
                    config: KDAVerifyConfig | None = None
                    ) -> tuple[torch.Tensor, KDARecoverRecords | None]:
    """Outputs of every window token from S_0 = state_pool[state_indices[i, initial_cols[i]]].

    q, k: [T, H, K] (not normalised); v: [T, H, V]; g: [T, H, K] fp32 log decay and beta: [T, H]
    in (0, 1) -- or, with `gate`, the gate pre-activation and the beta logits, activated in the
    kernel; state_pool: [slots, H, K, V] fp32.
    RecoverSSM (per_position=False, state_indices [N]): returns (o [T, H, V] in v.dtype,
    records) and leaves the pool untouched. per_position (state_indices [N, 1+K]): writes the
    state after token t to column t, returns (o, None).
    out: optional [T, H, V] buffer for o (e.g. the spec slice of the layer's output).
    config: the Triton launch (default_verify_config; benchmarks/bench_batch.py --cases
    kda_verify sweeps it).
    """
    T, H, K, V, N = _check_shapes(q, k, v, g, beta, cu_seqlens, state_pool, state_indices,
                                  per_position)
    if not _use_triton(q, use_triton):
        if gate is not None:
            g = ref.kda_gate(g, gate.A_log, gate.dt_bias, gate.lower_bound)
            beta = torch.sigmoid(beta.float())
        o, u, kh = ref.kda_spec_verify(q, k, v, g, beta, cu_seqlens, state_pool,
                                       state_indices, initial_cols, per_position, scale,
                                       use_qk_l2norm)
        if out is not None:
            out.copy_(o)
            o = out
        return o, (None if per_position else KDARecoverRecords(u, kh, g.float()))
    require_triton()
    from kdaserve.kernels.kda.triton_recover import kda_spec_verify_kernel

    for t in (q, k, v, g, beta, cu_seqlens, state_pool, state_indices):
        check_kernel_device(t)
    for name, t in (("q", q), ("k", k), ("v", v), ("g", g)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} needs a contiguous last dim")
    o = torch.empty(T, H, V, dtype=v.dtype, device=v.device) if out is None else out
    record = not per_position
    f32 = {"dtype": torch.float32, "device": v.device}
    u = torch.empty(T, H, V, **f32) if record else o
    kh = torch.empty(T, H, K, **f32) if record else o
    g_rec = torch.empty(T, H, K, **f32) if record and gate is not None else g
    idx = state_indices if per_position else state_indices.view(N, 1)
    a_log = gate.A_log.reshape(-1) if gate is not None else g
    dt_bias = gate.dt_bias if gate is not None else g
    cfg = config or default_verify_config(N, H, V, v.device)
    BV = min(cfg.block_v, next_power_of_2(V))
    if N > 0:
        kda_spec_verify_kernel[(N, H, cdiv(V, BV))](
            q, k, v, g, beta, cu_seqlens, state_pool, idx,
            initial_cols if initial_cols is not None else idx, o, u, kh, g_rec, a_log, dt_bias,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            g.stride(0), g.stride(1), beta.stride(0), beta.stride(1), o.stride(0), o.stride(1),
            u.stride(0), u.stride(1), kh.stride(0), kh.stride(1), g_rec.stride(0),
            g_rec.stride(1), state_pool.stride(0), state_pool.stride(1), state_pool.stride(2),
            state_pool.stride(3), idx.stride(0),
            K ** -0.5 if scale is None else scale,
            0.0 if gate is None or gate.lower_bound is None else gate.lower_bound,
            K=K, V=V, BK=next_power_of_2(K), BV=BV, L2NORM=use_qk_l2norm,
            HAS_COLS=initial_cols is not None, RECORD=record, PER_POSITION=per_position,
            GATE_IN_KERNEL=gate is not None,
            HAS_LOWER_BOUND=gate is not None and gate.lower_bound is not None,
            num_warps=cfg.num_warps,
        )
    if not record:
        return o, None
    return o, KDARecoverRecords(u, kh, g_rec if gate is not None else g.float())


def kda_recover_commit(state_pool: torch.Tensor, state_indices: torch.Tensor,
                       records: KDARecoverRecords, cu_seqlens: torch.Tensor,
                       num_accepted: torch.Tensor, use_triton: bool | None = None) -> None:
    """state_pool[state_indices[i]] <- the state after the first num_accepted[i] window tokens
    (S <- S * exp(g_t) + k_t u_t^T for t < n). The Triton path clamps n to [0, T_i]; the twin
    raises on counts outside it."""
    N = cu_seqlens.shape[0] - 1
    if state_indices.shape != (N,) or num_accepted.shape != (N,):
        raise ValueError(f"state_indices and num_accepted must be [N={N}], got "
                         f"{tuple(state_indices.shape)} and {tuple(num_accepted.shape)}")
    u, k_hat, g = records.u, records.k_hat, records.g
    if not _use_triton(state_pool, use_triton):
        ref.kda_recover_commit(state_pool, state_indices, u, k_hat, g, cu_seqlens, num_accepted)
        return
    require_triton()
    from kdaserve.kernels.kda.triton_recover import kda_recover_commit_kernel

    for t in (state_pool, state_indices, u, k_hat, g, cu_seqlens, num_accepted):
        check_kernel_device(t)
    _, H, K, V = state_pool.shape
    BV = min(32, next_power_of_2(V))
    if N > 0:
        kda_recover_commit_kernel[(N, H, cdiv(V, BV))](
            state_pool, state_indices, u, k_hat, g, cu_seqlens, num_accepted,
            state_pool.stride(0), state_pool.stride(1), state_pool.stride(2),
            state_pool.stride(3), state_indices.stride(0),
            u.stride(0), u.stride(1), k_hat.stride(0), k_hat.stride(1), g.stride(0),
            g.stride(1),
            K=K, V=V, BK=next_power_of_2(K), BV=BV, num_warps=4,
        )


def conv_spec_verify(x: torch.Tensor, weight: torch.Tensor, cu_seqlens: torch.Tensor,
                     conv_pool: torch.Tensor, state_indices: torch.Tensor,
                     initial_cols: torch.Tensor | None = None, per_position: bool = False,
                     activation: str | None = "silu", use_triton: bool | None = None,
                     out: torch.Tensor | None = None, chunk: int = 8) -> torch.Tensor:
    """SiLU(causal conv) of each window from conv_pool[state_indices[i, initial_cols[i]]].
    x: [T, D] pre-conv q|k|v; weight: [D, W]; conv_pool: [slots, D, W-1]. RecoverSSM: the pool
    is read only (keep x: commit needs it). per_position: column t receives the window after
    token t. out (CUDA): where y goes, [T, D] or planes [S, T, D / S] with a contiguous last
    dim (the layer's q, k, v planes: no copy afterwards). chunk: tokens a program's loads
    cover at once (a power of two; 0: one token at a time, the baseline). Returns y ([T, D] in
    x.dtype, or out)."""
    N = cu_seqlens.shape[0] - 1
    if state_indices.dim() != (2 if per_position else 1) or state_indices.shape[0] != N:
        raise ValueError(f"state_indices must be {'[N, 1+K]' if per_position else '[N]'} with "
                         f"N={N}, got {tuple(state_indices.shape)}")
    if not _use_triton(x, use_triton):
        y = ref.conv_spec_verify(x, weight, cu_seqlens, conv_pool, state_indices,
                                 initial_cols, per_position, activation)
        if out is None:
            return y
        dst = out if out.dim() == 2 else out.permute(1, 0, 2)          # [T, S, D / S] view
        dst.copy_(y.view(dst.shape))
        return out
    require_triton()
    from kdaserve.kernels.conv.causal_conv1d import _out_layout
    from kdaserve.kernels.kda.triton_recover import conv_spec_verify_kernel

    for t in (x, weight, cu_seqlens, conv_pool, state_indices):
        check_kernel_device(t)
    if x.stride(-1) != 1:
        raise ValueError("x needs a contiguous last dim")
    T, D = x.shape
    W = weight.shape[-1]
    idx = state_indices.view(N, -1)
    y, stride_yt, stride_ysplit, split = _out_layout(out, x)
    if T > 0 and N > 0:
        block_d = min(256, next_power_of_2(D))
        conv_spec_verify_kernel[(N, cdiv(D, block_d))](
            x, weight, y, conv_pool, idx, initial_cols if initial_cols is not None else idx,
            cu_seqlens, D,
            x.stride(0), stride_yt, weight.stride(0), weight.stride(1),
            conv_pool.stride(0), conv_pool.stride(1), conv_pool.stride(2), idx.stride(0),
            stride_ysplit,
            W=W, BW=next_power_of_2(W - 1), BD=block_d, HAS_COLS=initial_cols is not None,
            SILU=activation == "silu", CHUNK=chunk, SPLIT=split, num_warps=4,
        )
        if per_position:
            _conv_window(conv_pool, idx, initial_cols, x, cu_seqlens, None)
    return y


def conv_recover_commit(conv_pool: torch.Tensor, state_indices: torch.Tensor, x: torch.Tensor,
                        cu_seqlens: torch.Tensor, num_accepted: torch.Tensor,
                        use_triton: bool | None = None) -> None:
    """conv_pool[state_indices[i]] <- its window after the first num_accepted[i] tokens of the
    step's pre-conv inputs x [T, D]."""
    if not _use_triton(x, use_triton):
        ref.conv_recover_commit(conv_pool, state_indices, x, cu_seqlens, num_accepted)
        return
    require_triton()
    for t in (conv_pool, state_indices, x, cu_seqlens, num_accepted):
        check_kernel_device(t)
    _conv_window(conv_pool, state_indices.view(-1, 1), None, x, cu_seqlens, num_accepted)


def _conv_window(conv_pool, idx, initial_cols, x, cu_seqlens, num_accepted) -> None:
    from kdaserve.kernels.kda.triton_recover import conv_spec_window_kernel

    N = idx.shape[0]
    D, W1 = conv_pool.shape[1], conv_pool.shape[2]
    if N == 0:
        return
    block_d = min(256, next_power_of_2(D))
    conv_spec_window_kernel[(N, cdiv(D, block_d))](
        conv_pool, idx, initial_cols if initial_cols is not None else idx, x, cu_seqlens,
        num_accepted if num_accepted is not None else cu_seqlens, D,
        conv_pool.stride(0), conv_pool.stride(1), conv_pool.stride(2), idx.stride(0),
        x.stride(0),
        W1=W1, BW=next_power_of_2(W1), BD=block_d, HAS_COLS=initial_cols is not None,
        PER_POSITION=num_accepted is None, num_warps=4,
    )


def select_per_position(pools: list[torch.Tensor], state_indices: torch.Tensor,
                        num_accepted: torch.Tensor) -> None:
    """Per-position mode after sampling: column num_accepted[i] - 1 -> column 0 in every pool.
    On CUDA no validation sync: counts are clamped to [1, 1+K]."""
    if state_indices.dim() != 2 or num_accepted.shape != state_indices.shape[:1]:
        raise ValueError(f"state_indices must be [N, 1+K] and num_accepted [N], got "
                         f"{tuple(state_indices.shape)} and {tuple(num_accepted.shape)}")
    if not state_indices.is_cuda:
        ref.select_per_position(pools, state_indices, num_accepted)
        return
    idx = state_indices.long()
    n = num_accepted.long().clamp(1, idx.shape[1])
    src = idx.gather(1, (n - 1)[:, None]).squeeze(1)
    dst = idx[:, 0]
    for pool in pools:
        pool.index_copy_(0, dst, pool.index_select(0, src))


# ---------------------------------------------------------------------------------------------
# Memory per request
# ---------------------------------------------------------------------------------------------


@dataclass
class SpecStateMemory:
    """Bytes one running request needs for its KDA state, over all KDA layers."""

    state_bytes: int
    """Resident slots: recurrent fp32 [H, K, V] + conv window [3*H*K, W-1] per slot."""
    record_bytes: int
    """Per-step RecoverSSM records (u, k_hat, g fp32 + pre-conv x), 0 for per-position."""

    @property
    def total(self) -> int:
        return self.state_bytes + self.record_bytes


def _slot_bytes(num_heads: int, head_k_dim: int, head_v_dim: int, conv_dim: int,
                conv_kernel: int, conv_dtype_bytes: int) -> int:
    """One KDA layer's slot: recurrent fp32 [H, K, V] + conv window [conv_dim, W-1]."""
    return num_heads * head_k_dim * head_v_dim * 4 + conv_dim * (conv_kernel - 1) * conv_dtype_bytes


def _record_bytes_per_token(num_heads: int, head_k_dim: int, head_v_dim: int, conv_dim: int,
                            conv_dtype_bytes: int) -> int:
    """One KDA layer's RecoverSSM record of one window token: u fp32 [H, V], k_hat and g fp32
    [H, K], pre-conv x [conv_dim]."""
    return (num_heads * head_v_dim * 4 + 2 * num_heads * head_k_dim * 4
            + conv_dim * conv_dtype_bytes)


def spec_state_memory(mode: str, num_kda_layers: int, num_heads: int, head_k_dim: int,
                      head_v_dim: int, conv_dim: int, conv_kernel: int,
                      num_speculative_tokens: int, conv_dtype_bytes: int = 2) -> SpecStateMemory:
    """mode: "per_position" (1 + K slots) or "recover" (1 slot + records of 1 + K tokens)."""
    _check_mode(mode)
    slot = _slot_bytes(num_heads, head_k_dim, head_v_dim, conv_dim, conv_kernel, conv_dtype_bytes)
    T = 1 + num_speculative_tokens
    if mode == "per_position":
        return SpecStateMemory(num_kda_layers * T * slot, 0)
    rec = T * _record_bytes_per_token(num_heads, head_k_dim, head_v_dim, conv_dim,
                                      conv_dtype_bytes)
    return SpecStateMemory(num_kda_layers * slot, num_kda_layers * rec)


def spec_state_bytes_written(mode: str, num_kda_layers: int, num_heads: int, head_k_dim: int,
                             head_v_dim: int, conv_dim: int, conv_kernel: int,
                             window: int, num_accepted: int, conv_dtype_bytes: int = 2) -> int:
    """KDA state bytes one spec row writes in one verify step + commit (all KDA layers), by
    what the kernels store: window = 1 + K_i verified tokens, num_accepted = tokens emitted.
    per_position: a full state per window token, then the accepted column copied into column 0
    (none when only the first token is accepted). recover: a record per window token, then one
    state written by the commit."""
    _check_mode(mode)
    if window < 1 or not 1 <= num_accepted <= window:
        raise ValueError(f"need window >= 1 and 1 <= num_accepted <= window, got window="
                         f"{window}, num_accepted={num_accepted}")
    slot = _slot_bytes(num_heads, head_k_dim, head_v_dim, conv_dim, conv_kernel, conv_dtype_bytes)
    if mode == "per_position":
        per_layer = window * slot + (slot if num_accepted > 1 else 0)
    else:
        per_layer = window * _record_bytes_per_token(num_heads, head_k_dim, head_v_dim,
                                                     conv_dim, conv_dtype_bytes) + slot
    return num_kda_layers * per_layer


def _check_mode(mode: str) -> None:
    if mode not in ("per_position", "recover"):
        raise ValueError(f"mode must be 'per_position' or 'recover', got {mode!r}")
