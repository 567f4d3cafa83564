"""Decode GEMV (kdaserve.kernels.linear.gemv) vs cuBLAS F.linear at the Kimi-Linear-48B shapes.

    python benchmarks/bench_gemv.py [--out gemv.json] [--tune] [--shapes qkv,o_proj] [--m 1,4]

Both are timed as CUDA-graph replays (bench_layers.bench_graph_ms: median, L2 flushed before each
replay). floor = (weight + x + out bytes) / the copy bandwidth measured in the same run;
ratio = floor / time (1.0 = at the floor). The router row's cuBLAS baseline is today's path,
F.linear(x.float(), w) (a conversion launch plus an fp32 GEMM); gemv reads bf16 x and the fp32
weight directly and writes fp32. --tune sweeps block_n x block_k x num_warps x num_stages per
case (configs that fail to compile, hold > MAX_ELEMS_PER_THREAD tile elements per thread, or give
wrong results are skipped) and prints the best, and a summary table at the end. The sweep is
168 configs per case, each compiled and timed (~0.2 s a timing plus compiles): an estimate of
~15 min for all 12 cases, so split it with --shapes / --m to stay under a 10 min command limit.
"""

from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

from bench_layers import (bench_graph_ms, pick_cases, start_gpu_run,  # noqa: E402
                          write_results)
from kdaserve.kernels.linear.gemv import (GemvConfig, default_config, gemv,  # noqa: E402
                                          gemv_reference)

BF16, F32 = torch.bfloat16, torch.float32
# name: (N, K, weight dtype) of Kimi-Linear-48B decode linears
SHAPES = {
    "qkv": (12288, 2304, BF16),
    "o_proj": (2304, 4096, BF16),
    "mla_q_kv_a": (6720, 2304, BF16),
    "low_rank_heads": (288, 2304, BF16),
    "router_fp32": (256, 2304, F32),
    "dense_gate_up": (22528, 2304, BF16),
}
TUNE_BLOCK_N, TUNE_BLOCK_K = (4, 8, 16, 32, 64), (128, 256, 512, 1024)
TUNE_WARPS, TUNE_STAGES = (2, 4, 8), (2, 3, 4)
MAX_ELEMS_PER_THREAD = 256
DEVICE = "cuda"


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double(), ref.double()
    return ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def make_case(M, N, K, w_dtype):
    """x bf16 [M, K], weight [N, K] of w_dtype, out dtype (fp32 for an fp32 weight)."""
    x = torch.randn(M, K, device=DEVICE, dtype=BF16)                  # [M, K]
    w = (torch.randn(N, K, device=DEVICE) * K ** -0.5).to(w_dtype)    # [N, K]
    out_dtype = F32 if w_dtype == F32 else BF16
    return x, w, out_dtype


def cublas_fn(x, w):
    if w.dtype != x.dtype:
        return lambda: F.linear(x.float(), w)                       # today's router path
    return lambda: F.linear(x, w)


def case_bytes(x, w, out_dtype) -> int:
    out_size = torch.empty((), dtype=out_dtype).element_size()
    return (w.numel() * w.element_size() + x.numel() * x.element_size()
            + x.shape[0] * w.shape[0] * out_size)


def time_gemv(x, w, out, config=None):
    """(graph ms, relative error vs gemv_reference) of one config."""
    gemv(x, w, out=out, config=config)
    err = rel_err(out, gemv_reference(x, w, out.dtype))
    return bench_graph_ms(lambda: gemv(x, w, out=out, config=config)), err


def tune_configs(N):
    for bn, bk, nw, ns in itertools.product(TUNE_BLOCK_N, TUNE_BLOCK_K, TUNE_WARPS, TUNE_STAGES):
        if bn * bk // (32 * nw) > MAX_ELEMS_PER_THREAD or bn > max(4, N):
            continue
        yield GemvConfig(bn, bk, nw, ns)


def tune(x, w, out, floor_ms, default_ms):
    best_ms, best_cfg, tried, skipped = default_ms, "default", 0, 0
    for cfg in tune_configs(w.shape[0]):
        try:
            ms, err = time_gemv(x, w, out, cfg)
        except Exception as exc:  # out of resources / compile failure: skip the config
            print(f"  skip {cfg}: {type(exc).__name__}: {str(exc)[:60]}")
            skipped += 1
            continue
        tried += 1
        if err > 1e-2:
            print(f"  WRONG {cfg}: relative error {err:.2e} (skipped)")
            skipped += 1
            continue
        if ms < best_ms:
            best_ms, best_cfg = ms, cfg
    print(f"  best: {best_ms * 1e3:.1f} us (ratio {floor_ms / best_ms:.2f}) with {best_cfg}; "
          f"{tried} timed, {skipped} skipped", flush=True)
    return {"ms": best_ms, "ratio": floor_ms / best_ms, "config": str(best_cfg),
            "tried": tried, "skipped": skipped}


def bench_case(name, M, ceil, do_tune):
    N, K, w_dtype = SHAPES[name]
    x, w, out_dtype = make_case(M, N, K, w_dtype)
    out = torch.empty(M, N, device=DEVICE, dtype=out_dtype)           # [M, N]
    nbytes = case_bytes(x, w, out_dtype)
    floor_ms = nbytes / (ceil["copy_GBps"] * 1e6)
    cublas_ms = bench_graph_ms(cublas_fn(x, w))
    gemv_ms, err = time_gemv(x, w, out)
    cfg = default_config(M, N, K, w_dtype, x.device)
    row = {"case": name, "M": M, "N": N, "K": K, "weight_dtype": str(w_dtype),
           "out_dtype": str(out_dtype), "bytes": nbytes, "floor_us": floor_ms * 1e3,
           "cublas_us": cublas_ms * 1e3, "cublas_GBps": nbytes / cublas_ms / 1e6,
           "cublas_ratio": floor_ms / cublas_ms, "gemv_us": gemv_ms * 1e3,
           "gemv_GBps": nbytes / gemv_ms / 1e6, "gemv_ratio": floor_ms / gemv_ms,
           "speedup": cublas_ms / gemv_ms, "gemv_config": str(cfg), "gemv_rel_err": err}
    print(f"{name:<15} M={M} N={N:<6} K={K:<5} floor {floor_ms * 1e3:6.1f} us | cuBLAS "
          f"{cublas_ms * 1e3:6.1f} us {row['cublas_GBps']:5.0f} GB/s ratio "
          f"{row['cublas_ratio']:.2f} | gemv {gemv_ms * 1e3:6.1f} us {row['gemv_GBps']:5.0f} GB/s "
          f"ratio {row['gemv_ratio']:.2f} | x{row['speedup']:.2f} err {err:.1e}", flush=True)
    if do_tune:
        row["tune_best"] = tune(x, w, out, floor_ms, gemv_ms)
    return row


def print_tune_summary(results):
    print("\nbest configs (paste into default_config after reading them):")
    for r in results:
        if "tune_best" in r:
            b = r["tune_best"]
            print(f"  {r['case']:<15} M={r['M']} {b['ms'] * 1e3:6.1f} us ratio {b['ratio']:.2f} "
                  f"(default {r['gemv_us']:6.1f} us, cuBLAS {r['cublas_us']:6.1f} us)  "
                  f"{b['config']}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", help="write the results as JSON here")
    ap.add_argument("--tune", action="store_true", help="also sweep GemvConfig per case")
    ap.add_argument("--shapes", default=",".join(SHAPES),
                    help=f"comma list of cases (default all: {','.join(SHAPES)})")
    ap.add_argument("--m", default="1,4", help="comma list of row counts M (1..4)")
    args = ap.parse_args(argv)
    names = pick_cases(ap, args.shapes, SHAPES)
    run = start_gpu_run("bench_gemv")
    if run is None:
        return 2
    t0, meta, ceil = run
    results = [bench_case(name, int(m), ceil, args.tune)
               for name in names for m in args.m.split(",") if m]
    if args.tune:
        print_tune_summary(results)
    write_results(args.out, meta, t0, ceil, results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
