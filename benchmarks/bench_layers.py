"""Layer-level GPU benchmarks of the kdaserve kernels, each next to its byte or FLOP floor.

    python benchmarks/bench_layers.py [--out layers.json] [--tune]

Times with triton.testing.do_bench (median, L2 flushed before each run). Ceilings are measured in
the same run: a large device-to-device copy (bytes read + written) and a bf16 GEMM. For each case:
floor = max(bytes / copy_rate, flops / gemm_rate); ratio = floor / time (1.0 = at the floor).
Cases: MLA decode (B=1, 16; 8K context; 32 heads; 512+64 latent), MoE layer (N=1, 16, 8000; spread
and same-8-experts routing; Kimi-Linear-48B shapes), KDA prefill via fla-core chunk_kda (8K tokens),
the decode router (N=1, 4, 8, 16, 64: cuBLAS fp32 GEMM + top-k, on x cast to fp32 and on the
norm's fp32 copy).
--tune additionally sweeps tile configs of MLA decode and fused MoE and prints the best.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kdaserve.kernels import reference as ref  # noqa: E402
from kdaserve.kernels.mla import decode as mla  # noqa: E402
from kdaserve.kernels.moe import fused_moe as moe  # noqa: E402

# Kimi-Linear-48B-A3B
HEADS, KV_RANK, ROPE = 32, 512, 64
HIDDEN, MOE_INTER, EXPERTS, TOP_K = 2304, 1024, 256, 8
KDA_HEADS, KDA_DIM = 32, 128


def bench_ms(fn) -> float:
    import triton

    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def capture(fn) -> torch.cuda.CUDAGraph:
    """fn run once on a side stream (compiles, allocates), then captured in a CUDA graph."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    torch.cuda.synchronize()
    return graph


def bench_graph_ms(fn) -> float:
    """Median time of fn replayed from a CUDA graph (no Python/launch overhead: the decode path)."""
    return bench_ms(capture(fn).replay)


def time_case(fn) -> tuple[float, float | None]:
    """(eager ms, CUDA-graph ms or None when fn cannot be captured)."""
    eager = bench_ms(fn)
    try:
        graphed = bench_graph_ms(fn)
    except Exception as exc:  # not capturable (host sync inside): report eager only
        print(f"  (no CUDA graph: {type(exc).__name__}: {str(exc)[:80]})")
        graphed = None
    return eager, graphed


def git_commit() -> str:
    from kdaserve.bench.report import git_commit as commit

    return commit() or "unknown"


def bench_meta(**extra) -> dict:
    """What every kernel-bench JSON records about the run: command, GPU, versions, commit."""
    import triton

    return {"command": " ".join([sys.executable] + sys.argv),
            "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
            "triton": triton.__version__, "cuda": torch.version.cuda, "commit": git_commit(),
            **extra}


def write_results(out: str | None, meta: dict, t0: float, ceil: dict, results: list) -> None:
    """meta + wall time + ceilings + results as JSON at `out` (nothing when out is None)."""
    meta["wall_s"] = time.time() - t0
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps({**meta, "ceilings": ceil, "results": results}, indent=2))
        print(f"wrote {out}")


def pick_cases(ap, raw: str, known) -> list[str]:
    """The comma list `raw` as names, each in `known` (else an argparse error naming it)."""
    names = [c for c in raw.split(",") if c]
    unknown = [c for c in names if c not in known]
    if unknown:
        ap.error(f"unknown cases {unknown}; known: {list(known)}")
    return names


def start_gpu_run(name: str) -> tuple[float, dict, dict] | None:
    """(start time, bench_meta(), measure_ceilings()) with the seed set, the copy bandwidth
    printed; None (said on stderr) without CUDA."""
    if not torch.cuda.is_available():
        print(f"{name}: needs a CUDA GPU", file=sys.stderr)
        return None
    t0 = time.time()
    torch.manual_seed(0)
    meta = bench_meta()
    ceil = measure_ceilings()
    print(f"{meta['gpu']}: copy {ceil['copy_GBps']:.0f} GB/s", flush=True)
    return t0, meta, ceil


def measure_ceilings() -> dict:
    n = 1 << 30                                                    # 1 GiB each way
    src = torch.randn(n // 2, device="cuda", dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    copy_ms = bench_ms(lambda: dst.copy_(src))
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    gemm_ms = bench_ms(lambda: a @ b)
    del src, dst, a, b
    return {"copy_GBps": 2 * n / copy_ms / 1e6, "bf16_gemm_TFLOPs": 2 * 8192 ** 3 / gemm_ms / 1e9}


def record(results, ceil, name, times, nbytes, flops, **extra):
    """times = (eager ms, graph ms | None); the ratio uses the graph time when there is one."""
    eager, graphed = times
    ms = graphed if graphed is not None else eager
    floor_ms = max(nbytes / (ceil["copy_GBps"] * 1e6), flops / (ceil["bf16_gemm_TFLOPs"] * 1e9))
    row = {"case": name, "ms": ms, "eager_ms": eager, "graph_ms": graphed, "floor_ms": floor_ms,
           "ratio": floor_ms / ms, "bytes": nbytes, "flops": flops, "GBps": nbytes / ms / 1e6,
           "TFLOPs": flops / ms / 1e9, **extra}
    results.append(row)
    print(f"{name:<36} graph {_us(graphed)} eager {_us(eager)}  floor {floor_ms * 1e3:7.1f} us  "
          f"ratio {row['ratio']:.2f}  {row['GBps']:6.0f} GB/s {row['TFLOPs']:6.1f} TFLOP/s",
          flush=True)
    return row


def _us(ms):
    return f"{ms * 1e3:8.1f} us" if ms is not None else "       - us"


# ---------------------------------------------------------------------------------------------
# MLA decode
# ---------------------------------------------------------------------------------------------


def mla_inputs(batch, ctx, page):
    D = KV_RANK + ROPE
    blocks = ctx // page
    kv = torch.randn(batch * blocks + 1, page, D, device="cuda", dtype=torch.bfloat16)
    bt = torch.randperm(batch * blocks, device="cuda", dtype=torch.int32).view(batch, blocks)
    q = torch.randn(batch, HEADS, D, device="cuda", dtype=torch.bfloat16)
    seq_lens = torch.full((batch,), ctx, device="cuda", dtype=torch.int32)
    return q, kv, bt, seq_lens


def bench_mla(results, ceil, batch, ctx=8192, page=16, tune=False):
    q, kv, bt, seq_lens = mla_inputs(batch, ctx, page)
    scale = 192 ** -0.5
    out = torch.empty(batch, HEADS, KV_RANK, device="cuda", dtype=torch.bfloat16)
    nbytes = batch * ctx * (KV_RANK + ROPE) * 2 + q.numel() * 2 + out.numel() * 2
    flops = batch * HEADS * ctx * 2 * (KV_RANK + ROPE + KV_RANK)
    times = time_case(lambda: mla.mla_decode(q, kv, bt, seq_lens, scale, KV_RANK, out=out))
    record(results, ceil, f"mla_decode B={batch} ctx={ctx} page={page}", times, nbytes, flops)
    if not tune:
        return
    best = (times[1] or times[0], "default")
    for bh, bn, nw, ns, tr in [(32, 32, 4, 3, False), (32, 64, 8, 2, False), (32, 32, 8, 2, False),
                               (32, 64, 4, 2, True), (32, 64, 8, 2, True), (32, 128, 8, 2, True),
                               (32, 128, 4, 2, True), (32, 64, 4, 3, True),
                               (16, 64, 4, 2, False), (16, 32, 4, 2, False),
                               (16, 64, 8, 2, False), (16, 64, 4, 2, True)]:
        cfg = mla.MLADecodeConfig(bh, bn, nw, ns, tr)
        for splits in (None, 16, 32, 64, 128):
            try:
                t = bench_graph_ms(lambda: mla.mla_decode(q, kv, bt, seq_lens, scale, KV_RANK,
                                                          out=out, num_kv_splits=splits,
                                                          config=cfg))
            except Exception as exc:  # out of resources for a config: skip it
                print(f"  skip {cfg} splits={splits}: {type(exc).__name__}")
                continue
            if t < best[0]:
                best = (t, f"{cfg} splits={splits}")
    print(f"  best: {best[0] * 1e3:.1f} us with {best[1]}", flush=True)
    results[-1]["tune_best"] = {"ms": best[0], "config": best[1]}


# ---------------------------------------------------------------------------------------------
# MoE
# ---------------------------------------------------------------------------------------------


def moe_weights():
    w13 = torch.randn(EXPERTS, 2 * MOE_INTER, HIDDEN, device="cuda", dtype=torch.bfloat16) * 0.02
    w2 = torch.randn(EXPERTS, HIDDEN, MOE_INTER, device="cuda", dtype=torch.bfloat16) * 0.02
    return w13, w2


def moe_routing(n, same):
    logits = torch.randn(n, EXPERTS, device="cuda")
    weights, ids = ref.moe_topk_sigmoid(logits, torch.zeros(EXPERTS, device="cuda"), TOP_K,
                                        True, 2.446)
    if same:
        ids = torch.randperm(EXPERTS, device="cuda")[:TOP_K].expand(n, TOP_K).contiguous()
    return weights, ids.int()


def bench_moe(results, ceil, w13, w2, n, same, tune=False, torch_baseline=True):
    x = torch.randn(n, HIDDEN, device="cuda", dtype=torch.bfloat16)
    weights, ids = moe_routing(n, same)
    touched = int(torch.unique(ids).numel())
    expert_bytes = 3 * HIDDEN * MOE_INTER * 2
    nbytes = touched * expert_bytes + 2 * x.numel() * 2
    flops = 2 * n * TOP_K * 3 * HIDDEN * MOE_INTER
    out = torch.empty_like(x)
    times = time_case(lambda: moe.fused_moe(x, w13, w2, weights, ids, out=out))
    extra = {"touched_experts": touched}
    if torch_baseline:
        extra["torch_loop_ms"] = bench_ms(lambda: ref.moe_experts(x, w13, w2, weights, ids))
    routing = "same8" if same else "spread"
    row = record(results, ceil, f"fused_moe N={n} {routing}", times, nbytes, flops, **extra)
    if n == 1:
        bench_moe_gemm2_sum(results, ceil, row, x, w13, w2, weights, ids, out, nbytes, flops,
                             tune)
    if not tune:
        return
    C = moe.MoEGemmConfig
    if n <= 32:
        cands = [(C(16, bn, bk, 1, nw, ns), C(16, bn2, bk2, 1, nw2, ns2))
                 for bn, bk, nw, ns in [(32, 128, 4, 4), (64, 128, 4, 4), (32, 256, 4, 3),
                                        (64, 64, 4, 5), (16, 256, 4, 4)]
                 for bn2, bk2, nw2, ns2 in [(32, 128, 4, 4), (64, 128, 4, 4), (32, 256, 4, 3)]]
    else:
        cands = [(C(bm, bn, bk, gm, nw, ns), C(bm, bn2, bk, gm, nw2, ns2))
                 for bm, bn, bk, gm, nw, ns in [(128, 128, 64, 8, 8, 3), (128, 128, 64, 8, 8, 4),
                                                (128, 64, 64, 8, 4, 4), (64, 128, 64, 8, 4, 4),
                                                (128, 128, 32, 8, 8, 4), (128, 64, 64, 8, 8, 4)]
                 for bn2, nw2, ns2 in [(256, 8, 3), (128, 8, 4), (128, 4, 4)]]
    best = (times[1] or times[0], "default")
    # N == 1 runs gemm1 + the fused GEMM 2 + sum: sweep gemm1 with the default gemm2_sum tiles
    # (gemm2 is unused there, so each gemm1 candidate runs once)
    gemm2_sum = moe_default_config(w13, n, ids.shape[1]).gemm2_sum if n == 1 else None
    seen = set()
    for c1, c2 in cands:
        cfg = moe.FusedMoEConfig(c1, c2, gemm2_sum)
        if (c1, None if gemm2_sum else c2) in seen:
            continue
        seen.add((c1, None if gemm2_sum else c2))
        try:
            t = bench_graph_ms(lambda: moe.fused_moe(x, w13, w2, weights, ids, out=out,
                                                     config=cfg))
        except Exception as exc:
            print(f"  skip {cfg}: {type(exc).__name__}")
            continue
        if t < best[0]:
            best = (t, str(cfg))
    print(f"  best: {best[0] * 1e3:.1f} us with {best[1]}", flush=True)
    row["tune_best"] = {"ms": best[0], "config": best[1]}


def moe_default_config(w13, n, top_k):
    """What fused_moe picks for n tokens on these weights (default_config, fitted)."""
    E, two_i, D = w13.shape
    return moe.fit_config(moe.default_config(n, top_k, E, w13.dtype), D, two_i // 2)


def bench_moe_gemm2_sum(results, ceil, row, x, w13, w2, weights, ids, out, nbytes, flops,
                         tune):
    """N == 1: `row` timed the default (gemm1 + the fused GEMM 2 + top-k sum); add a row for the
    old path (gemm2 + moe_sum, gemm2_sum=None) and the speedup to `row`. --tune sweeps the
    gemm2_sum tiles and records the best in row["tune_best_gemm2_sum"]."""
    from dataclasses import replace

    new_cfg = moe_default_config(w13, 1, ids.shape[1])
    old_cfg = replace(new_cfg, gemm2_sum=None)
    old = record(results, ceil, row["case"] + " gemm2+moe_sum", time_case(
        lambda: moe.fused_moe(x, w13, w2, weights, ids, out=out, config=old_cfg)), nbytes, flops)
    row["gemm2_sum"] = str(new_cfg.gemm2_sum)
    row["gemm2_sum_speedup"] = old["ms"] / row["ms"]
    print(f"  gemm2_sum fused vs gemm2 + moe_sum: {row['gemm2_sum_speedup']:.2f}x", flush=True)
    if not tune:
        return
    C = moe.MoEGemmConfig
    best = (row["ms"], str(new_cfg.gemm2_sum))
    for bn in (4, 8, 16, 32):
        for bk in (256, 512, 1024):
            for nw in (4, 8):
                for ns in (2, 3, 4):
                    cfg = replace(new_cfg, gemm2_sum=C(1, bn, bk, 1, nw, ns))
                    try:
                        t = bench_graph_ms(lambda: moe.fused_moe(x, w13, w2, weights, ids,
                                                                 out=out, config=cfg))
                    except Exception as exc:  # out of resources for a config: skip it
                        print(f"  skip {cfg.gemm2_sum}: {type(exc).__name__}")
                        continue
                    if t < best[0]:
                        best = (t, str(cfg.gemm2_sum))
    print(f"  best gemm2_sum: {best[0] * 1e3:.1f} us with {best[1]}", flush=True)
    row["tune_best_gemm2_sum"] = {"ms": best[0], "config": best[1]}


# ---------------------------------------------------------------------------------------------
# KDA prefill (fla-core chunk_kda)
# ---------------------------------------------------------------------------------------------


def bench_kda(results, ceil, T=8192):
    try:
        from fla.ops.kda import chunk_kda
    except Exception as exc:  # fla-core missing or broken
        print(f"kda chunk prefill: skipped (fla-core not importable: {exc})")
        results.append({"case": f"kda_chunk T={T}", "skipped": str(exc)})
        return
    H, K = KDA_HEADS, KDA_DIM
    q, k, v = (torch.randn(1, T, H, K, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    g = torch.nn.functional.logsigmoid(torch.randn(1, T, H, K, device="cuda")) * 0.1  # log decay
    beta = torch.rand(1, T, H, device="cuda", dtype=torch.bfloat16)
    fn = lambda: chunk_kda(q, k, v, g, beta, use_qk_l2norm_in_kernel=True,  # noqa: E731
                           output_final_state=True)
    with torch.inference_mode():
        fn()
        times = (bench_ms(fn), None)
    # q, k, v, o bf16; g fp32; beta bf16; final state fp32
    nbytes = T * H * K * (4 * 2 + 4) + T * H * 2 + H * K * K * 4
    C = 64
    per_chunk_head = 3 * 2 * C * K * K + 2 * C * C * (4 * K) + C ** 3 // 3
    flops = (T // C) * H * per_chunk_head
    record(results, ceil, f"kda_chunk (fla) T={T} H={H}", times, nbytes, flops)


# ---------------------------------------------------------------------------------------------
# Router
# ---------------------------------------------------------------------------------------------


def bench_router(results, ceil, n):
    """The decode router: cuBLAS fp32 GEMM + top-k kernel, on bf16 x cast to fp32 (the old
    path) and on the fp32 copy the preceding norm writes. Bytes: the fp32 router weight."""
    from kdaserve.kernels.moe.router import moe_topk_sigmoid
    from kdaserve.layers.linear import linear

    x = torch.randn(n, HIDDEN, device="cuda", dtype=torch.bfloat16)
    x32 = x.float()
    w = torch.randn(EXPERTS, HIDDEN, device="cuda") / HIDDEN ** 0.5
    b = torch.randn(EXPERTS, device="cuda") * 0.1

    def cast():
        logits = linear(x, w, False, torch.float32)
        return moe_topk_sigmoid(logits, b, TOP_K, True, 2.446, extra_expert=EXPERTS)

    def fp32_in():
        logits = torch.nn.functional.linear(x32, w)
        return moe_topk_sigmoid(logits, b, TOP_K, True, 2.446, extra_expert=EXPERTS)

    nbytes, flops = w.numel() * 4 + x.numel() * 2, 2 * n * HIDDEN * EXPERTS
    record(results, ceil, f"router cast+GEMM+topk N={n}", time_case(cast), nbytes, flops)
    record(results, ceil, f"router fp32-in GEMM+topk N={n}", time_case(fp32_in), nbytes, flops)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", help="write the results as JSON here")
    ap.add_argument("--tune", action="store_true", help="also sweep tile configs")
    ap.add_argument("--skip", default="", help="comma list of mla,moe,kda,router to skip")
    ap.add_argument("--moe-tokens", default="1,16,8000",
                    help="comma list of MoE token counts (default 1,16,8000)")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_layers: needs a CUDA GPU", file=sys.stderr)
        return 2
    t0 = time.time()
    skip = set(filter(None, args.skip.split(",")))
    torch.manual_seed(0)
    meta = bench_meta()
    ceil = measure_ceilings()
    print(f"{meta['gpu']}: copy {ceil['copy_GBps']:.0f} GB/s, bf16 GEMM "
          f"{ceil['bf16_gemm_TFLOPs']:.0f} TFLOP/s", flush=True)
    results: list[dict] = []
    if "mla" not in skip:
        for batch in (1, 16):
            bench_mla(results, ceil, batch, tune=args.tune)
        bench_mla(results, ceil, 16, page=64)
    if "moe" not in skip:
        w13, w2 = moe_weights()
        for n in map(int, args.moe_tokens.split(",")):
            for same in (False, True):
                bench_moe(results, ceil, w13, w2, n, same,
                          tune=args.tune and not same and n != 16)
        del w13, w2
    if "kda" not in skip:
        bench_kda(results, ceil)
    if "router" not in skip:
        for n in (1, 4, 8, 16, 64):
            bench_router(results, ceil, n)
    write_results(args.out, meta, t0, ceil, results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
