"""One-token MoE expert path (single_token.py, two GEMVs) vs fused_moe at N = 1, on one GPU.

    python benchmarks/bench_moe_single.py [--out moe_single.json] [--tune] [--seed 0]

Kimi-Linear-48B decode shapes: E = 257 (256 routed + the folded shared expert), D = 2304,
I = 1024, k = 9 (sigmoid top-8 + the shared one), bf16. CUDA-graph replay timing through
bench_layers.py (median, L2 flushed before each replay); floor = bytes of the experts touched
(+ activations) / measured copy bandwidth, ratio = floor / time. Cases: fused_moe N=1, the
single-token path, and each of its two launches alone. --tune sweeps tile sizes, num_warps and
num_stages of each launch separately, then times the best pair end to end.
"""

from __future__ import annotations

import argparse
import itertools
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_layers import (bench_graph_ms, bench_meta, measure_ceilings, record,  # noqa: E402
                          time_case, write_results)
from kdaserve.kernels import reference as ref  # noqa: E402
from kdaserve.kernels.moe import single_token as st  # noqa: E402
from kdaserve.kernels.moe.fused_moe import fused_moe  # noqa: E402

EXPERTS, HIDDEN, INTER, ROUTED_K = 257, 2304, 1024, 8     # + 1 shared = k = 9
BF16_BYTES, F32_BYTES = 2, 4


def make_problem(seed: int) -> dict:
    g = torch.Generator(device="cuda").manual_seed(seed)
    w13 = torch.randn(EXPERTS, 2 * INTER, HIDDEN, generator=g, device="cuda",
                      dtype=torch.bfloat16) * 0.02                                # [E, 2I, D]
    w2 = torch.randn(EXPERTS, HIDDEN, INTER, generator=g, device="cuda",
                     dtype=torch.bfloat16) * 0.02                                 # [E, D, I]
    x = torch.randn(1, HIDDEN, generator=g, device="cuda", dtype=torch.bfloat16)  # [1, D]
    logits = torch.randn(1, EXPERTS - 1, generator=g, device="cuda")
    weights, ids = ref.moe_topk_sigmoid(logits, torch.zeros(EXPERTS - 1, device="cuda"),
                                        ROUTED_K, True, 2.446)
    weights = torch.cat([weights, torch.ones(1, 1, device="cuda")], 1)           # [1, k] fp32
    ids = torch.cat([ids.int(), torch.full((1, 1), EXPERTS - 1, device="cuda",
                                           dtype=torch.int32)], 1)               # [1, k]
    top_k = ids.shape[1]
    return {"x": x, "w13": w13, "w2": w2, "weights": weights, "ids": ids,
            "out": torch.empty_like(x),
            "inter": torch.empty(top_k, INTER, dtype=st.INTER_DTYPE, device="cuda"),
            "flat_ids": ids.reshape(-1).contiguous(),
            "flat_w": weights.reshape(-1).contiguous(),
            "touched": int(torch.unique(ids).numel()), "top_k": top_k}


def stage_bytes(p: dict) -> dict:
    """Bytes each launch must move at least: the touched experts' weights + activations."""
    inter_bytes = p["top_k"] * INTER * F32_BYTES
    act = HIDDEN * BF16_BYTES                                   # x in, or out
    w1 = p["touched"] * 2 * INTER * HIDDEN * BF16_BYTES
    w2 = p["touched"] * HIDDEN * INTER * BF16_BYTES
    return {"gemv1": w1 + act + inter_bytes, "gemv2": w2 + inter_bytes + act,
            "layer": w1 + w2 + 2 * act}


def flops(p: dict, which: str) -> int:
    per = {"gemv1": 2 * 2, "gemv2": 2, "layer": 2 * 3}[which]
    return per * p["top_k"] * HIDDEN * INTER


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def check(p: dict) -> dict:
    """Relative errors of both paths vs the fp64 reference on the touched experts."""
    single = st.fused_moe_single_token(p["x"], p["w13"], p["w2"], p["weights"], p["ids"])
    fused = fused_moe(p["x"], p["w13"], p["w2"], p["weights"], p["ids"])
    e = p["ids"][0].long()
    local = torch.arange(p["top_k"], device="cuda")[None]
    want = ref.moe_experts(p["x"].double(), p["w13"][e].double(), p["w2"][e].double(),
                           p["weights"], local)
    errs = {"single_vs_ref": rel_err(single, want), "fused_vs_ref": rel_err(fused, want),
            "single_vs_fused": rel_err(single, fused)}
    print("  rel err: " + ", ".join(f"{k} {v:.2e}" for k, v in errs.items()), flush=True)
    return errs


def run_single(p: dict, cfg: st.SingleTokenMoEConfig | None = None):
    return st.fused_moe_single_token(p["x"], p["w13"], p["w2"], p["weights"], p["ids"],
                                     out=p["out"], config=cfg)


def run_gemv1(p: dict, c: st.GemvConfig):
    return st.single_token_gemv1(p["x"], p["w13"], p["flat_ids"], p["inter"], c)


def run_gemv2(p: dict, c: st.GemvConfig):
    return st.single_token_gemv2(p["inter"], p["w2"], p["flat_w"], p["flat_ids"], p["out"], c)


def bench_cases(results, ceil, p, cfg) -> None:
    nb = stage_bytes(p)
    extra = {"touched_experts": p["touched"], "top_k": p["top_k"]}
    fused = record(results, ceil, "fused_moe N=1", time_case(
        lambda: fused_moe(p["x"], p["w13"], p["w2"], p["weights"], p["ids"], out=p["out"])),
        nb["layer"], flops(p, "layer"), **extra)
    single = record(results, ceil, "single_token", time_case(lambda: run_single(p, cfg)),
                    nb["layer"], flops(p, "layer"), config=str(cfg), **extra)
    record(results, ceil, "single_token gemv1", time_case(lambda: run_gemv1(p, cfg.gemv1)),
           nb["gemv1"], flops(p, "gemv1"), config=str(cfg.gemv1), **extra)
    record(results, ceil, "single_token gemv2+sum", time_case(lambda: run_gemv2(p, cfg.gemv2)),
           nb["gemv2"], flops(p, "gemv2"), config=str(cfg.gemv2), **extra)
    speedup = fused["ms"] / single["ms"]
    single["speedup_vs_fused"] = speedup
    print(f"  single_token vs fused_moe: {speedup:.2f}x", flush=True)


def gemv_candidates(rows_opts, acc_regs: int, stages) -> list[st.GemvConfig]:
    """Tiles whose fp32 accumulators (rows x block_k, over all threads) need at most acc_regs
    registers a thread: gemv1 holds two (gate, up), gemv2 one."""
    cands = []
    for rows, bk, nw, ns in itertools.product(rows_opts, (128, 256, 512, 1024), (2, 4, 8),
                                              stages):
        if rows * bk // (nw * 32) <= acc_regs:
            cands.append(st.GemvConfig(rows, bk, nw, ns))
    return cands


def sweep(name, fn, cands, nbytes, ceil) -> tuple[float, st.GemvConfig | None, list]:
    best, rows = (float("inf"), None), []
    for c in cands:
        try:
            ms = bench_graph_ms(lambda: fn(c))
        except Exception as exc:  # out of resources for a config: skip it
            print(f"  skip {c}: {type(exc).__name__}")
            continue
        rows.append({"config": str(c), "ms": ms})
        if ms < best[0]:
            best = (ms, c)
    floor = nbytes / (ceil["copy_GBps"] * 1e6)
    print(f"  {name} best: {best[0] * 1e3:.1f} us (floor {floor * 1e3:.1f} us) with {best[1]} "
          f"of {len(rows)} configs", flush=True)
    return best[0], best[1], rows


def tune(results, ceil, p, stages) -> dict:
    """Each launch alone over its candidates (gemv1: 9 x 1024 / rows programs; gemv2:
    2304 / rows), then the best pair end to end."""
    nb = stage_bytes(p)
    run_gemv1(p, st.DEFAULT_CONFIG.gemv1)                        # inter for gemv2 timings
    ms1, c1, rows1 = sweep("gemv1", lambda c: run_gemv1(p, c),
                           gemv_candidates((4, 8, 16, 32), 32, stages), nb["gemv1"], ceil)
    ms2, c2, rows2 = sweep("gemv2", lambda c: run_gemv2(p, c),
                           gemv_candidates((2, 4, 8, 16), 64, stages), nb["gemv2"], ceil)
    out = {"gemv1_ms": ms1, "gemv2_ms": ms2, "gemv1_all": rows1, "gemv2_all": rows2}
    if c1 is not None and c2 is not None:
        best = st.SingleTokenMoEConfig(c1, c2)
        row = record(results, ceil, "single_token tuned", time_case(lambda: run_single(p, best)),
                     nb["layer"], flops(p, "layer"), config=str(best))
        out.update(best=str(best), layer_ms=row["ms"])
        print(f"  paste: {best!r}", flush=True)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", help="write the results as JSON here")
    ap.add_argument("--tune", action="store_true", help="sweep the tile configs of both launches")
    ap.add_argument("--seed", type=int, default=0, help="weights, token and routing seed")
    ap.add_argument("--stages", default="1,3", help="num_stages values --tune tries (comma list)")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_moe_single: needs a CUDA GPU", file=sys.stderr)
        return 2
    t0 = time.time()
    meta = bench_meta(shapes={"E": EXPERTS, "D": HIDDEN, "I": INTER, "k": ROUTED_K + 1})
    ceil = measure_ceilings()
    print(f"{meta['gpu']}: copy {ceil['copy_GBps']:.0f} GB/s", flush=True)
    p = make_problem(args.seed)
    meta["errors"] = check(p)
    cfg = st.fit_single_config(st.DEFAULT_CONFIG, HIDDEN, INTER)
    results: list[dict] = []
    bench_cases(results, ceil, p, cfg)
    if args.tune:
        stages = tuple(int(v) for v in args.stages.split(","))
        meta["tune"] = tune(results, ceil, p, stages)
    write_results(args.out, meta, t0, ceil, results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
