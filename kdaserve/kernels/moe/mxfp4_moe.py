"""MXFP4 routed experts for a latent MoE, with the top-k weighted sum fused into the latent tail.

    partials = moe_partials(latent, w13, w2, topk_ids, w13_scale, w2_scale)   [N * k, L]
    out      = latent_moe_tail(partials, topk_weights, topk_ids, up_weight,
                               norm_weight, eps, residual)                     [N, H]

The expert weights stay in the MXFP4 layout of kernels/mxfp4/format.py in memory (values
uint8 [E, N, K / 2], E8M0 scales uint8 [E, N, K / 32]); the GEMMs read FP4 + scales and decode
in registers. The experts return their unweighted outputs per routing entry (vLLM's
"unfinalized" MoE output); the tail kernel forms the weighted top-k sum chunk by chunk while it
runs the up projection, so there is no finalize launch and the finalized [N, L] latent is never
written or re-read. Without scales the same kernels read dense (bf16) expert weights: the
baseline of the same layer. Twins: kernels/reference.py moe_partials_mxfp4 (moe_partials for
dense weights) and latent_moe_tail.

No host sync and buffers sized from shapes only: capturable in a CUDA graph. pdl: every launch
with programmatic dependent launch (inputs are all produced by the previous kernels).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace

import torch

from kdaserve.kernels.configs import device_name, load_configs, shape_key
from kdaserve.kernels.utils import (cdiv, check_kernel_device, next_power_of_2, num_sms,
                                    pdl_options, require_triton, triton_interpret)


@dataclass(frozen=True)
class Mxfp4MoEConfig:
    """Tiles of the two grouped GEMMs (block_k counts unpacked K values, a power of two >= 32:
    the two half-K products need block_k / 2 >= 16, and the decode takes 16 packed bytes per
    scale; block_m = 1: the GEMV form of the GEMMs, without tl.dot, GEMM_GEMV) and of the tail
    (tail_block_m = 1: the GEMV form of the tail). The defaults are the decode class of
    default_config."""
    block_m: int = 16
    block_n: int = 64
    block_k: int = 64
    group_m: int = 1
    num_warps: int = 4
    num_stages: int = 3
    tail_block_m: int = 1
    tail_block_n: int = 16
    tail_block_k: int = 128
    tail_num_warps: int = 4
    tail_num_stages: int = 3
    lut_decode: bool = True
    """The GEMMs (both forms) decode MXFP4 by byte-permute table lookups where they can (bf16
    activations, on CUDA or under the interpreter with the tests' PTX model); False: the bit
    decode they replaced, kept as the fp32 path and as the baseline
    benchmarks/bench_mxfp4_tiles.py times them against."""


GEMM_CLASSES = (
    (0, dict(block_m=16, block_n=64, block_k=64, group_m=1, num_warps=4, num_stages=3)),
    (16, dict(block_m=64, block_n=64, block_k=64, group_m=1, num_warps=4, num_stages=3)),
    (128, dict(block_m=128, block_n=128, block_k=64, group_m=4, num_warps=8, num_stages=3)),
)
"""(least mean routing rows per expert, GEMM tiles). Decode: 16-row blocks (the tl.dot
minimum; about one block per used expert) on mma.sync, 3 stages (at 2, ptxas spills registers
in gemm1). From 16 rows per expert: 64-row blocks on one warpgroup (wgmma), each weight tile
decoded once per 64 rows. From 128 rows (prefill): 128 x 128 tiles on two warpgroups, each
weight tile decoded once per 128 rows and the activations re-read half as often as with 64
columns. ptxas -v (sm_90, bf16, MXFP4 and dense) reports no spills at any of them; gemm1 (two
accumulators) at the prefill tiles takes all 255 registers a thread, no room for larger ones.
Chosen from these static compile facts and the arithmetic above, not from timings."""

GEMM_GEMV = dict(block_m=1, block_n=16, block_k=256, group_m=1, num_warps=4, num_stages=2)
"""An opt-in GEMM tile (config=, not in GEMM_CLASSES): block_m = 1 selects the GEMV form
(mxfp4_moe_gemv1_kernel / mxfp4_moe_gemv2_kernel) for one or a few tokens, one program per
(routing entry, block_n output columns) reducing block_k values of K per step. At one token
the 16-row tl.dot tile wastes 15 rows and steps through K 64 values at a time, a chain of
dependent steps; the GEMV form spreads the same weight bytes over many short programs. Its
tiles are a starting point from that arithmetic, not timed: the sweep
(benchmarks/bench_mxfp4_tiles.py) decides whether and where it replaces the decode class."""

TAIL_GEMV_BELOW = 16
"""Token count from which the tail uses tl.dot tiles (16 rows, the tl.dot minimum)."""

TAIL_CLASSES = (
    (0, dict(tail_block_m=1, tail_block_n=16, tail_block_k=128, tail_num_warps=4,
             tail_num_stages=3)),
    (TAIL_GEMV_BELOW, dict(tail_block_m=16, tail_block_n=64, tail_block_k=64, tail_num_warps=4,
                           tail_num_stages=3)),
    (128, dict(tail_block_m=32, tail_block_n=128, tail_block_k=64, tail_num_warps=4,
               tail_num_stages=3)),
    (512, dict(tail_block_m=64, tail_block_n=256, tail_block_k=64, tail_num_warps=8,
               tail_num_stages=3)),
)
"""(least tokens, tail tiles). Below TAIL_GEMV_BELOW tokens, tail_block_m = 1: the GEMV form
(latent_moe_tail_gemv_kernel), one program per token and 16 output columns, so one token's
tail spreads over hidden / 16 programs instead of the hidden / 64 of a 16-row tl.dot tile whose
other 15 rows are padding. From there on, the tl.dot tiles: the tail reads the [N * k, L]
partials once per tail_block_n columns of the output and the up weight once per tail_block_m
rows, so wider tiles cut the re-reads, but they also make fewer, longer programs. The thresholds are where, at
H = L = 2048 and k = 16 on 132 SMs, the wider class needs no more (waves of programs x bytes
a program reads) than the narrower one: a bandwidth estimate, not timed."""


def default_config(num_tokens: int, top_k: int, num_experts: int) -> Mxfp4MoEConfig:
    """Tiles from the shapes only (no host sync, CUDA-graph safe): the GEMM tiles by the mean
    routing rows per expert, num_tokens * top_k / num_experts (GEMM_CLASSES); the tail tiles
    by num_tokens (TAIL_CLASSES)."""
    rows = num_tokens * top_k / max(1, num_experts)
    gemm = [t for least, t in GEMM_CLASSES if rows >= least][-1]
    tail = [t for least, t in TAIL_CLASSES if num_tokens >= least][-1]
    return Mxfp4MoEConfig(**gemm, **tail)


GEMM_FIELDS = ("block_m", "block_n", "block_k", "group_m", "num_warps", "num_stages")
TAIL_FIELDS = ("tail_block_m", "tail_block_n", "tail_block_k", "tail_num_warps",
               "tail_num_stages")


def gemm_shape_key(num_tokens: int, num_experts: int, top_k: int, latent: int, inter: int,
                   experts: str) -> str:
    """The key of kernels/configs/mxfp4_moe_gemm_*.json (experts: "mxfp4" or "bf16")."""
    return shape_key(N=num_tokens, E=num_experts, k=top_k, L=latent, I=inter, experts=experts)


def tail_shape_key(num_tokens: int, top_k: int, latent: int, hidden: int) -> str:
    """The key of kernels/configs/latent_moe_tail_*.json."""
    return shape_key(N=num_tokens, k=top_k, L=latent, H=hidden)


_KEY_OF = {"mxfp4_moe_gemm": gemm_shape_key, "latent_moe_tail": tail_shape_key}
_MAX_TUNED_TOKENS = 512
"""Largest token count a config file may hold (decode and verify sizes)."""


def tuned_tiles(kernel: str, num_tokens: int, shape: tuple, device: torch.device) -> dict | None:
    """The measured tiles of `kernel` ("mxfp4_moe_gemm" or "latent_moe_tail"; files written by
    benchmarks/bench_mxfp4_tiles.py --write-configs) for the shape (the arguments of its key
    function after the token count) at the measured token count nearest to num_tokens, only
    within the measured range (a decode sweep says nothing about prefill tiles); None where the
    device has no file for it, and for CPU tensors. Cached: a launch costs a dict lookup."""
    if device.type != "cuda":
        return None
    return _tuned_tiles(kernel, num_tokens, shape, device_name(device), num_sms(device))


@functools.cache
def _tuned_tiles(kernel: str, num_tokens: int, shape: tuple, dev_name: str,
                 sms: int) -> dict | None:
    tuned = load_configs(kernel, dev_name, sms)
    key_of = _KEY_OF[kernel]
    counts = [n for n in range(1, _MAX_TUNED_TOKENS + 1) if key_of(n, *shape) in tuned]
    if not counts or num_tokens > max(counts):
        return None
    return tuned[key_of(min(counts, key=lambda n: (abs(n - num_tokens), n)), *shape)]


def _fit(cfg: Mxfp4MoEConfig, latent: int, inter: int, hidden: int) -> Mxfp4MoEConfig:
    """Tiles no larger than the problem (small test models); never below the tl.dot minimum
    (the GEMV form, block_m = 1, has none for block_n; block_k stays >= 32, one scale group).
    block_m, the warps and the stages are kept."""
    def cap(v, n, low):
        return max(low, min(v, next_power_of_2(n)))

    low_n = 1 if cfg.block_m == 1 else 16
    return replace(cfg, block_n=cap(cfg.block_n, min(latent, inter), low_n),
                   block_k=cap(cfg.block_k, min(latent, inter), 32),
                   tail_block_n=cap(cfg.tail_block_n, hidden, 16),
                   tail_block_k=cap(cfg.tail_block_k, latent, 16))


def _check(name: str, t: torch.Tensor, dtype: torch.dtype | None, ndim: int) -> None:
    if t.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dims, got {tuple(t.shape)}")
    if dtype is not None and t.dtype != dtype:
        raise ValueError(f"{name} must be {dtype}, got {t.dtype}")
    if t.stride(-1) != 1:
        raise ValueError(f"{name} needs a contiguous last dim")
    check_kernel_device(t)


def moe_partials(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_ids: torch.Tensor,
                 w13_scale: torch.Tensor | None = None, w2_scale: torch.Tensor | None = None,
                 act: str = "silu", beta: float | None = None, linear_beta: float | None = None,
                 config: Mxfp4MoEConfig | None = None, pdl: bool = False) -> torch.Tensor:
    """Each routing entry's expert output, unweighted: out[n * k + j] = W2_e @ act(W1_e x_n,
    W3_e x_n), e = topk_ids[n, j] (rows of ids outside [0, E) are left unwritten).

    x: [N, D] (bf16, or fp32 under the interpreter); topk_ids [N, k]. MXFP4 (scales given):
    w13 uint8 [E, 2I, D/2] + w13_scale [E, 2I, D/32] (rows [0, I) gate, [I, 2I) up), w2 uint8
    [E, D, I/2] + w2_scale [E, D, I/32]. Dense (scales None, the bf16 baseline): w13
    [E, 2I, D], w2 [E, D, I] in x.dtype. act: silu, or situ with beta (and linear_beta, the up
    branch's clip; None = unclipped). config: the tiles (None: the device's measured tiles
    for the shape, kernels/configs/mxfp4_moe_gemm_*.json, else default_config(N, k, E)),
    shrunk to the shapes by _fit; block_m = 1 runs the GEMV form (GEMM_GEMV), without the
    alignment step. Returns [N * k, D] in x.dtype."""
    require_triton()
    from kdaserve.kernels.moe.fused_moe import moe_align_block_size
    from kdaserve.kernels.moe.triton_mxfp4_moe import (mxfp4_moe_gemm1_kernel,
                                                       mxfp4_moe_gemm2_kernel)

    mxfp4 = w13_scale is not None
    if mxfp4 != (w2_scale is not None):
        raise ValueError("give both scales (MXFP4 experts) or neither (dense experts)")
    _check("x", x, None, 2)
    wdt = torch.uint8 if mxfp4 else x.dtype
    for name, t in (("w13", w13), ("w2", w2)) + ((("w13_scale", w13_scale),
                                                  ("w2_scale", w2_scale)) if mxfp4 else ()):
        _check(name, t, torch.uint8 if "scale" in name else wdt, 3)
    N, D = x.shape
    E, two_i, k1 = w13.shape
    inter = two_i // 2
    pack = 2 if mxfp4 else 1
    bad = (k1 * pack != D or w2.shape != (E, D, inter // pack)
           or (mxfp4 and (w13_scale.shape != (E, two_i, D // 32)
                          or w2_scale.shape != (E, D, inter // 32))))
    if bad or D % 32 or inter % 32:
        raise ValueError(f"expert shapes do not match x [N, {D}] (D and I multiples of 32): "
                         f"w13 {tuple(w13.shape)}, w2 {tuple(w2.shape)}"
                         + (f", scales {tuple(w13_scale.shape)} / {tuple(w2_scale.shape)}"
                            if mxfp4 else ""))
    if act not in ("silu", "situ") or (act == "situ" and beta is None):
        raise ValueError(f"act must be silu or situ (with beta), got {act!r}")
    top_k = topk_ids.shape[1]
    out = torch.empty(N * top_k, D, dtype=x.dtype, device=x.device)
    if N == 0:
        return out
    if config is None:
        config = default_config(N, top_k, E)
        tuned = tuned_tiles("mxfp4_moe_gemm", N, (E, top_k, D, inter,
                                                  "mxfp4" if mxfp4 else "bf16"), x.device)
        if tuned is not None:
            config = replace(config, **{f: tuned[f] for f in GEMM_FIELDS})
    cfg = _fit(config, D, inter, D)
    topk_ids = topk_ids.contiguous()
    h = torch.empty(N * top_k, inter, dtype=x.dtype, device=x.device)           # [N*k, I]
    if cfg.block_m == 1:
        _gemv_partials(x, w13, w2, topk_ids, w13_scale, w2_scale, act, beta, linear_beta, cfg,
                       pdl, h, out)
        return out
    direct = N == 1
    if direct:
        blocks, sorted_ids, expert_ids, expert_start, counts, num_rows = \
            top_k, topk_ids, topk_ids, topk_ids, topk_ids, topk_ids
    else:
        align = moe_align_block_size(topk_ids, E, cfg.block_m, pdl=pdl)
        blocks, sorted_ids, expert_ids, expert_start, counts, num_rows = \
            align.max_blocks, align.sorted_ids, align.expert_ids, align.expert_start, \
            align.counts, align.num_rows
    precision = "ieee" if x.dtype == torch.float32 else "tf32"
    opts = dict(BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
                GROUP_M=cfg.group_m, DOT_PRECISION=precision, MXFP4=mxfp4, DIRECT=direct,
                LUT=_use_lut(cfg, mxfp4, x), num_warps=cfg.num_warps,
                num_stages=cfg.num_stages, **pdl_options(pdl, x))
    s13 = w13_scale if mxfp4 else w13
    s2 = w2_scale if mxfp4 else w2
    table = _lut_table_words(x.device)
    mxfp4_moe_gemm1_kernel[(blocks * cdiv(inter, cfg.block_n),)](
        x, w13, s13, h, sorted_ids, expert_ids, expert_start, counts, num_rows, table,
        inter, D, top_k, blocks, E, float(beta or 1.0), float(linear_beta or 1.0),
        x.stride(0), w13.stride(0), w13.stride(1), s13.stride(0), s13.stride(1), h.stride(0),
        ACT=0 if act == "silu" else 1, CLIP_UP=linear_beta is not None, **opts)
    mxfp4_moe_gemm2_kernel[(blocks * cdiv(D, cfg.block_n),)](
        h, w2, s2, out, sorted_ids, expert_ids, expert_start, counts, num_rows, table,
        D, inter, blocks, E,
        h.stride(0), w2.stride(0), w2.stride(1), s2.stride(0), s2.stride(1), out.stride(0),
        **opts)
    return out


def _use_lut(cfg: Mxfp4MoEConfig, mxfp4: bool, x: torch.Tensor) -> bool:
    """Whether the expert GEMMs decode by table lookups (Mxfp4MoEConfig.lut_decode): PTX, so
    on CUDA, or under the interpreter where the tests give it a PTX model; bf16 activations
    (the fp32 path, the interpreter's checks, keeps the bit decode)."""
    return (cfg.lut_decode and mxfp4 and x.dtype == torch.bfloat16
            and (x.is_cuda or triton_interpret()))


@functools.cache
def _lut_table_words(device: torch.device) -> torch.Tensor:
    """The table decode's two words (triton_mxfp4_moe.LUT_TABLE_WORDS) as an int32 tensor on
    the device, made once (a CUDA graph captures its address): the first expert GEMM on a
    device must run eagerly, as every graph's warm-up does."""
    from kdaserve.kernels.moe.triton_mxfp4_moe import LUT_TABLE_WORDS

    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        raise RuntimeError("the MXFP4 expert GEMMs' first launch on a device is being captured "
                           "in a CUDA graph: run them once eagerly first (their table is copied "
                           "then)")

    words = [w - (1 << 32) if w >= 1 << 31 else w for w in LUT_TABLE_WORDS]
    return torch.tensor(words, dtype=torch.int32, device=device)


def _gemv_partials(x, w13, w2, topk_ids, w13_scale, w2_scale, act, beta, linear_beta,
                   cfg: Mxfp4MoEConfig, pdl: bool, h: torch.Tensor, out: torch.Tensor) -> None:
    """moe_partials in its GEMV form (cfg.block_m = 1), arguments checked by it: gemv1 into h
    [N * k, I], gemv2 into out [N * k, D], each over (routing entries x column tiles)."""
    from kdaserve.kernels.moe.triton_mxfp4_moe import (mxfp4_moe_gemv1_kernel,
                                                       mxfp4_moe_gemv2_kernel)

    mxfp4 = w13_scale is not None
    s13 = w13_scale if mxfp4 else w13
    s2 = w2_scale if mxfp4 else w2
    entries, (D, inter) = topk_ids.numel(), (x.shape[1], h.shape[1])
    # LUT: the GEMV also reads the bf16 activations as 32-bit (even, odd) pairs, so rows must
    # start on 4-byte boundaries (h is allocated here; a misaligned x view is copied)
    lut = _use_lut(cfg, mxfp4, x)
    if lut and (x.stride(0) % 2 or x.data_ptr() % 4):
        x = x.clone(memory_format=torch.contiguous_format)
    opts = dict(BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, MXFP4=mxfp4, LUT=lut,
                num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pdl_options(pdl, x))
    table = _lut_table_words(x.device)
    mxfp4_moe_gemv1_kernel[(entries * cdiv(inter, cfg.block_n),)](
        x, w13, s13, h, topk_ids, table, inter, D, topk_ids.shape[1], w13.shape[0],
        float(beta or 1.0), float(linear_beta or 1.0),
        x.stride(0), w13.stride(0), w13.stride(1), s13.stride(0), s13.stride(1), h.stride(0),
        ACT=0 if act == "silu" else 1, CLIP_UP=linear_beta is not None, **opts)
    mxfp4_moe_gemv2_kernel[(entries * cdiv(D, cfg.block_n),)](
        h, w2, s2, out, topk_ids, table, D, inter, w2.shape[0],
        h.stride(0), w2.stride(0), w2.stride(1), s2.stride(0), s2.stride(1), out.stride(0),
        **opts)


def latent_moe_tail(partials: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                    up_weight: torch.Tensor, norm_weight: torch.Tensor | None = None,
                    eps: float = 1e-6, residual: torch.Tensor | None = None,
                    num_experts: int | None = None, out: torch.Tensor | None = None,
                    config: Mxfp4MoEConfig | None = None, pdl: bool = False) -> torch.Tensor:
    """out[n] = RMSNorm(sum_j topk_weights[n, j] * partials[n * k + j]; norm_weight) @
    up_weight^T (+ residual[n]) in one launch; without norm_weight the sum goes straight into
    the up projection. partials: [N * k, L]; topk_*: [N, k] (ids outside [0, num_experts)
    skipped; num_experts None = no upper bound); up_weight: [H, L]; residual: [N, H].
    config: its tail_* tiles are used (None: the device's measured tiles,
    kernels/configs/latent_moe_tail_*.json, else default_config's by N), shrunk to the shapes.
    Returns [N, H] in up_weight.dtype."""
    require_triton()
    from kdaserve.kernels.moe.triton_mxfp4_moe import (latent_moe_tail_gemv_kernel,
                                                       latent_moe_tail_kernel)

    _check("partials", partials, None, 2)
    _check("up_weight", up_weight, None, 2)
    N, top_k = topk_ids.shape
    H, L = up_weight.shape
    if partials.shape != (N * top_k, L) or topk_weights.shape != (N, top_k):
        raise ValueError(f"partials {tuple(partials.shape)} / topk_weights "
                         f"{tuple(topk_weights.shape)} do not match topk_ids [N={N}, k={top_k}]"
                         f" and up_weight [H={H}, L={L}]")
    if residual is not None and (residual.shape != (N, H) or residual.stride(1) != 1):
        raise ValueError(f"residual must be [N, H]={N, H} contiguous in H")
    if out is None:
        out = torch.empty(N, H, dtype=up_weight.dtype, device=up_weight.device)
    if N == 0:
        return out
    # only the tail tiles are used, and they depend on N alone
    if config is None:
        config = default_config(N, top_k, num_experts or 1)
        tuned = tuned_tiles("latent_moe_tail", N, (top_k, L, H), up_weight.device)
        if tuned is not None:
            config = replace(config, **{f: tuned[f] for f in TAIL_FIELDS})
    cfg = _fit(config, L, L, H)
    ptrs = (partials, topk_weights.contiguous(), topk_ids.contiguous(),
            norm_weight if norm_weight is not None else up_weight, up_weight,
            residual if residual is not None else out, out)
    dims = (L, H, num_experts if num_experts is not None else 2 ** 31 - 1, float(eps),
            partials.stride(0), up_weight.stride(0),
            residual.stride(0) if residual is not None else 0, out.stride(0))
    opts = dict(TOP_K=top_k, BLOCK_N=cfg.tail_block_n, BLOCK_K=cfg.tail_block_k,
                HAS_NORM=norm_weight is not None, HAS_RESIDUAL=residual is not None,
                num_warps=cfg.tail_num_warps, num_stages=cfg.tail_num_stages,
                **pdl_options(pdl, up_weight))
    if cfg.tail_block_m == 1:
        latent_moe_tail_gemv_kernel[(N * cdiv(H, cfg.tail_block_n),)](
            *ptrs, *dims, TOP_K_P2=next_power_of_2(top_k), **opts)
    else:
        precision = "ieee" if up_weight.dtype == torch.float32 else "tf32"
        latent_moe_tail_kernel[(cdiv(N, cfg.tail_block_m) * cdiv(H, cfg.tail_block_n),)](
            *ptrs, N, *dims, BLOCK_M=cfg.tail_block_m, DOT_PRECISION=precision, **opts)
    return out
