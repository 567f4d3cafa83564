# SPDX-License-Identifier: Apache-2.0
"""Tile sweep of the latent-MoE kernels (kernels/moe/mxfp4_moe.py) at decode sizes, each
candidate next to its byte floor, against the unfused tail (issue 22).

For every token count N: moe_partials (the two grouped expert GEMMs, MXFP4 or bf16 weights) at
each GEMM candidate (below GEMV_BELOW tokens also their GEMV form, block_m = 1), then
latent_moe_tail at each tail candidate, then the unfused tail (the top-k weighted sum, the
latent RMSNorm and the up projection as torch ops). Each candidate is
first checked against the plain-PyTorch twin (kernels/reference.py; a candidate off by more
than the METHOD.md bf16 bound is reported as wrong, not timed), then timed as REPEATS
back-to-back launches captured in one CUDA graph, median of REPLAYS replays, without PDL: the
kernel's own time with its launch overhead gone. A candidate the GPU cannot run (shared
memory, registers) is reported as skipped. The default tile of each class (default_config) is
marked, and so are the tiles the device's config file holds for the point (timed too when
no candidate has them), so the JSON says whether the defaults and the stored tiles are the
winners, and --write-configs replaces stored tiles only with faster ones.

Shapes default to kimi-k3-mini's (256 experts, top-16, latent = intermediate = hidden =
2048). Floors: the bytes each launch must read (the distinct routed experts' weights and
scales; the tail's up weight and partials) over the device's measured copy bandwidth.

    python benchmarks/bench_mxfp4_tiles.py --out $OUT/mxfp4_tiles.json
    python benchmarks/bench_mxfp4_tiles.py --tokens 1 --experts mxfp4,bf16 --quick
    python benchmarks/bench_mxfp4_tiles.py --write-configs kdaserve/kernels/configs

The MXFP4 GEMM candidates run with both decodes (lut_decode); the bit decode's best is
reported apart (best_gemm_bit_decode, the baseline) and never written.

--write-configs DIR merges each point's fastest tiles into DIR's
mxfp4_moe_gemm_device_name=GPU.json (per expert format) and latent_moe_tail_device_name=GPU.json
(the tail's fastest over the formats' runs), the files moe_partials / latent_moe_tail read.

On the CPU (the smoke test) it runs under TRITON_INTERPRET=1 at small shapes with wall-clock
timing; those times mean nothing.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from kdaserve.bench.report import git_commit  # noqa: E402
from kdaserve.kernels import reference as ref  # noqa: E402
from kdaserve.kernels.mxfp4.format import quantize_mxfp4  # noqa: E402
from kdaserve.kernels.configs import config_file_name  # noqa: E402
from kdaserve.kernels.moe.mxfp4_moe import (GEMM_FIELDS, TAIL_FIELDS,  # noqa: E402
                                            default_config, gemm_shape_key, latent_moe_tail,
                                            moe_partials, tail_shape_key, tuned_tiles)

REPEATS = 20
REPLAYS = 5
BF16_TOL = 1e-2
"""METHOD.md's bound for bf16 kernels against their fp32 twin (relative to the output's max)."""

GEMM_CANDIDATES = dict(block_m=(16,), block_n=(32, 64, 128), block_k=(64, 128, 256),
                       num_warps=(4,), num_stages=(3,), lut_decode=(True, False))
"""The tl.dot tiles at decode sizes: 16-row blocks on 4 warps, 3 stages (at 2 stages ptxas
spills registers in gemm1); the column and K tiles are what varies, with both MXFP4 decodes
(lut_decode: table lookups, or the bit decode they replaced)."""
GEMM_GEMV_CANDIDATES = dict(block_m=(1,), block_n=(8, 16, 32), block_k=(128, 256, 512),
                            num_warps=(2, 4, 8), num_stages=(2,), lut_decode=(True, False))
"""The GEMV form of the expert GEMMs (block_m = 1, opt-in), swept next to the tl.dot tiles below
GEMV_BELOW tokens, with both MXFP4 decodes (lut_decode: table lookups, or the bit decode they
replaced; the same kernel for bf16 experts). One stage count: its loads feed no tl.dot, so
Triton pipelines nothing and the sm_90 build is the same at 1, 2 and 3 stages."""
GEMV_BELOW = 16
TAIL_GEMV_CANDIDATES = dict(tail_block_n=(8, 16, 32, 64), tail_block_k=(128, 256, 512),
                            tail_num_warps=(2, 4, 8))
TAIL_DOT_CANDIDATES = dict(tail_block_n=(32, 64, 128), tail_block_k=(64, 128),
                           tail_num_warps=(4, 8))
QUICK = dict(block_n=(64,), num_stages=(3,), tail_block_n=(16, 32), tail_num_warps=(4,),
             lut_decode=(True,))
"""--quick: a few candidates per class (the smoke test, a first look)."""
QUICK_GEMV = dict(block_n=(16,), block_k=(256,), num_warps=(4,), lut_decode=(True,))
"""--quick for GEMM_GEMV_CANDIDATES: one candidate."""


def grid(space: dict, quick: bool, quick_space: dict = QUICK) -> list[dict]:
    keys = list(space)
    vals = [quick_space.get(k, space[k]) if quick else space[k] for k in keys]
    return [dict(zip(keys, v)) for v in itertools.product(*vals)]


def with_stored(cands: list[dict], tiles: dict | None, base: dict) -> dict | None:
    """Add the tiles the kernels read today for this point (the device's config file, the
    nearest measured token count; None: no file) to `cands`, in place, unless a candidate
    already has them (fields a candidate leaves out take base's values, default_config's), so
    that --write-configs replaces them only with tiles measured faster in the same run.
    Returns that candidate (None without stored tiles)."""
    if not tiles:
        return None
    want = {f: v for f, v in tiles.items() if f in base}
    for c in cands:
        if c.get("lut_decode", True) and all(c.get(f, base[f]) == v for f, v in want.items()):
            return c
    cands.append(want)
    return cands[-1]


def make_experts(fmt: str, E: int, D: int, inter: int, device, gen) -> tuple:
    """(w13, w2, s13, s2): LeCun-normal expert weights, MXFP4-quantised (scales None: bf16)."""
    w13 = torch.randn(E, 2 * inter, D, generator=gen) / D ** 0.5
    w2 = torch.randn(E, D, inter, generator=gen) / inter ** 0.5
    if fmt == "bf16":
        dt = torch.bfloat16 if device.type == "cuda" else torch.float32
        return w13.to(device, dt), w2.to(device, dt), None, None
    p13, s13 = quantize_mxfp4(w13)
    p2, s2 = quantize_mxfp4(w2)
    return p13.to(device), p2.to(device), s13.to(device), s2.to(device)


def routing(N: int, E: int, k: int, device, gen) -> tuple[torch.Tensor, torch.Tensor]:
    """k distinct experts per token, spread (random), and their softmax weights."""
    ids = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(N)])
    w = torch.softmax(torch.randn(N, k, generator=gen), -1)
    return w.to(device), ids.to(device)


def timed(fn, device) -> float:
    """Seconds per call: a CUDA graph of REPEATS calls, median of REPLAYS replays (CPU: the
    wall clock of one call)."""
    if device.type != "cuda":
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0
    fn()
    torch.cuda.synchronize()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    g = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream), torch.cuda.graph(g, stream=stream):
        for _ in range(REPEATS):
            fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(REPLAYS):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        g.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / REPEATS)
    return statistics.median(times)


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want.float()).abs().max() / want.float().abs().max().clamp_min(
        1e-30))


def try_candidate(run, check, device) -> dict:
    """{"us": ...} or {"skipped": why} or {"wrong": error}."""
    try:
        out = run()
        err = check(out)
        if err > BF16_TOL:
            return {"wrong": round(err, 5)}
        return {"us": round(timed(run, device) * 1e6, 2), "rel_err": round(err, 6)}
    except Exception as e:  # noqa: BLE001 - out of shared memory / registers: not runnable
        if device.type == "cuda":
            torch.cuda.synchronize()
        return {"skipped": f"{type(e).__name__}: {str(e)[:160]}"}


def sweep_point(a, fmt: str, N: int, bandwidth: float, device, gen) -> dict:
    E, k, D, inter, H = a.num_experts, a.top_k, a.latent, a.intermediate, a.hidden
    dt = torch.bfloat16 if device.type == "cuda" else torch.float32
    w13, w2, s13, s2 = make_experts(fmt, E, D, inter, device, gen)
    x = torch.randn(N, D, generator=gen).to(device, dt)
    topk_w, ids = routing(N, E, k, device, gen)
    act = ("situ", 4.0, 25.0)                                    # K3's SiTU, clipped up branch
    twin_act = lambda gt, u: ref.situ_and_mul(gt, u, 4.0, 25.0)        # noqa: E731
    want_partials = (ref.moe_partials_mxfp4(x, w13, s13, w2, s2, ids, twin_act) if s13 is not None
                     else ref.moe_partials(x, lambda e: (w13[e], w2[e]), E, ids, twin_act))
    used = int(torch.unique(ids).numel())
    per_expert = (w13[0].numel() + w2[0].numel()) * w13.element_size() + (
        (s13[0].numel() + s2[0].numel()) if s13 is not None else 0)
    gemm_floor_us = used * per_expert / bandwidth * 1e6
    default = dataclasses.asdict(default_config(N, k, E))
    point = {"experts": fmt, "tokens": N, "distinct_experts": used,
             "gemm_floor_us": round(gemm_floor_us, 2), "gemm": [], "tail": []}
    gemv = grid(GEMM_GEMV_CANDIDATES, a.quick, QUICK_GEMV) if N < GEMV_BELOW else []
    dot = grid(GEMM_CANDIDATES, a.quick)
    # bf16: one decode-free kernel whatever lut_decode says
    if fmt != "mxfp4" or a.no_bit_decode:
        gemv = [c for c in gemv if c["lut_decode"]]
        dot = [c for c in dot if c["lut_decode"]]
    if a.gemv_only and gemv:   # the default tl.dot tile only, as the reference point
        dot = [{f: default[f] for f in GEMM_CANDIDATES}]
    cands = dot + gemv
    stored = with_stored(cands, tuned_tiles("mxfp4_moe_gemm", N, (E, k, D, inter, fmt), device),
                         default)
    for cand in cands:
        cfg = dataclasses.replace(default_config(N, k, E), **cand)
        res = try_candidate(
            lambda cfg=cfg: moe_partials(x, w13, w2, ids, s13, s2, *act, config=cfg),
            lambda out: rel_err(out, want_partials), device)
        is_default = all(default[f] == v for f, v in cand.items())
        point["gemm"].append(dict(cand, default=is_default, stored=cand is stored, **res))
    partials = moe_partials(x, w13, w2, ids, s13, s2, *act)                  # [N * k, D]
    up = (torch.randn(H, D, generator=gen) / D ** 0.5).to(device, dt)
    g = (1 + 0.1 * torch.randn(D, generator=gen)).to(device, dt)
    shared = torch.randn(N, H, generator=gen).to(device, dt)
    want_tail = ref.latent_moe_tail(partials, topk_w, ids, up, g, 1e-6, shared, num_experts=E)
    tail_bytes = up.numel() * up.element_size() + partials.numel() * partials.element_size()
    point["tail_floor_us"] = round(tail_bytes / bandwidth * 1e6, 2)
    if a.no_tail:
        point["unfused_tail"] = {"skipped": "--no-tail"}
        return point
    space = TAIL_GEMV_CANDIDATES if N < 16 else TAIL_DOT_CANDIDATES
    block_m = 1 if N < 16 else default["tail_block_m"]
    tails = [dict(c, tail_block_m=block_m) for c in grid(space, a.quick)]
    stored = with_stored(tails, tuned_tiles("latent_moe_tail", N, (k, D, H), device), default)
    for cand in tails:
        cfg = dataclasses.replace(default_config(N, k, E), **cand)
        res = try_candidate(
            lambda cfg=cfg: latent_moe_tail(partials, topk_w, ids, up, g, 1e-6, shared,
                                            num_experts=E, config=cfg),
            lambda out: rel_err(out, want_tail), device)
        is_default = all(default[f] == v for f, v in cand.items())
        point["tail"].append(dict(cand, default=is_default, stored=cand is stored, **res))

    def unfused():
        lat = (partials.view(N, k, -1).float() * topk_w[..., None].float()).sum(1).to(dt)
        lat = torch.nn.functional.rms_norm(lat, (D,), g, 1e-6)
        return torch.nn.functional.linear(lat, up) + shared

    point["unfused_tail"] = try_candidate(unfused, lambda out: rel_err(out, want_tail), device)
    return point


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", default="1,4,16,64")
    ap.add_argument("--experts", default="mxfp4,bf16")
    ap.add_argument("--num-experts", type=int, default=256)
    ap.add_argument("--top-k", type=int, default=16)
    ap.add_argument("--latent", type=int, default=2048)
    ap.add_argument("--intermediate", type=int, default=2048)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--quick", action="store_true", help="a few candidates per class")
    ap.add_argument("--gemv-only", action="store_true",
                    help="below the GEMV threshold, the GEMV candidates and the default tile only")
    ap.add_argument("--no-tail", action="store_true", help="sweep the expert GEMMs only")
    ap.add_argument("--no-bit-decode", action="store_true",
                    help="MXFP4 candidates with the table decode only (the bit decode's, its "
                         "baseline, are never written to the configs)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None)
    ap.add_argument("--write-configs", default=None, metavar="DIR",
                    help="merge the fastest tiles into DIR's config files (CUDA only)")
    a = ap.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    gen = torch.Generator().manual_seed(a.seed)
    if device.type == "cuda":
        from kdaserve.engine.floor import measure_copy_bandwidth
        bandwidth = measure_copy_bandwidth(device)
    else:
        bandwidth = 1e10
    out = {"benchmark": "latent-MoE kernel tiles (bench_mxfp4_tiles.py)",
           "command": " ".join(sys.argv), "commit": git_commit(),
           "gpu": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
           "copy_bandwidth_gb_s": round(bandwidth / 1e9, 1), "shapes": vars(a), "points": []}
    for fmt in a.experts.split(","):
        for N in (int(t) for t in a.tokens.split(",")):
            p = sweep_point(a, fmt, N, bandwidth, device, gen)
            out["points"].append(p)
            bits = [c for c in p["gemm"] if "us" in c and c.get("lut_decode") is False]
            if bits:   # the bit decode's best tile: the baseline, never written to the configs
                p["best_gemm_bit_decode"] = min(bits, key=lambda c: c["us"])
                print(f"{fmt:5s} N={N:3d} gemm: the bit decode's best "
                      f"{p['best_gemm_bit_decode']}", flush=True)
            for kind in ("gemm", "tail"):
                ok = [c for c in p[kind] if "us" in c and c.get("lut_decode") is not False]
                best = min(ok, key=lambda c: c["us"]) if ok else None
                dflt = (next((c for c in p[kind] if c["stored"]), None)
                        or next((c for c in p[kind] if c["default"]), None))
                p[f"best_{kind}"] = best
                floor = p[f"{kind}_floor_us"]
                tiles = {f: v for f, v in (best or {}).items()
                         if f not in ("us", "rel_err", "default", "stored")}
                shown = dflt.get("us", dflt.get("skipped", dflt.get("wrong"))) if dflt else "-"
                which = "stored" if dflt and dflt["stored"] else "default"
                print(f"{fmt:5s} N={N:3d} {kind:4s}: floor {floor:8.2f} us; {which} {shown}; "
                      f"best {best['us'] if best else '-'} us {tiles}; "
                      f"{sum('skipped' in c for c in p[kind])} skipped, "
                      f"{sum('wrong' in c for c in p[kind])} wrong", flush=True)
            print(f"{fmt:5s} N={N:3d} unfused tail: {p['unfused_tail']}", flush=True)
            save(a, out, device)            # after every point: a cut-off sweep keeps its part


def save(a, out: dict, device) -> None:
    if a.out:
        with open(a.out, "w") as f:
            json.dump(out, f, indent=1)
    if a.write_configs and device.type == "cuda":
        for path, entries in tuned_entries(a, out["points"], out["gpu"], a.write_configs).items():
            old = json.load(open(path)) if os.path.isfile(path) else {}
            old.update(entries)
            with open(path, "w") as f:
                f.write("{\n" + ",\n".join(f"  {json.dumps(k)}: {json.dumps(v)}"
                                            for k, v in sorted(old.items())) + "\n}\n")


def tuned_entries(a, points: list[dict], gpu: str, config_dir: str) -> dict[str, dict]:
    """{file path: {shape key: tiles}}: each point's fastest GEMM tiles (by expert format) and
    the fastest tail tiles per token count over all formats' runs, completed with the
    default_config fields the sweep does not vary."""
    gemm, tail, tail_us = {}, {}, {}
    for p in points:
        N = p["tokens"]
        base = dataclasses.asdict(default_config(N, a.top_k, a.num_experts))
        if p["best_gemm"]:
            best = {f: p["best_gemm"].get(f, base[f]) for f in GEMM_FIELDS}
            gemm[gemm_shape_key(N, a.num_experts, a.top_k, a.latent, a.intermediate,
                                p["experts"])] = best
        bt = p["best_tail"]
        if bt and bt["us"] < tail_us.get(N, float("inf")):
            tail_us[N] = bt["us"]
            tail[tail_shape_key(N, a.top_k, a.latent, a.hidden)] = {
                f: bt.get(f, 1 if f == "tail_block_m" and N < GEMV_BELOW else base[f])
                for f in TAIL_FIELDS}
    return {os.path.join(config_dir, config_file_name("mxfp4_moe_gemm", gpu)): gemm,
            os.path.join(config_dir, config_file_name("latent_moe_tail", gpu)): tail}


if __name__ == "__main__":
    main()
