"""One-launch decode router (moe_router_gemv_topk) vs gemv + moe_topk_sigmoid, CUDA only.

    python benchmarks/bench_router_fused.py [--out router_fused.json] [--n 1,2]

What a decode step runs: 26 router calls (the 26 MoE layers of Kimi-Linear-48B, each with its own
fp32 [256, 2304] weight, bias and ticket; 61 MB of weights in all, more than the L2), chained in
one CUDA graph and timed as its replay (bench_layers.bench_graph_ms: median, L2 flushed before
each replay). Per N: the fused launch and the two-launch path (gemv with fp32 out, then
moe_topk_sigmoid), each with pdl off and on. Prints us per call (graph time / 26) and the floor
(weight bytes / the copy bandwidth measured in the same run); --out writes the rows and the run's
command, GPU, versions and commit as JSON.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

from bench_layers import (bench_graph_ms, bench_meta, measure_ceilings,  # noqa: E402
                          write_results)

LAYERS, HIDDEN, EXPERTS, TOP_K, SCALING = 26, 2304, 256, 8, 2.446


def layer_params(layers: int):
    """Per layer: fp32 weight [E, D], bias [E], and a zeroed int32 ticket [1]."""
    g = torch.Generator(device="cuda").manual_seed(0)
    return [(torch.randn(EXPERTS, HIDDEN, device="cuda", generator=g) / HIDDEN ** 0.5,
             torch.randn(EXPERTS, device="cuda", generator=g) * 0.1,
             torch.zeros(1, dtype=torch.int32, device="cuda")) for _ in range(layers)]


def fused_step(xs, params, pdl):
    from kdaserve.kernels.moe.router import moe_router_gemv_topk

    def step():
        return [moe_router_gemv_topk(x, w, b, TOP_K, True, SCALING, t, extra_expert=EXPERTS,
                                     pdl=pdl) for x, (w, b, t) in zip(xs, params)]
    return step


def two_launch_step(xs, params, pdl):
    from kdaserve.kernels.linear.gemv import gemv
    from kdaserve.kernels.moe.router import moe_topk_sigmoid

    def step():
        return [moe_topk_sigmoid(gemv(x, w, out_dtype=torch.float32, pdl=pdl), b, TOP_K, True,
                                 SCALING, extra_expert=EXPERTS, pdl=pdl)
                for x, (w, b, _) in zip(xs, params)]
    return step


def check_same(fused, two) -> None:
    """The two paths pick the same experts (weights within 1e-6) before anything is timed."""
    for (wf, idf), (wt, idt) in zip(fused(), two()):
        assert torch.equal(idf, idt), "fused router ids differ from gemv + top-k"
        torch.testing.assert_close(wf, wt, rtol=1e-6, atol=1e-6)


def bench_n(results, ceil, params, n: int) -> None:
    xs = [torch.randn(n, HIDDEN, device="cuda").bfloat16() for _ in range(LAYERS)]  # [N, D]
    weight_bytes = LAYERS * EXPERTS * HIDDEN * 4
    floor_us = weight_bytes / (ceil["copy_GBps"] * 1e3) / LAYERS
    check_same(fused_step(xs, params, False), two_launch_step(xs, params, False))
    for name, make in (("fused", fused_step), ("gemv+topk", two_launch_step)):
        for pdl in (False, True):
            ms = bench_graph_ms(make(xs, params, pdl))
            us = ms * 1e3 / LAYERS
            assert all(int(t.item()) == 0 for _, _, t in params), "a ticket was left non-zero"
            results.append({"case": name, "n": n, "pdl": pdl, "graph_ms": ms,
                            "us_per_call": us, "floor_us_per_call": floor_us})
            print(f"N={n} {name:<10} pdl={'on ' if pdl else 'off'} {us:7.2f} us/call "
                  f"(floor {floor_us:5.2f} us, {LAYERS} calls {ms * 1e3:8.1f} us)", flush=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None, help="write results JSON here")
    ap.add_argument("--n", default="1,2", help="comma list of token counts (<= 4)")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 1
    t0 = time.time()
    meta = bench_meta(layers=LAYERS, hidden=HIDDEN, experts=EXPERTS, top_k=TOP_K)
    ceil = measure_ceilings()
    print(f"copy {ceil['copy_GBps']:.0f} GB/s", flush=True)
    params = layer_params(LAYERS)
    results: list = []
    for n in (int(v) for v in args.n.split(",")):
        bench_n(results, ceil, params, n)
    write_results(args.out, meta, t0, ceil, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
