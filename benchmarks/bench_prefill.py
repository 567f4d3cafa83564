"""The prefill step's kernels outside fla at an 8000-token chunk, against their floors, with
tile sweeps: the router's logits GEMM, KDA's short conv and gated output norm, the fused MoE,
and the MLA prefill attention kernel that reads kv_b's output in place, against k and a padded v
built with torch ops, then flash SDPA.

    python benchmarks/bench_prefill.py --cases router,conv,norm,moe,mla_attn --out prefill.json

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
CASES = ("router", "conv", "norm", "moe", "mla_attn")
MLA_ATTN_TILES = ((128, 64, 8, 3), (128, 64, 8, 4), (128, 64, 8, 2), (128, 32, 8, 3),
                  (64, 64, 4, 4), (64, 64, 4, 3), (128, 32, 4, 3))
"""(block_m, block_n, warps, stages) candidates of kernels/mla/prefill_attn.py (bf16, sm_90
builds without spills; 128 or 64 rows x 128 keys need more shared memory than an SM has)."""


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


def case_mla_attn(rows, ceil, T, deadline):
    """MLA prefill attention of one sequence, engine layouts (q a [T, H, 192] projection, kv
    kv_b's [L, H, 128 + 128] output, k_pe the latents' rope columns): the kernel reading them
    in place (the engine's tiles first, then the other MLA_ATTN_TILES entries), against k and
    the padded v built by the reference's cat + pad then flash SDPA (the engine's path before
    the kernel), plain causal (T keys) and a chunk of 3/8 T after 5/8 T cached keys. Results
    are compared with flash's (bf16, relative error) before timing."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.attention.bias import causal_lower_right

    from kdaserve.kernels import reference as ref
    from kdaserve.kernels.mla import prefill_attn
    from kdaserve.kernels.mla.prefill_attn import mla_prefill_attention

    scale = QK_DIM ** -0.5
    nope, rope = 128, QK_DIM - 128
    kv = torch.randn(T, MLA_HEADS, nope + V_DIM, device="cuda").bfloat16()
    latent = torch.randn(T, 512 + rope, device="cuda").bfloat16()
    pe = latent[:, 512:]
    q_all = torch.randn(T, MLA_HEADS, QK_DIM, device="cuda").bfloat16()
    engine = (prefill_attn.BLOCK_M, prefill_attn.BLOCK_N, prefill_attn.NUM_WARPS,
              prefill_attn.NUM_STAGES)
    tiles = [engine] + [t for t in MLA_ATTN_TILES if t != engine]
    for q_len in (T, 3 * T // 8):
        q = q_all[T - q_len:]
        out = torch.empty(q_len, MLA_HEADS, V_DIM, device="cuda", dtype=torch.bfloat16)

        def by_flash():
            k, v = ref.mla_prefill_kv(kv, pe, nope, v_width=QK_DIM)
            qi, kt, vt = q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None]
            with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
                if q_len == T:
                    o = F.scaled_dot_product_attention(qi, kt, vt, is_causal=True, scale=scale)
                else:
                    o = F.scaled_dot_product_attention(
                        qi, kt, vt, scale=scale, attn_mask=causal_lower_right(q_len, T))
            out.copy_(o[0].transpose(0, 1)[..., :V_DIM])
            return out

        want = by_flash().float()
        cands = []
        for t in tiles:
            try:
                got = mla_prefill_attention(q, kv, pe, scale, out=out, tiles=t).float()
            except Exception as exc:
                print(f"  mla_attn {t}: {type(exc).__name__}: {str(exc)[:160]}", flush=True)
                continue
            err = ((got - want).norm() / want.norm()).item()
            print(f"  mla_attn {t}: relative error against flash {err:.2e}", flush=True)
            if err <= 1e-2:
                label = "in place " + ("(engine) " if t == engine else "") + str(t)
                cands.append((label, lambda t=t: mla_prefill_attention(q, kv, pe, scale,
                                                                       out=out, tiles=t)))
        cands.append(("cat + pad + flash SDPA (before)", by_flash))
        pairs = q_len * (T - q_len) + q_len * (q_len + 1) / 2
        flops = 2 * MLA_HEADS * pairs * (QK_DIM + V_DIM)
        run_candidates(rows, f"mla_prefill_attn {q_len}/{T}",
                       flops / (ceil["bf16_gemm_TFLOPs"] * 1e9), cands, deadline)


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
           "mla_attn": case_mla_attn}
    tokens = [int(t) for t in args.tokens.split(",")]
    per = args.time_budget / (len(cases) * len(tokens))
    for name in cases:
        for T in tokens:
            fns[name](rows, ceil, T, time.time() + per)
    write_results(args.out, meta, t0, ceil, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
