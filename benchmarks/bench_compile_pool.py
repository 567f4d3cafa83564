"""Triton compile time of kernel variants: one thread against kdaserve's compile pool.

    python benchmarks/bench_compile_pool.py --workers 2 --out compile_pool.json

Compiles the same variants of `moe_gemm1_kernel` (BLOCK_M x BLOCK_N x BLOCK_K tiles, 4 warps,
the 48B MoE's signature) for sm_90 three times, each on an empty Triton cache but the last:
serially in this process; through CompileAhead (kernels/compile_ahead.py) with --workers
processes; then serially again on the pool's cache (what the start-up's real pass pays: disk
loads). No GPU needed: Triton builds for an explicit target with its bundled ptxas.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

TARGET = ("cuda", 90, 32)


def variants() -> list[tuple]:
    """(kernel, signature, constexprs, attrs, options) of each tile."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend

    from kdaserve.kernels.moe.triton_moe import moe_gemm1_kernel as fn

    names = [p.name for p in fn.params]
    bf16 = ("x_ptr", "w13_ptr", "inter_ptr")
    signature = {p.name: "constexpr" if p.is_constexpr else "*bf16" if p.name in bf16
                 else "*i32" if p.name.endswith("_ptr") else "i32" for p in fn.params}
    attrs = {(i,): [["tt.divisibility", 16]] for i, p in enumerate(fn.params)
             if not p.is_constexpr and p.name.endswith("_ptr")}
    options = make_backend(GPUTarget(*TARGET)).parse_options({"num_warps": 4})
    out = []
    for bm in (16, 32, 64):
        for bn in (64, 128):
            for bk in (64, 128):
                c = dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8, DOT_PRECISION="ieee",
                         DIRECT=False, EVEN_K=True, EVEN_N=True, USE_PDL=False)
                out.append((fn, signature, {(names.index(k),): v for k, v in c.items()}, attrs,
                            options))
    return out


def compile_serially(vs: list[tuple]) -> float:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    t = time.perf_counter()
    for fn, sig, consts, attrs, options in vs:
        triton.compile(ASTSource(fn, sig, consts, attrs), target=GPUTarget(*TARGET),
                       options=options.__dict__)
    return round(time.perf_counter() - t, 2)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workers", type=int, default=os.cpu_count())
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    from triton.runtime.jit import serialize_specialization_data

    from kdaserve.bench.report import git_commit
    from kdaserve.kernels.compile_ahead import CompileAhead

    vs = variants()
    os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp()
    serial = compile_serially(vs)
    os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp()     # the workers inherit it
    t = time.perf_counter()
    ahead = CompileAhead(args.workers, TARGET)
    for fn, sig, consts, attrs, options in vs:
        ahead.submit(fn.fn.__module__, fn.fn.__qualname__,
                     serialize_specialization_data(fn.fn.__qualname__, sig, consts, attrs,
                                                   options, key=None))
    stats = ahead.wait()
    pool = round(time.perf_counter() - t, 2)
    result = {"command": " ".join(sys.argv), "commit": git_commit(),
              "gpu": "none needed: builds for the target on the CPU", "cpus": os.cpu_count(),
              "workers": args.workers, "variants": len(vs), "target": list(TARGET),
              "serial_s": serial, "pool_s": pool, "pool_failed": stats["failed"],
              "in_process_after_pool_s": compile_serially(vs)}
    print(json.dumps(result))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
