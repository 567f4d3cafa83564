"""The prefill step's kernels outside fla at an 8000-token chunk, against their floors, with
tile sweeps: the router's logits GEMM, KDA's short conv and gated output norm, the fused MoE,
the MLA prefill attention (padded v against an unpadded v_head_dim), its k / v build, and the
MLA prefill attention kernel that reads kv_b's output in place against k / v + flash.

    python benchmarks/bench_prefill.py --cases router,conv,norm,moe,sdpa,mla_kv,mla_attn --out prefill.json

Kimi-Linear-48B shapes (one sequence of `--tokens` tokens). Every case times each candidate
eagerly with triton's do_bench (median), the first candidate being what the engine runs today
(the baseline of the case). Floors: bytes over the measured copy bandwidth for the
memory-bound kernels, FLOPs over the measured bf16 GEMM rate for the GEMMs.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_batch import moe_inputs, moe_weights  # noqa: E402
from bench_layers import (bench_graph_ms, bench_ms, pick_cases, start_gpu_run,  # noqa: E402
                          write_results)

from kdaserve.kernels.conv.causal_conv1d import causal_conv1d_varlen, varlen_tiles  # noqa: E402
from kdaserve.kernels.moe import fused_moe as moe  # noqa: E402
from kdaserve.kernels.moe.router import (ROUTER_GEMM_MIN_ROWS,  # noqa: E402
                                         ROUTER_PARTIALS_MAX_ROWS, RouterGemmConfig,
                                         RouterPartialsPlan, moe_topk_sigmoid, router_logits,
                                         router_partials, router_partials_plan)
from kdaserve.kernels.norm.rms_norm import gated_norm_tiles, rms_norm_gated  # noqa: E402
from kdaserve.kernels.utils import cdiv  # noqa: E402

HIDDEN, EXPERTS, HEADS, HEAD_DIM, CONV_W = 2304, 256, 32, 128, 4
MLA_HEADS, QK_DIM, V_DIM = 32, 192, 128
CASES = ("router", "conv", "norm", "moe", "sdpa", "mla_kv", "mla_attn")
MLA_ATTN_TILES = ((128, 64, 8, 2), (128, 64, 8, 3), (128, 128, 8, 2), (64, 64, 4, 3),
                  (128, 32, 4, 3), (64, 128, 8, 2))
"""(block_m, block_n, warps, stages) candidates of kernels/mla/prefill_attn.py."""


def run_candidates(rows, name, floor_ms, candidates, deadline, timer=bench_ms):
    """candidates: [(label, fn)], the first the engine's current choice. One row per case.
    timer(fn) -> ms: eager (bench_ms) or from a CUDA graph replay (bench_graph_ms)."""
    row = {"case": name, "floor_ms": floor_ms, "results": []}
    for label, fn in candidates:
        if time.time() > deadline and row["results"]:
            row["cut_by_budget"] = True
            break
        try:
            ms = timer(fn)
        except Exception as exc:   # out of resources, unsupported backend, ...
            row["results"].append({"label": label, "error": f"{type(exc).__name__}: {exc}"[:300]})
            print(f"  {name:<22} {label:<44} {type(exc).__name__}", flush=True)
            continue
        row["results"].append({"label": label, "ms": ms})
        print(f"  {name:<22} {label:<44} {ms:8.4f} ms  ({ms / floor_ms:5.2f}x floor)",
              flush=True)
    timed = [r for r in row["results"] if "ms" in r]
    if timed:
        best = min(timed, key=lambda r: r["ms"])
        row["baseline_ms"], row["best_ms"], row["best"] = timed[0]["ms"], best["ms"], best["label"]
    rows.append(row)


def router_partials_plans(T: int) -> list[RouterPartialsPlan]:
    """router_partials' default plan at T rows, then the same tiles at the other split counts
    and a few other tiles at the default splits."""
    base = router_partials_plan(T, EXPERTS, HIDDEN, torch.cuda.get_device_properties(0)
                                .multi_processor_count)
    plans = [base]
    for splits in (1, 2, 4, 8, 16):
        k_split = cdiv(cdiv(HIDDEN, splits), base.block_k) * base.block_k
        p = replace(base, splits=cdiv(HIDDEN, k_split), k_split=k_split)
        if p not in plans:
            plans.append(p)
    for bm, bn, bk, warps in ((16, 16, 32, 4), (16, 8, 64, 4), (16, 4, 32, 2), (8, 8, 32, 2)):
        k_split = cdiv(base.k_split, bk) * bk
        plans.append(replace(base, block_m=bm, block_n=bn, block_k=bk, num_warps=warps,
                             k_split=k_split, splits=cdiv(HIDDEN, k_split)))
    return plans


def case_router(rows, ceil, T, deadline):
    x = torch.randn(T, HIDDEN, device="cuda").bfloat16()
    w = torch.randn(EXPERTS, HIDDEN, device="cuda") * HIDDEN ** -0.5
    flops = 2 * T * HIDDEN * EXPERTS * 3                       # three bf16 products per weight
    if T < ROUTER_GEMM_MIN_ROWS:
        # below router_logits' rows the engine takes router_partials (up to
        # ROUTER_PARTIALS_MAX_ROWS) or cuBLAS; router_partials' K splits are added by the top-k
        # kernel, so each way is timed with the top-k launch that consumes its logits
        bias = torch.zeros(EXPERTS, device="cuda")

        def routed(logits_fn, **topk):
            return lambda: moe_topk_sigmoid(logits_fn(), bias, 8, True, 2.446,
                                            extra_expert=EXPERTS, **topk)

        cands = [("router_partials + top-k", routed(lambda: router_partials(x, w))),
                 ("cuBLAS fp32 + top-k", routed(lambda: F.linear(x.float(), w))),
                 ("router_logits default + top-k", routed(lambda: router_logits(x, w)))]
        if T > ROUTER_PARTIALS_MAX_ROWS:   # the engine's choice first
            cands[:2] = cands[1::-1]
        for plan in router_partials_plans(T)[1:]:
            cands.append((f"router_partials {plan} + top-k",
                          routed(lambda plan=plan: router_partials(x, w, plan))))
        for warps in (1, 2, 8):   # the top-k kernel's warps (default TOPK_NUM_WARPS)
            cands.append((f"router_partials + top-k, {warps} warps",
                          routed(lambda: router_partials(x, w), num_warps=warps)))
        run_candidates(rows, f"router+topk T={T}", flops / (ceil["bf16_gemm_TFLOPs"] * 1e9),
                       cands, deadline, timer=bench_graph_ms)
        return
    cands = [("router_logits default", lambda: router_logits(x, w)),
             ("cuBLAS fp32 (x.float() @ w.T)", lambda: F.linear(x.float(), w))]
    big = [(128, 128, 64, 8, 3), (64, 128, 64, 4, 3), (128, 64, 64, 4, 3),
           (64, 256, 64, 8, 3), (128, 256, 64, 8, 3), (128, 128, 32, 8, 4), (64, 64, 64, 4, 4)]
    small = [(64, 128, 64, 4, 3), (16, 32, 128, 4, 3), (16, 32, 64, 4, 3), (16, 64, 128, 4, 3),
             (32, 32, 128, 4, 3), (32, 64, 64, 4, 3), (16, 32, 128, 2, 4)]
    for c in big if T >= 4096 else small:
        cfg = RouterGemmConfig(*c)
        cands.append((f"router_logits {c}", lambda cfg=cfg: router_logits(x, w, cfg)))
    # a few-row GEMM takes about as long as its launches: time those from a CUDA graph replay
    run_candidates(rows, f"router T={T}", flops / (ceil["bf16_gemm_TFLOPs"] * 1e9), cands,
                   deadline, timer=bench_graph_ms if T < 4096 else bench_ms)


def case_conv(rows, ceil, T, deadline):
    P = HEADS * HEAD_DIM
    proj = torch.randn(T, 3 * P + 2 * HEAD_DIM + HEADS, device="cuda").bfloat16()
    x = proj[:, :3 * P]                                        # the strided q|k|v columns
    w = torch.randn(3 * P, CONV_W, device="cuda").bfloat16()
    states = torch.zeros(4, 3 * P, CONV_W - 1, device="cuda").bfloat16()
    cu = torch.tensor([0, T], device="cuda", dtype=torch.int32)
    idx = torch.tensor([1], device="cuda", dtype=torch.int32)
    has = torch.tensor([False], device="cuda")
    out = torch.empty(3, T, P, device="cuda").bfloat16()
    nbytes = 2 * T * 3 * P * 2
    cands = [(f"default {varlen_tiles(3 * P)}",
              lambda: causal_conv1d_varlen(x, w, cu, states, idx, has, out=out))]
    for tiles in [(8, 1024, 4), (4, 512, 1), (8, 256, 1), (16, 512, 2), (4, 1024, 4)]:
        cands.append((f"tiles {tiles}", lambda t=tiles: causal_conv1d_varlen(
            x, w, cu, states, idx, has, out=out, tiles=t)))
    run_candidates(rows, f"conv_varlen T={T}", nbytes / (ceil["copy_GBps"] * 1e6), cands,
                   deadline)


def case_norm(rows, ceil, T, deadline):
    n = T * HEADS
    o = torch.randn(n, HEAD_DIM, device="cuda").bfloat16()
    gate = torch.randn(T, 2, HEADS * HEAD_DIM, device="cuda").bfloat16()[:, 1].reshape(n, HEAD_DIM)
    w = torch.rand(HEAD_DIM, device="cuda") + 0.5
    nbytes = 3 * n * HEAD_DIM * 2
    cands = [("one row a program, 1 warp (before)",
              lambda: rms_norm_gated(o, gate, w, 1e-6, tiles=(1, 1))),
             (f"default {gated_norm_tiles(n, HEAD_DIM)}", lambda: rms_norm_gated(o, gate, w, 1e-6))]
    for tiles in [(8, 2), (16, 4), (32, 4), (32, 8), (64, 8)]:
        cands.append((f"tiles {tiles}", lambda t=tiles: rms_norm_gated(o, gate, w, 1e-6, tiles=t)))
    run_candidates(rows, f"rms_norm_gated T={T}", nbytes / (ceil["copy_GBps"] * 1e6), cands,
                   deadline)


def case_moe(rows, ceil, T, deadline):
    w13, w2 = moe_weights()
    x = torch.randn(T, HIDDEN, device="cuda", dtype=torch.bfloat16)
    C, FC = moe.MoEGemmConfig, moe.FusedMoEConfig
    g1 = [(128, 128, 64, 8, 8, 3), (128, 128, 64, 8, 8, 4), (128, 64, 64, 8, 4, 4),
          (128, 128, 128, 8, 8, 2), (256, 64, 64, 8, 8, 3), (64, 128, 64, 8, 4, 4),
          (128, 64, 128, 8, 4, 3)]
    g2 = [(128, 256, 64, 8, 8, 3), (128, 256, 64, 8, 8, 4), (128, 128, 64, 8, 8, 4),
          (128, 128, 64, 8, 4, 4), (128, 256, 32, 8, 8, 5), (256, 128, 64, 8, 8, 3),
          (64, 256, 64, 8, 8, 4), (128, 128, 128, 8, 8, 3)]
    for same in (True, False):
        w, ids = moe_inputs(T, same)
        flops = 2 * T * ids.shape[1] * 3 * HIDDEN * w13.shape[1] // 2
        cands = [("default", lambda: moe.fused_moe(x, w13, w2, w, ids))]
        for c in g1[1:]:   # gemm1 varies, gemm2 keeps its tile at the same block_m
            cfg = FC(C(*c), C(c[0], *g2[0][1:]))
            cands.append((f"gemm1 {c}", lambda cfg=cfg: moe.fused_moe(x, w13, w2, w, ids,
                                                                      config=cfg)))
        for c in g2[1:]:
            cfg = FC(C(c[0], *g1[0][1:]), C(*c))
            cands.append((f"gemm2 {c}", lambda cfg=cfg: moe.fused_moe(x, w13, w2, w, ids,
                                                                      config=cfg)))
        run_candidates(rows, f"fused_moe T={T} {'same8' if same else 'spread'}",
                       flops / (ceil["bf16_gemm_TFLOPs"] * 1e9), cands, deadline)


def case_mla_kv(rows, ceil, T, deadline):
    """MLA prefill's k and zero-padded v from kv_b's output and the latents' rope columns:
    the engine's one launch (kernels/mla/prefill_kv.py) against the twin's concatenation and
    pad (what the engine ran before). Floor: kv and the rope columns read once, k and v
    written once."""
    from kdaserve.kernels import reference as ref
    from kdaserve.kernels.mla.prefill_kv import mla_prefill_kv

    nope, rope = 128, QK_DIM - 128
    kv = torch.randn(T, MLA_HEADS, nope + V_DIM, device="cuda").bfloat16()
    latent = torch.randn(T, 512 + rope, device="cuda").bfloat16()
    pe = latent[:, 512:]
    nbytes = 2 * (kv.numel() + pe.numel() + 2 * T * MLA_HEADS * QK_DIM)
    k, v = mla_prefill_kv(kv, pe, nope, QK_DIM)
    k_r, v_r = ref.mla_prefill_kv(kv, pe, nope, QK_DIM)
    assert torch.equal(k, k_r) and torch.equal(v, v_r), "mla_prefill_kv differs from its twin"
    cands = [("one launch (engine)", lambda: mla_prefill_kv(kv, pe, nope, QK_DIM)),
             ("cat + pad (twin)", lambda: ref.mla_prefill_kv(kv, pe, nope, QK_DIM))]
    run_candidates(rows, f"mla_prefill_kv T={T}", nbytes / (ceil["copy_GBps"] * 1e6), cands,
                   deadline)


def case_mla_attn(rows, ceil, T, deadline):
    """MLA prefill attention of one sequence, engine layouts (q a [T, H, 192] projection, kv
    kv_b's [L, H, 128 + 128] output, k_pe the latents' rope columns): the kernel reading them
    in place at each MLA_ATTN_TILES entry, against k / v built by mla_prefill_kv then flash SDPA
    (v padded to 192), plain causal (T keys) and a chunk of 3/8 T after 5/8 T cached keys.
    Results are compared (bf16, relative error) before timing."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.attention.bias import causal_lower_right

    from kdaserve.kernels.mla.prefill_attn import mla_prefill_attention
    from kdaserve.kernels.mla.prefill_kv import mla_prefill_kv

    flash = [SDPBackend.FLASH_ATTENTION]
    scale = QK_DIM ** -0.5
    nope, rope = 128, QK_DIM - 128
    kv = torch.randn(T, MLA_HEADS, nope + V_DIM, device="cuda").bfloat16()
    latent = torch.randn(T, 512 + rope, device="cuda").bfloat16()
    pe = latent[:, 512:]
    q_all = torch.randn(T, MLA_HEADS, QK_DIM, device="cuda").bfloat16()
    for q_len in (T, 3 * T // 8):
        q = q_all[T - q_len:]
        out = torch.empty(q_len, MLA_HEADS, V_DIM, device="cuda", dtype=torch.bfloat16)

        def by_flash(causal=True):
            k, v = mla_prefill_kv(kv, pe, nope, v_width=QK_DIM)
            qi, kt, vt = q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None]
            with sdpa_kernel(flash):
                if q_len == T:
                    o = F.scaled_dot_product_attention(qi, kt, vt, is_causal=causal, scale=scale)
                else:
                    o = F.scaled_dot_product_attention(
                        qi, kt, vt, scale=scale, attn_mask=causal_lower_right(q_len, T))
            out.copy_(o[0].transpose(0, 1)[..., :V_DIM])
            return out

        want = by_flash().float()
        cands = [("k / v launch + flash SDPA (engine)", by_flash)]
        if q_len == T:
            cands.append(("probe: k / v launch + flash, no causal mask",
                          lambda: by_flash(causal=False)))
        for tiles in MLA_ATTN_TILES:
            try:
                got = mla_prefill_attention(q, kv, pe, scale, out=out, tiles=tiles).float()
            except Exception as exc:
                print(f"  mla_attn {tiles}: {type(exc).__name__}: {str(exc)[:160]}", flush=True)
                continue
            err = ((got - want).norm() / want.norm()).item()
            print(f"  mla_attn {tiles}: relative error against flash {err:.2e}", flush=True)
            if not err <= 1e-2:
                continue
            cands.append((f"in place {tiles}", lambda t=tiles: mla_prefill_attention(
                q, kv, pe, scale, out=out, tiles=t)))
        pairs = q_len * (T - q_len) + q_len * (q_len + 1) / 2
        flops = 2 * MLA_HEADS * pairs * (QK_DIM + V_DIM)
        run_candidates(rows, f"mla_prefill_attn {q_len}/{T}",
                       flops / (ceil["bf16_gemm_TFLOPs"] * 1e9), cands, deadline)


def case_sdpa(rows, ceil, T, deadline):
    q = torch.randn(1, MLA_HEADS, T, QK_DIM, device="cuda").bfloat16()
    k = torch.randn(1, MLA_HEADS, T, QK_DIM, device="cuda").bfloat16()
    v = torch.randn(1, MLA_HEADS, T, V_DIM, device="cuda").bfloat16()
    scale = QK_DIM ** -0.5
    flops = 2 * MLA_HEADS * T * T / 2 * (QK_DIM + V_DIM)

    def padded():
        vp = F.pad(v, (0, QK_DIM - V_DIM))
        return F.scaled_dot_product_attention(q, k, vp, is_causal=True, scale=scale)[..., :V_DIM]

    def direct(backend=None):
        if backend is None:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
        from torch.nn.attention import sdpa_kernel

        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)

    from torch.nn.attention import SDPBackend

    ref = padded()
    cands = [("v padded to 192 (today)", padded), ("v_head_dim 128, default backend", direct)]
    for b in (SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION,
              SDPBackend.EFFICIENT_ATTENTION):
        try:
            err = (direct(b).float() - ref.float()).abs().max().item()
        except Exception as exc:
            print(f"  sdpa {b.name}: {type(exc).__name__}: {str(exc)[:120]}", flush=True)
            continue
        print(f"  sdpa {b.name}: max |diff| against the padded path {err:.3e}", flush=True)
        cands.append((f"v_head_dim 128, {b.name}", lambda b=b: direct(b)))
    run_candidates(rows, f"mla_prefill_sdpa T={T}", flops / (ceil["bf16_gemm_TFLOPs"] * 1e9),
                   cands, deadline)
    # the engine's layouts: q a transposed view of the [T, H, qk] projection, k the cat of
    # k_nope and the shared k_pe, v a strided slice of kv_b's [T, H, nope + v] output
    from kdaserve.attention import mla_backend

    qe = torch.randn(T, MLA_HEADS, QK_DIM, device="cuda").bfloat16()
    kv = torch.randn(T, MLA_HEADS, 256, device="cuda").bfloat16()
    pe = torch.randn(T, 1, QK_DIM - 128, device="cuda").bfloat16()
    ke = torch.cat([kv[..., :128], pe.expand(T, MLA_HEADS, QK_DIM - 128)], -1)
    ve = kv[..., 128:]

    cudnn_first = [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION,
                   SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]

    def engine(vv, backends):
        from torch.nn.attention import sdpa_kernel

        qi, kt, vt = (t.transpose(0, 1)[None] for t in (qe, ke, vv))
        if backends is None:
            return F.scaled_dot_product_attention(qi, kt, vt, is_causal=True, scale=scale)
        with sdpa_kernel(backends, set_priority=True):
            return F.scaled_dot_product_attention(qi, kt, vt, is_causal=True, scale=scale)

    def v_pad():
        return F.pad(ve, (0, QK_DIM - V_DIM))

    cands = [("engine layout, v padded, the engine's PREFILL_BACKENDS (flash)",
              lambda: engine(v_pad(), mla_backend.PREFILL_BACKENDS)),
             ("engine layout, v padded, default order", lambda: engine(v_pad(), None)),
             ("engine layout, strided v, cuDNN first", lambda: engine(ve, cudnn_first)),
             ("engine layout, v.contiguous(), cuDNN first",
              lambda: engine(ve.contiguous(), cudnn_first)),
             ("engine layout, strided v, default order", lambda: engine(ve, None))]
    run_candidates(rows, f"mla_prefill_sdpa engine layout T={T}",
                   flops / (ceil["bf16_gemm_TFLOPs"] * 1e9), cands, deadline + 30)
    # a chunk after a cached prefix: bottom-right aligned causal mask (the last 3/8 of T)
    from torch.nn.attention.bias import causal_lower_right

    q_len = 3 * T // 8
    qc = q[:, :, T - q_len:]
    mask = causal_lower_right(q_len, T)

    def chunk(vv, backend=None):
        if backend is None:
            return F.scaled_dot_product_attention(qc, k, vv, attn_mask=mask, scale=scale)
        from torch.nn.attention import sdpa_kernel

        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(qc, k, vv, attn_mask=mask, scale=scale)

    vp = F.pad(v, (0, QK_DIM - V_DIM))
    ref = chunk(vp)[..., :V_DIM]
    cands = [("v padded to 192 (today)", lambda: chunk(F.pad(v, (0, QK_DIM - V_DIM))))]
    for label, vv, b in (("v_head_dim 128, default backend", v, None),
                         ("v_head_dim 128, CUDNN", v, SDPBackend.CUDNN_ATTENTION),
                         ("v padded, CUDNN", vp, SDPBackend.CUDNN_ATTENTION)):
        try:
            err = (chunk(vv, b)[..., :V_DIM].float() - ref.float()).abs().max().item()
        except Exception as exc:
            print(f"  chunk sdpa {label}: {type(exc).__name__}: {str(exc)[:120]}", flush=True)
            continue
        print(f"  chunk sdpa {label}: max |diff| {err:.3e}", flush=True)
        cands.append((label, lambda vv=vv, b=b: chunk(vv, b)))
    chunk_flops = 2 * MLA_HEADS * q_len * (T - q_len / 2) * (QK_DIM + V_DIM)
    run_candidates(rows, f"mla_prefill_sdpa chunk {q_len}/{T}",
                   chunk_flops / (ceil["bf16_gemm_TFLOPs"] * 1e9), cands, deadline + 30)
    rows.append(first_calls(scale, cudnn_first, T // 8))


def first_calls(scale: float, cudnn_first, base: int) -> dict:
    """The first call at each of 8 sequence lengths not run before in the process (cuDNN builds
    an execution graph per new shape on the host), against the third call, per backend order."""
    from torch.nn.attention import sdpa_kernel

    from kdaserve.attention import mla_backend

    def call(T, backends, pad):
        q = torch.randn(1, MLA_HEADS, T, QK_DIM, device="cuda").bfloat16()
        k = torch.randn_like(q)
        v = torch.randn(1, MLA_HEADS, T, V_DIM, device="cuda").bfloat16()
        v = F.pad(v, (0, QK_DIM - V_DIM)) if pad else v
        ms = []
        for _ in range(3):
            torch.cuda.synchronize()
            t = time.perf_counter()
            with sdpa_kernel(backends, set_priority=True):
                F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
            torch.cuda.synchronize()
            ms.append((time.perf_counter() - t) * 1e3)
        return ms

    row = {"case": f"mla_prefill_sdpa first call at a new length, from {base} (ms)"}
    for i, (label, backends, pad) in enumerate((
            ("strided v, cuDNN first", cudnn_first, False),
            ("v padded, PREFILL_BACKENDS", mla_backend.PREFILL_BACKENDS, True))):
        lengths = [base + 112 * (8 * i + j) for j in range(8)]
        runs = [call(T, backends, pad) for T in lengths]
        row[label] = {"lengths": lengths, "first_ms": [r[0] for r in runs],
                      "third_ms": [r[2] for r in runs]}
        print(f"  first call at a new length, {label}: "
              f"{[round(r[0], 2) for r in runs]} ms (third call {[round(r[2], 2) for r in runs]})",
              flush=True)
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--tokens", default="8000",
                    help="comma list of token counts; every case runs at each")
    ap.add_argument("--time-budget", type=float, default=240.0, help="seconds for all cases")
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    cases = pick_cases(ap, args.cases, CASES)
    start = start_gpu_run("bench_prefill")
    if start is None:
        return 2
    t0, meta, ceil = start
    print(f"bf16 GEMM {ceil['bf16_gemm_TFLOPs']:.0f} TFLOP/s", flush=True)
    rows: list[dict] = []
    fns = {"router": case_router, "conv": case_conv, "norm": case_norm, "moe": case_moe,
           "sdpa": case_sdpa, "mla_kv": case_mla_kv, "mla_attn": case_mla_attn}
    tokens = [int(t) for t in args.tokens.split(",")]
    per = args.time_budget / (len(cases) * len(tokens))
    for name in cases:
        for T in tokens:
            fns[name](rows, ceil, T, time.time() + per)
    write_results(args.out, meta, t0, ceil, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
