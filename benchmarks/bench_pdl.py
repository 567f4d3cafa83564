"""Programmatic dependent launch (PDL) on a batch-1 decode-layer chain, in one CUDA graph.

    python benchmarks/bench_pdl.py [--out pdl.json] [--layers 20] [--reps 200] [--m 1] [--tune]

One layer of the chain (Kimi-Linear-48B KDA layer shapes, bf16):
    x, res = add_rms_norm(h, norm_w, 1e-5, res)     # [M, 2304]
    proj = x @ in_w.T                                # [M, 12576]: the fused KDA input projection
                                                     #   q|k|v 3 x 4096 + f_a 128 + g_a 128 + b 32
    h = proj[:, :4096] @ o_w.T                       # [M, 2304]: o_proj [2304, 4096]
repeated for --layers layers inside ONE CUDA graph, each layer with its own weights (20 layers
are 1.5 GB of weights: the 50 MB L2 holds none of them from one replay to the next).
Modes: cublas (F.linear + our norm), triton (our gemv + norm), pdl (both launched with PDL, the
gemv waits before any load: prefetch 0), pdl_prefetch1 / pdl_prefetch2 (the gemv loads 1 / 2
weight tiles before griddepcontrol.wait). Each replay of the graph is timed alone with CUDA
events; the median of --reps replays / layers = us per layer. floor = a layer's weight bytes /
the copy bandwidth measured in the same run (bench_layers.measure_ceilings). The same is done
for chains of one GEMV shape (--layers launches of in_proj or o_proj, distinct weights).
--tune sweeps block_n x block_k x num_warps x prefetch of the PDL gemv on those one-shape chains
and prints the best per shape (--in-config / --o-config run the layer chain with a chosen tile).
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

from bench_layers import (HIDDEN, KDA_DIM, KDA_HEADS, bench_meta, capture,  # noqa: E402
                          measure_ceilings, write_results)
from kdaserve.kernels.linear.gemv import GemvConfig, default_config, gemv  # noqa: E402
from kdaserve.kernels.norm.rms_norm import add_rms_norm  # noqa: E402

BF16 = torch.bfloat16
P = KDA_HEADS * KDA_DIM                                    # 4096: q, k, v and o_proj's K
IN_N = 3 * P + 2 * KDA_DIM + KDA_HEADS                     # 12576: q|k|v|f_a|g_a|b rows
SHAPES = {"in_proj": (IN_N, HIDDEN), "o_proj": (HIDDEN, P)}   # name: (N, K)
MODES = ("cublas", "triton", "pdl", "pdl_prefetch1", "pdl_prefetch2")
L2_BYTES = 50 * 2 ** 20
EPS = 1e-5
TUNE_BLOCK_N, TUNE_BLOCK_K = (4, 8, 16, 32, 64), (128, 256, 512, 1024)
TUNE_WARPS, TUNE_PREFETCH = (2, 4, 8), (1, 2)
MAX_ELEMS_PER_THREAD = 256                                 # as bench_gemv: one tile per thread


def mode_prefetch(mode: str) -> int | None:
    """Weight tiles the gemv loads before its wait; None for the modes without PDL."""
    return {"pdl": 0, "pdl_prefetch1": 1, "pdl_prefetch2": 2}.get(mode)


# ---------------------------------------------------------------------------------------------
# timing
# ---------------------------------------------------------------------------------------------


def time_graph_ms(graph: torch.cuda.CUDAGraph, reps: int, warmup: int = 10) -> float:
    """Median ms of `reps` replays of graph, each between its own pair of CUDA events."""
    for _ in range(warmup):
        graph.replay()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for start, end in zip(starts, ends):
        start.record()
        graph.replay()
        end.record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends))


# ---------------------------------------------------------------------------------------------
# the layer chain
# ---------------------------------------------------------------------------------------------


def make_layers(n: int) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """n layers of (norm weight [2304], in_w [12576, 2304], o_w [2304, 4096]), all distinct."""
    def weight(N, K):
        return torch.randn(N, K, device="cuda", dtype=BF16) * K ** -0.5   # [N, K]

    return [(torch.rand(HIDDEN, device="cuda", dtype=BF16) + 0.5, weight(*SHAPES["in_proj"]),
             weight(*SHAPES["o_proj"])) for _ in range(n)]


def layer_bytes() -> int:
    """Weight bytes one layer streams: norm weight + in_proj + o_proj (bf16)."""
    return 2 * (HIDDEN + IN_N * HIDDEN + HIDDEN * P)


def chain_fn(mode, layers, h, res, in_cfg=None, o_cfg=None):
    """A function running the whole layer chain in `mode` from (h, res) ([M, 2304] each);
    returns the last (h, res). in_cfg / o_cfg: GemvConfig of the two GEMVs (None: default)."""
    prefetch = mode_prefetch(mode)
    pdl = prefetch is not None
    M = h.shape[0]

    def cfg(base, N, K):
        c = base or default_config(M, N, K, BF16, h.device)
        return GemvConfig(c.block_n, c.block_k, c.num_warps, c.num_stages, prefetch or 0)

    cfg_in, cfg_o = cfg(in_cfg, *SHAPES["in_proj"]), cfg(o_cfg, *SHAPES["o_proj"])

    def run():
        x_h, x_res = h, res
        for norm_w, in_w, o_w in layers:
            x, x_res = add_rms_norm(x_h, norm_w, EPS, x_res, pdl=pdl)          # [M, 2304]
            if mode == "cublas":
                proj = F.linear(x, in_w)                                         # [M, 12576]
                x_h = F.linear(proj[:, :P], o_w)                                 # [M, 2304]
            else:
                proj = gemv(x, in_w, config=cfg_in, pdl=pdl)                     # [M, 12576]
                x_h = gemv(proj[:, :P], o_w, config=cfg_o, pdl=pdl)              # [M, 2304]
        return x_h, x_res

    return run, (cfg_in, cfg_o)


def check_modes(layers, h, res, modes) -> dict:
    """Eager outputs of every mode vs `triton`: 'bitwise' / relative error (cuBLAS rounds
    differently). PDL modes must match triton bit for bit (same reduction order)."""
    want = chain_fn("triton", layers, h, res)[0]()[0]
    report = {}
    for mode in modes:
        got = chain_fn(mode, layers, h, res)[0]()[0]
        err = ((got.double() - want.double()).norm() / want.double().norm()).item()
        report[mode] = "bitwise" if torch.equal(got, want) else f"rel_err {err:.2e}"
    print("outputs vs triton: " + ", ".join(f"{m} {v}" for m, v in report.items()), flush=True)
    return report


def bench_layer_chain(args, ceil, results, layers, in_cfg, o_cfg):
    h = torch.randn(args.m, HIDDEN, device="cuda", dtype=BF16)
    res = torch.randn(args.m, HIDDEN, device="cuda", dtype=BF16)
    modes = [m for m in args.modes.split(",") if m]
    equal = check_modes(layers, h, res, modes)
    floor_us = layer_bytes() / (ceil["copy_GBps"] * 1e3)
    print(f"layer chain: {len(layers)} x [norm -> in_proj {SHAPES['in_proj']} -> o_proj "
          f"{SHAPES['o_proj']}], M={args.m}; floor {floor_us:.1f} us per layer", flush=True)
    base_us = None
    for mode in modes:
        run, cfgs = chain_fn(mode, layers, h, res, in_cfg, o_cfg)
        ms = time_graph_ms(capture(run), args.reps)
        us = ms * 1e3 / len(layers)
        base_us = us if mode == "triton" else base_us
        row = {"case": "layer_chain", "mode": mode, "M": args.m, "layers": len(layers),
               "us_per_layer": us, "graph_ms": ms, "floor_us": floor_us,
               "ratio": floor_us / us, "bytes_per_layer": layer_bytes(),
               "in_config": None if mode == "cublas" else str(cfgs[0]),
               "o_config": None if mode == "cublas" else str(cfgs[1]),
               "vs_triton": equal[mode]}
        gain = f"  {base_us - us:+6.2f} us vs triton" if base_us is not None else ""
        print(f"  {mode:<14} {us:7.2f} us/layer  ratio {row['ratio']:.2f}{gain}", flush=True)
        results.append(row)


# ---------------------------------------------------------------------------------------------
# one-shape chains and --tune
# ---------------------------------------------------------------------------------------------


def shape_chain(name, M, n):
    """x [M, K], out [M, N] and n distinct [N, K] weights of one GEMV shape."""
    N, K = SHAPES[name]
    x = torch.randn(M, K, device="cuda", dtype=BF16)
    out = torch.empty(M, N, device="cuda", dtype=BF16)
    ws = [torch.randn(N, K, device="cuda", dtype=BF16) * K ** -0.5 for _ in range(n)]
    return x, out, ws


def time_shape(x, out, ws, reps, config=None, pdl=False, cublas=False) -> float:
    """us per GEMV of len(ws) launches (same x and out, distinct weights) in one graph."""
    def run():
        for w in ws:
            if cublas:
                torch.matmul(x, w.t(), out=out)
            else:
                gemv(x, w, out=out, config=config, pdl=pdl)

    return time_graph_ms(capture(run), reps) * 1e3 / len(ws)


def bench_shapes(args, ceil, results, names):
    """Per shape: cuBLAS, triton default, pdl with prefetch 0/1/2 on one-shape chains."""
    for name in names:
        N, K = SHAPES[name]
        x, out, ws = shape_chain(name, args.m, args.layers)
        floor_us = 2 * N * K / (ceil["copy_GBps"] * 1e3)
        cfg = default_config(args.m, N, K, BF16, x.device)
        rows = {"cublas": time_shape(x, out, ws, args.reps, cublas=True),
                "triton": time_shape(x, out, ws, args.reps, cfg)}
        for p in (0, 1, 2):
            pcfg = GemvConfig(cfg.block_n, cfg.block_k, cfg.num_warps, cfg.num_stages, p)
            rows[f"pdl_prefetch{p}"] = time_shape(x, out, ws, args.reps, pcfg, pdl=True)
        print(f"{name} [{N}, {K}] x{len(ws)} M={args.m}: floor {floor_us:.2f} us; " + ", ".join(
            f"{m} {us:.2f}" for m, us in rows.items()) + f" us/GEMV ({cfg})", flush=True)
        results.append({"case": f"shape_chain {name}", "M": args.m, "N": N, "K": K,
                        "launches": len(ws), "floor_us": floor_us, "config": str(cfg),
                        "us_per_gemv": rows})


def tune_configs(N):
    for bn, bk, nw, p in itertools.product(TUNE_BLOCK_N, TUNE_BLOCK_K, TUNE_WARPS,
                                           TUNE_PREFETCH):
        if p * bn * bk // (32 * nw) > MAX_ELEMS_PER_THREAD or bn > N:
            continue
        yield GemvConfig(bn, bk, nw, 3, p)


def tune_shape(args, ceil, name):
    """Sweep the PDL gemv's tiles on a one-shape chain; returns the summary row."""
    N, K = SHAPES[name]
    x, out, ws = shape_chain(name, args.m, args.layers)
    floor_us = 2 * N * K / (ceil["copy_GBps"] * 1e3)
    want = gemv(x, ws[-1]).double()
    base = default_config(args.m, N, K, BF16, x.device)
    base_us = time_shape(x, out, ws, args.reps, base)
    best_us, best_cfg, tried, skipped = float("inf"), None, 0, 0
    for cfg in tune_configs(N):
        try:
            us = time_shape(x, out, ws, args.reps, cfg, pdl=True)
        except Exception as exc:  # out of resources / compile failure: skip the config
            print(f"  skip {cfg}: {type(exc).__name__}: {str(exc)[:60]}")
            skipped += 1
            continue
        err = ((out.double() - want).norm() / want.norm()).item()
        if err > 1e-2:
            print(f"  WRONG {cfg}: relative error {err:.2e} (skipped)")
            skipped += 1
            continue
        tried += 1
        if us < best_us:
            best_us, best_cfg = us, cfg
    print(f"{name} tune (pdl, M={args.m}): best {best_us:.2f} us/GEMV (floor {floor_us:.2f}, "
          f"triton default no-pdl {base_us:.2f}) with {best_cfg}; {tried} timed, "
          f"{skipped} skipped", flush=True)
    return {"case": f"tune {name}", "M": args.m, "N": N, "K": K, "floor_us": floor_us,
            "triton_default_us": base_us, "best_us": best_us, "best_config": str(best_cfg),
            "tried": tried, "skipped": skipped}


# ---------------------------------------------------------------------------------------------
# main
# ---------------------------------------------------------------------------------------------


def parse_config(text: str | None) -> GemvConfig | None:
    """'block_n,block_k,num_warps,num_stages' -> GemvConfig (prefetch set per mode)."""
    if not text:
        return None
    bn, bk, nw, ns = (int(v) for v in text.split(","))
    return GemvConfig(bn, bk, nw, ns)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="\n".join(__doc__.splitlines()[2:]))
    ap.add_argument("--out", help="write the results as JSON here")
    ap.add_argument("--layers", type=int, default=20, help="layers (launch groups) per graph")
    ap.add_argument("--reps", type=int, default=200, help="timed graph replays (>= 50)")
    ap.add_argument("--m", type=int, default=1, help="rows (batch), 1..4")
    ap.add_argument("--modes", default=",".join(MODES),
                    help="comma list of layer-chain modes ('' skips the layer chain)")
    ap.add_argument("--shapes", default=",".join(SHAPES),
                    help="comma list of one-shape chains to time / tune ('' for none)")
    ap.add_argument("--in-config", help="in_proj tile for the layer chain: bn,bk,warps,stages")
    ap.add_argument("--o-config", help="o_proj tile for the layer chain: bn,bk,warps,stages")
    ap.add_argument("--tune", action="store_true",
                    help="sweep block_n x block_k x num_warps x prefetch of the PDL gemv "
                         "(106 configs a shape, each compiled: minutes; split with --shapes)")
    return ap


def main(argv=None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    names = [s for s in args.shapes.split(",") if s]
    bad = [s for s in names if s not in SHAPES] + [m for m in args.modes.split(",")
                                                     if m and m not in MODES]
    if bad:
        ap.error(f"unknown shapes/modes {bad}; shapes {list(SHAPES)}, modes {list(MODES)}")
    if args.reps < 50 or not 1 <= args.m <= 4 or args.layers < 1:
        ap.error("need --reps >= 50, 1 <= --m <= 4 and --layers >= 1")
    if not torch.cuda.is_available():
        print("bench_pdl: needs a CUDA GPU", file=sys.stderr)
        return 2
    if args.layers * layer_bytes() <= L2_BYTES:
        print(f"warning: {args.layers} layers = {args.layers * layer_bytes() / 1e6:.0f} MB of "
              f"weights fit in L2", file=sys.stderr)
    t0 = time.time()
    torch.manual_seed(0)
    meta = bench_meta(layers=args.layers, reps=args.reps, M=args.m,
                      shapes={k: list(v) for k, v in SHAPES.items()})
    ceil = measure_ceilings()
    print(f"{meta['gpu']}: copy {ceil['copy_GBps']:.0f} GB/s", flush=True)
    results: list[dict] = []
    if args.modes:
        layers = make_layers(args.layers)
        bench_layer_chain(args, ceil, results, layers, parse_config(args.in_config),
                          parse_config(args.o_config))
        del layers
    bench_shapes(args, ceil, results, names)
    if args.tune:
        results.extend(tune_shape(args, ceil, name) for name in names)
    write_results(args.out, meta, t0, ceil, results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
