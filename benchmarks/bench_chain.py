"""Decode kernels timed as they run in the decode CUDA graph: chains of calls on distinct weights.

    python benchmarks/bench_chain.py [--cases kda_in,o_proj,mla_q_kv_a,router,moe]
        [--m 1] [--quick] [--time-budget 500] [--out chain.json]

One CUDA graph holds C calls back to back, each launched with pdl=True (as the engine does) on
its own weight copy: C = max(8, ceil(400 MB / weight bytes)), at most 64, so the chain's weights
do not fit the 50 MB L2. MoE has room for one w13/w2 only: its C = 28 calls have disjoint top-9
experts (252 of 256). per_call_us = median replay time (25 replays after 3 warm ones, CUDA
events) / C, which spreads the fixed ~8-10 us per replay over C calls. floor_us = one call's
bytes / the copy bandwidth of bench_layers.measure_ceilings(); ratio = floor / time.
Each config's first call is checked against its reference twin (relative error <= 1e-2, else
the config is skipped); configs that fail to compile are skipped with the error's first line.

Sweep order (the full grids do not fit the budget): every tile shape at the default's
num_stages, nearest to the default config (log2 distance) first; then the other num_stages,
fastest tile shapes first. Each sweep gets an equal share of the budget left when it starts.
Results keep the baseline row (the default config; for the gemm2_sum sweep the best gemm1
with the default gemm2_sum) and the top 5 configs per case.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import math
import statistics
import sys
import time
from dataclasses import replace
from functools import partial
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

BF16, F32 = torch.bfloat16, torch.float32
GEMV_CASES = {"kda_in": (12576, 2304, BF16), "o_proj": (2304, 4096, BF16),   # name: N, K, weight
              "mla_q_kv_a": (6720, 2304, BF16), "router": (256, 2304, F32)}
ALL_CASES = (*GEMV_CASES, "moe", "mla", "mla_layer", "topk", "kda_layer", "dense_mlp")
CHAIN_BYTES, MIN_CHAIN, MAX_CHAIN = 400e6, 8, 64
WARM, REPLAYS, TOL, TOP = 3, 25, 1e-2, 5
MAX_ELEMS_PER_THREAD = 256
E, D, INTER, TOPK = 256, 2304, 1024, 9          # Kimi-Linear-48B routed experts


def chain_len(weight_bytes: int) -> int:
    return min(MAX_CHAIN, max(MIN_CHAIN, math.ceil(CHAIN_BYTES / weight_bytes)))


def floor_us(nbytes: int, ceil: dict) -> float:
    return nbytes / (ceil["copy_GBps"] * 1e3)


def nbytes(*tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def replay_us(graph) -> float:
    """Median wall time of one replay (after WARM replays), in us."""
    for _ in range(WARM):
        graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    ms = []
    for _ in range(REPLAYS):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        ms.append(start.elapsed_time(end))
    return statistics.median(ms) * 1e3


def run_config(case, cfg, calls, out0, ref, floor, rows, baseline=False):
    """Capture `calls` (each run once first, on a side stream) in one graph, check out0 (the
    first call's output, NaN-filled before) against ref, time it. Appends a row to rows and
    returns per-call us; None (printed why) when the config fails to compile or is wrong."""
    from bench_gemv import rel_err
    from bench_layers import capture

    out0.fill_(float("nan"))
    try:
        graph = capture(lambda: [call() for call in calls])
    except Exception as exc:  # out of resources / compile failure
        first = (str(exc).splitlines() or [""])[0][:100]
        print(f"{case:<22} {cfg} skip: {type(exc).__name__}: {first}", flush=True)
        return None
    err = rel_err(out0, ref)
    if not err <= TOL:
        print(f"{case:<22} {cfg} skip: relative error {err:.2e} > {TOL}", flush=True)
        return None
    us = replay_us(graph) / len(calls)
    rows.append({"case": case, "config": repr(cfg), "per_call_us": us, "floor_us": floor,
                 "ratio": floor / us, "rel_err": err, "chain": len(calls), "baseline": baseline})
    print(f"{case:<22} {cfg} {us:8.2f} {floor:8.2f} {floor / us:6.2f}", flush=True)
    return us


def sweep_order(combos, stages, s0, timed):
    """(combo, stages): every combo at s0 in the given order, then the other stages, combos
    fastest first (ranked lazily, after the first pass has filled `timed`)."""
    for combo in combos:
        yield combo, s0
    for combo in sorted(combos, key=lambda c: timed.get(c, math.inf)):
        for s in stages:
            if s != s0:
                yield combo, s


def sweep(combos, stages, s0, measure, deadline) -> None:
    """measure(combo, stages) -> per-call us or None, in sweep_order, until the deadline."""
    timed, total = {}, len(combos) * len(stages)
    for n, (combo, s) in enumerate(sweep_order(combos, stages, s0, timed)):
        if time.time() > deadline:
            print(f"  time budget: {total - n} of {total} configs left untried", flush=True)
            return
        us = measure(combo, s)
        if us is not None:
            timed[combo] = min(us, timed.get(combo, math.inf))


def nearest_first(combos, *anchors) -> list:
    """Tile tuples sorted by log2 distance to the nearest anchor (the default's tiles first;
    grid order breaks ties)."""
    return sorted(combos, key=lambda c: min(sum(abs(math.log2(a / b)) for a, b in zip(c, anchor))
                                            for anchor in anchors))


def tuned_neighbour(N: int, K: int, dtype, device):
    """The device's tuned GEMV config (M = 1) of the shape nearest to (N, K) in log2 distance
    with the same weight dtype, or None (no file, or the shape itself is tuned)."""
    from kdaserve.kernels.configs import device_name, shape_key
    from kdaserve.kernels.linear.gemv import tuned_configs
    from kdaserve.kernels.utils import num_sms

    tuned = tuned_configs(device_name(device), num_sms(device))
    if shape_key(M=1, N=N, K=K, dtype=dtype) in tuned:
        return None
    best, dist = None, math.inf
    for key, cfg in tuned.items():
        dims = dict(kv.split("=") for kv in key.split(","))
        if dims["M"] != "1" or dims["dtype"] != str(dtype).removeprefix("torch."):
            continue
        d = abs(math.log2(int(dims["N"]) / N)) + abs(math.log2(int(dims["K"]) / K))
        if d < dist:
            best, dist = cfg, d
    return best


def keep_top(rows, results, case) -> None:
    """The baseline row (the sweep's starting config) and the TOP fastest others of `case`
    into results (printed)."""
    base = [r for r in rows if r["baseline"]]
    best = sorted((r for r in rows if not r["baseline"]), key=lambda r: r["per_call_us"])[:TOP]
    print(f"top {len(best)} of {len(rows)} timed for {case}:")
    for r in base + best:
        print(f"  {r['per_call_us']:8.2f} us ratio {r['ratio']:.2f} "
              f"{'(baseline) ' if r['baseline'] else ''}{r['config']}", flush=True)
    results.extend(base + best)


class Budget:
    """Deadlines: each sweep gets an equal share of what is left of the run's time budget."""

    def __init__(self, end: float, sweeps: int):
        self.end, self.left = end, max(1, sweeps)

    def deadline(self) -> float:
        now = time.time()
        share = max(0.0, self.end - now) / self.left
        self.left = max(1, self.left - 1)
        return now + share


# --- gemv ----------------------------------------------------------------------------------------


def parse_gemv_shapes(raw: str) -> dict:
    """--gemv-shapes "NxK[:fp32],..." -> {"gemv_NxK[_fp32]": (N, K, weight dtype)} (bf16
    weights unless :fp32): other models' decode projections, swept as the named cases are."""
    cases = {}
    for item in filter(None, raw.split(",")):
        dims, _, dt = item.partition(":")
        try:
            n, k = (int(v) for v in dims.lower().split("x"))
        except ValueError:
            raise SystemExit(f"--gemv-shapes: {item!r} is not NxK[:fp32]") from None
        if dt not in ("", "fp32", "bf16") or n < 1 or k < 1:
            raise SystemExit(f"--gemv-shapes: {item!r} is not NxK[:fp32]")
        cases[f"gemv_{n}x{k}" + ("_fp32" if dt == "fp32" else "")] = (
            n, k, F32 if dt == "fp32" else BF16)
    return cases


def gemv_chain(name, M):
    """C weight copies [N, K], x [M, K] bf16, outs [M, N] (fp32 for the fp32 router weight)."""
    N, K, w_dtype = GEMV_CASES[name]
    out_dtype = F32 if w_dtype == F32 else BF16
    C = chain_len(N * K * torch.empty((), dtype=w_dtype).element_size())
    ws = [(torch.randn(N, K, device="cuda") * K ** -0.5).to(w_dtype) for _ in range(C)]
    xs = [torch.randn(M, K, device="cuda", dtype=BF16) for _ in range(C)]
    outs = [torch.empty(M, N, device="cuda", dtype=out_dtype) for _ in range(C)]
    return ws, xs, outs


def bench_gemv_case(name, M, ceil, budget, quick, results, best=None) -> None:
    """best: when given, best[shape key] = (fields, us, baseline us) of the fastest config
    (the --write-configs entries)."""
    from kdaserve.kernels.configs import shape_key
    from kdaserve.kernels.linear.gemv import GemvConfig, default_config, gemv, gemv_reference

    ws, xs, outs = gemv_chain(name, M)
    N, K = ws[0].shape
    ref = gemv_reference(xs[0], ws[0], outs[0].dtype)                       # [M, N]
    floor = floor_us(nbytes(ws[0], xs[0], outs[0]), ceil)
    case, rows, seen = f"{name} M={M}", [], {}

    def measure(cfg, baseline=False):
        if cfg not in seen:
            calls = [partial(gemv, x, w, out=o, config=cfg, pdl=True)
                     for x, w, o in zip(xs, ws, outs)]
            seen[cfg] = run_config(case, cfg, calls, outs[0], ref, floor, rows, baseline)
        return seen[cfg]

    base = default_config(M, N, K, ws[0].dtype, ws[0].device)
    measure(base, baseline=True)                       # the first row: default_config
    if not quick:
        combos = [c for c in itertools.product((1, 2, 4, 8, 16, 32, 64), (128, 256, 512, 1024),
                                               (1, 2, 4, 8))
                  if c[0] * c[1] // (32 * c[2]) <= MAX_ELEMS_PER_THREAD]
        # nearest to the default first, or to the tuned config of the most alike measured
        # shape (same weight dtype), so that an untuned shape starts where tuned ones ended
        anchors = [(base.block_n, base.block_k, base.num_warps)]
        alike = tuned_neighbour(N, K, ws[0].dtype, ws[0].device)
        if alike is not None:
            anchors.append((alike.block_n, alike.block_k, alike.num_warps))
        combos = nearest_first(combos, *anchors)
        sweep(combos, (2, 3, 4, 5), base.num_stages,
              lambda c, s: measure(GemvConfig(c[0], c[1], c[2], s, prefetch=2)),
              budget.deadline())
    keep_top(rows, results, case)
    timed = {c: us for c, us in seen.items() if us is not None}
    if best is not None and base in timed:
        win = min(timed, key=timed.get)
        best[shape_key(M=M, N=N, K=K, dtype=ws[0].dtype)] = (
            dataclasses.asdict(win), timed[win], timed[base])


def write_gemv_configs(config_dir: str, best: dict, device_name: str, sms: int,
                       gain: float = 0.02) -> Path:
    """Merge each case's fastest config into config_dir/gemv_device_name=<device_name>.json
    where it beats the one timed first (the config the engine uses today) by more than `gain`;
    a case where today's wins keeps its entry (or its guess). A new device file starts from the
    SM-count file it will shadow (load_configs reads one file: the device's own, else the SM
    count's), so no tuned shape is lost. Returns the file's path."""
    from kdaserve.kernels.configs import config_file_name

    path = Path(config_dir) / config_file_name("gemv", device_name)
    start = path if path.is_file() else Path(config_dir) / f"gemv_sms={sms}.json"
    merged = json.loads(start.read_text()) if start.is_file() else {}
    for key, (fields, us, base_us) in sorted(best.items()):
        keep = us < base_us * (1 - gain)
        print(f"{key}: {'write' if keep else 'keep today'} ({us:.2f} us against "
              f"{base_us:.2f}) {fields}", flush=True)
        if keep:
            merged[key] = fields
    path.write_text("{\n" + ",\n".join(f"  {json.dumps(k)}: {json.dumps(v)}"
                                        for k, v in sorted(merged.items())) + "\n}\n")
    print(f"wrote {path}", flush=True)
    return path


# --- fused MoE at one token ----------------------------------------------------------------------


def bench_moe(ceil, budget, quick, results) -> None:
    """fused_moe(x [1, D]) chain: one w13 [E, 2I, D] / w2 [E, D, I], each call 9 other experts.
    Sweeps gemm1 (gemm2_sum at the default), then gemm2_sum with the best gemm1."""
    from kdaserve.kernels import reference as moe_ref
    from kdaserve.kernels.moe.fused_moe import MoEGemmConfig as G
    from kdaserve.kernels.moe.fused_moe import default_config, fit_config, fused_moe

    w13 = torch.randn(E, 2 * INTER, D, device="cuda", dtype=BF16).mul_(0.02)   # [E, 2I, D]
    w2 = torch.randn(E, D, INTER, device="cuda", dtype=BF16).mul_(0.02)        # [E, D, I]
    C = E // TOPK
    perm = torch.randperm(E, device="cuda").int()
    ids = [perm[TOPK * i:TOPK * (i + 1)].view(1, TOPK).contiguous() for i in range(C)]  # [1, k]
    tws = [torch.rand(1, TOPK, device="cuda") + 0.1 for _ in range(C)]                  # [1, k]
    xs = [torch.randn(1, D, device="cuda", dtype=BF16) for _ in range(C)]               # [1, D]
    outs = [torch.empty(1, D, device="cuda", dtype=BF16) for _ in range(C)]             # [1, D]
    ref = moe_ref.moe_experts(xs[0], w13, w2, tws[0], ids[0])
    floor = floor_us(TOPK * (2 * INTER * D + D * INTER) * 2, ceil)
    seen = {}

    def measure(case, rows, cfg, baseline=False):
        if cfg not in seen or baseline:     # a sweep's baseline gets its own row
            calls = [partial(fused_moe, x, w13, w2, tw, i, out=o, config=cfg, pdl=True)
                     for x, tw, i, o in zip(xs, tws, ids, outs)]
            seen[cfg] = run_config(case, cfg, calls, outs[0], ref, floor, rows, baseline)
        return seen[cfg]

    base = fit_config(default_config(1, TOPK, E, BF16), D, INTER)
    for case, g, grid, stages in (
            ("moe N=1 gemm1", "gemm1", ((16, 32, 64, 128), (64, 128, 256), (2, 4, 8)),
             (2, 3, 4, 5)),
            ("moe N=1 gemm2_sum", "gemm2_sum", ((4, 8, 16, 32), (256, 512, 1024), (2, 4, 8)),
             (2, 3, 4))):
        rows = []
        measure(case, rows, base, baseline=True)   # default, then the best gemm1
        if not quick:
            d = getattr(base, g)
            combos = nearest_first(list(itertools.product(*grid)),
                                   (d.block_n, d.block_k, d.num_warps))
            block_m = 16 if g == "gemm1" else 1
            sweep(combos, stages, d.num_stages,
                  lambda c, s: measure(case, rows, replace(
                      base, **{g: G(block_m, c[0], c[1], 1, c[2], s)})),
                  budget.deadline())
            ok = [c for c in seen if seen[c] is not None]
            base = min(ok, key=seen.get) if ok else base     # the best so far for sweep 2
        keep_top(rows, results, case)


# --- absorbed MLA decode at batch 1 ---------------------------------------------------------------

MLA_HEADS, MLA_RANK, MLA_ROPE, MLA_PAGE = 32, 512, 64, 16
MLA_SPLITS = (16, 32, 48, 64, 96, 128)


def mla_caches(C: int, context: int):
    """C latent caches of one sequence of `context` tokens (bf16, page MLA_PAGE, its blocks in
    a random order): ([nb, page, rank + rope] x C, block tables [1, nb] x C, seq_lens [1])."""
    nb = context // MLA_PAGE
    caches = [torch.randn(nb, MLA_PAGE, MLA_RANK + MLA_ROPE, device="cuda", dtype=BF16)
              for _ in range(C)]
    tables = [torch.randperm(nb, device="cuda").int().view(1, nb) for _ in range(C)]
    return caches, tables, torch.full((1,), context, device="cuda", dtype=torch.int32)


def bench_mla(ceil, budget, quick, results, context: int = 8192) -> None:
    """mla_decode(q [1, H, rank], q_pe [1, H, rope]) over `context` cached latents (bf16, page
    16) as the engine calls it, each call of the chain on its own cache: sweeps num_kv_splits
    (the default picks 128 at batch 1) x a few tile configs. Floor = cache + q + out bytes."""
    from kdaserve.kernels import reference as ref
    from kdaserve.kernels.mla.decode import MLADecodeConfig, default_config, mla_decode

    H, R, P = MLA_HEADS, MLA_RANK, MLA_ROPE
    C = chain_len(context * (R + P) * 2)
    caches, tables, seq_lens = mla_caches(C, context)
    qs = [torch.randn(1, H, R + P, device="cuda", dtype=BF16) for _ in range(C)]
    outs = [torch.empty(1, H, R, device="cuda", dtype=BF16) for _ in range(C)]
    scale = (128 + P) ** -0.5
    ref_out = ref.mla_decode(qs[0], caches[0], tables[0], seq_lens, scale, R)      # [1, H, R]
    floor = floor_us(nbytes(caches[0], qs[0], outs[0]), ceil)
    base = default_config(1, H, BF16)
    configs = [base] + [MLADecodeConfig(bh, bn, w, st) for bh, bn, w, st in
                        ((16, 64, 4, 2), (16, 64, 8, 2), (16, 32, 4, 2), (H, 32, 4, 2),
                         (H, 64, 4, 2), (H, 64, 8, 3), (H, 128, 8, 2), (H, 32, 4, 3))]
    rows, deadline = [], budget.deadline()
    for splits in ((None,) if quick else (None, *MLA_SPLITS)):
        for n, cfg in enumerate(configs[:1] if quick or splits is None else configs):
            if time.time() > deadline:
                print("  time budget: mla sweep stopped", flush=True)
                break
            calls = [partial(mla_decode, q[..., :R], kv, bt, seq_lens, scale, R, out=o,
                             num_kv_splits=splits, config=cfg, q_pe=q[..., R:], pdl=True)
                     for q, kv, bt, o in zip(qs, caches, tables, outs)]
            run_config("mla B=1 8K", (splits, cfg), calls, outs[0], ref_out, floor, rows,
                       baseline=splits is None)
    keep_top(rows, results, "mla B=1 8K")


def bench_mla_layer(ceil, results, M: int = 1, context: int = 8192) -> None:
    """The MLA decode layer's attention part at batch 1, as `MLAttention._absorbed` runs it:
    store_latent -> q_nope x W_UK -> mla_decode over `context` latents -> o_lat x W_UV, 32
    heads, nope 128, rank 512, rope 64, v 128, every launch with pdl. Variants: cuBLAS einsums
    (the default) against gemv_batched + the decode kernel's cache prefetch
    (KernelConfig.mla_absorb_gemv). Each chain entry has its own weights and cache; both
    variants are checked against the einsum variant's eager output."""
    from kdaserve.kernels.linear.gemv import gemv_batched
    from kdaserve.kernels.mla.decode import mla_decode, store_latent

    H, nope, R, P, v = MLA_HEADS, 128, MLA_RANK, MLA_ROPE, 128
    C = chain_len(H * (nope + v) * R * 2 + context * (R + P) * 2)
    dev = dict(device="cuda", dtype=BF16)
    w_uk = [torch.randn(H, nope, R, **dev) * 0.05 for _ in range(C)]       # [H, nope, rank]
    w_uk_t = [w.transpose(1, 2).contiguous() for w in w_uk]                # [H, rank, nope]
    w_uv = [torch.randn(H, v, R, **dev) * 0.05 for _ in range(C)]         # [H, v, rank]
    caches, tables, seq_lens = mla_caches(C, context)
    slot = torch.full((1,), context - 1, device="cuda", dtype=torch.int64)  # (a block's row)
    norm_w = torch.ones(R, **dev)
    qs = [torch.randn(M, H, nope + P, **dev) for _ in range(C)]            # [M, H, qk]
    ckvs = [torch.randn(M, R + P, **dev) for _ in range(C)]                 # [M, rank + rope]
    outs = [torch.empty(M, H, v, **dev) for _ in range(C)]
    scale = (nope + P) ** -0.5

    def layer(i, by_gemv):
        store_latent(caches[i], slot, ckvs[i], norm_w, 1e-6, pdl=True)
        q = qs[i]
        if by_gemv:
            q_nope = torch.empty(M, H, R, **dev)
            gemv_batched(q[..., :nope].transpose(0, 1), w_uk_t[i], out=q_nope.transpose(0, 1),
                         pdl=True)
        else:
            q_nope = torch.einsum("bhn,hnr->bhr", q[..., :nope], w_uk[i])
        o_lat = mla_decode(q_nope, caches[i], tables[i], seq_lens, scale, R, q_pe=q[..., nope:],
                           pdl=True, prefetch_kv=by_gemv)                  # [M, H, rank]
        if by_gemv:
            gemv_batched(o_lat.transpose(0, 1), w_uv[i], out=outs[i].transpose(0, 1), pdl=True)
        else:
            outs[i].copy_(torch.einsum("bhr,hvr->bhv", o_lat, w_uv[i]))

    layer(0, False)
    ref = outs[0].clone()
    floor = floor_us(nbytes(w_uk[0], w_uv[0], caches[0]), ceil)
    rows = []
    for name, by_gemv in (("cuBLAS einsums", False), ("gemv_batched + prefetch_kv", True)):
        run_config(f"mla_layer M={M}", name, [partial(layer, i, by_gemv) for i in range(C)],
                   outs[0], ref, floor, rows, baseline=not by_gemv)
    results.extend(rows)


def bench_topk(ceil, results, M: int = 1) -> None:
    """The router's sigmoid top-8 (+ the shared expert column) over 256 fp32 logits per token,
    as the decode graph runs it after the router GEMV: moe_topk_sigmoid with pdl, the default
    (router.TOPK_NUM_WARPS) against 1 and 2 warps."""
    from kdaserve.kernels import reference as ref
    from kdaserve.kernels.moe.router import moe_topk_sigmoid

    C = 64
    logits = [torch.randn(M, E, device="cuda") for _ in range(C)]              # [M, E] fp32
    bias = torch.randn(E, device="cuda") * 0.1                                  # [E]
    want = ref.moe_topk_sigmoid(logits[0], bias, 8, True, 2.446)[0].sort(dim=-1).values  # [M, 8]
    floor = floor_us(nbytes(logits[0]), ceil)
    rows = []
    for warps in (None, 1, 2):
        w0 = torch.full((M, 8), float("nan"), device="cuda")      # call 0's weights, sorted

        def call(i, warps=warps, w0=w0):
            w, _ = moe_topk_sigmoid(logits[i], bias, 8, True, 2.446, extra_expert=E, pdl=True,
                                    num_warps=warps)
            if i == 0:
                w0.copy_(w[:, :8].sort(dim=-1).values)

        run_config(f"topk M={M}", f"num_warps={warps or 'default'}",
                   [partial(call, i) for i in range(C)], w0, want, floor, rows,
                   baseline=warps is None)
    results.extend(rows)


def bench_kda_layer(ceil, results, M: int = 1) -> None:
    """A KDA layer's decode at batch 1 as the graph runs it: input GEMV -> the one-launch KDA
    decode -> o_proj GEMV, all with pdl, each chain entry with its own weights and state slot
    (32 heads of 128, conv 4). The decode reads its states after its PDL wait or before it
    (KernelConfig.kda_state_prefetch, the default), then the prefetching decode with other
    value blocks per program and warps (default_v_block / default_num_warps pick 32 and 8 at
    batch 1); each checked against the first variant's eager output (the states restored in
    between)."""
    from kdaserve.kernels.kda.decode_fused import kda_decode_fused
    from kdaserve.kernels.linear.gemv import gemv

    H, d, W, D_ = 32, 128, 4, 2304
    P = H * d
    width = 3 * P + 2 * d + H
    dev = dict(device="cuda", dtype=BF16)
    C = chain_len((width * D_ + D_ * P) * 2)
    w_in = [torch.randn(width, D_, **dev) * D_ ** -0.5 for _ in range(C)]    # [3P+2d+H, D]
    w_o = [torch.randn(D_, P, **dev) * P ** -0.5 for _ in range(C)]          # [D, P]
    xs = [torch.randn(M, D_, **dev) for _ in range(C)]
    layer = [dict(conv_weight=torch.randn(3 * P, W, **dev) * 0.3,
                  conv_cache=torch.randn(M + 1, 3 * P, W - 1, **dev),
                  rec_cache=torch.randn(M + 1, H, d, d, device="cuda") * 0.01,
                  state_indices=torch.arange(M, device="cuda", dtype=torch.int32),
                  fg_b_weight=torch.randn(2, P, d, **dev) * d ** -0.5,
                  A_log=torch.randn(H, device="cuda"), dt_bias=torch.randn(P, device="cuda"),
                  o_norm_weight=torch.ones(d, **dev), eps=1e-6, num_heads=H, head_dim=d)
             for _ in range(C)]
    tickets = [torch.zeros(M * H, device="cuda", dtype=torch.int32) for _ in range(C)]
    outs = [torch.empty(M, D_, **dev) for _ in range(C)]

    def step(i, prefetch, v_block=None, num_warps=None):
        proj = gemv(xs[i], w_in[i], pdl=True)                                 # [M, width]
        o = kda_decode_fused(proj, **layer[i], pdl=True, tickets=tickets[i],
                             prefetch_state=prefetch, v_block=v_block,
                             num_warps=num_warps)                            # [M, P]
        gemv(o, w_o[i], out=outs[i], pdl=True)

    saved = [(lay["conv_cache"].clone(), lay["rec_cache"].clone()) for lay in layer]
    step(0, False)
    ref = outs[0].clone()
    floor = floor_us(nbytes(w_in[0], w_o[0], layer[0]["fg_b_weight"]) + 2 * nbytes(
        layer[0]["rec_cache"][:M]), ceil)
    rows = []
    variants = [("states after the wait", dict(prefetch=False)),
                ("states before the wait", dict(prefetch=True))]
    variants += [(f"before the wait, v_block {bv}, {warps} warps",
                  dict(prefetch=True, v_block=bv, num_warps=warps))
                 for bv, warps in ((16, 4), (16, 8), (32, 4), (32, 16), (64, 8), (64, 16),
                                   (128, 8))]
    for name, kw in variants:
        for lay, (conv, rec) in zip(layer, saved):      # every variant from the same states
            lay["conv_cache"].copy_(conv)
            lay["rec_cache"].copy_(rec)
        run_config(f"kda_layer M={M}", name, [partial(step, i, **kw) for i in range(C)],
                   outs[0], ref, floor, rows, baseline=not kw["prefetch"])
    results.extend(rows)


def bench_dense_mlp(ceil, results, M: int = 1) -> None:
    """Layer 0's dense SwiGLU MLP (2304 -> 2 x 9216 -> 2304) at batch 1: cuBLAS (gate, up and
    down GEMMs, silu, mul: the path without dense_mlp_gemv) against the gate|up GEMV then the
    down GEMV reading silu(gate) * up (layers/mlp.py), both with pdl: the default configs, then
    a small grid of (gate|up, down) configs."""
    import torch.nn.functional as F

    from kdaserve.kernels.linear.gemv import GemvConfig, gemv

    I_ = 9216
    dev = dict(device="cuda", dtype=BF16)
    C = chain_len(3 * I_ * D * 2)
    w_gu = [torch.randn(2 * I_, D, **dev) * D ** -0.5 for _ in range(C)]     # [2I, D]
    w_down = [torch.randn(D, I_, **dev) * I_ ** -0.5 for _ in range(C)]      # [D, I]
    xs = [torch.randn(M, D, **dev) for _ in range(C)]
    outs = [torch.empty(M, D, **dev) for _ in range(C)]

    def by_cublas(i):
        gate, up = w_gu[i][:I_], w_gu[i][I_:]
        outs[i].copy_(F.linear(F.silu(F.linear(xs[i], gate)) * F.linear(xs[i], up), w_down[i]))

    def by_gemv(i, cfg_gu=None, cfg_down=None):
        gate_up = gemv(xs[i], w_gu[i], pdl=True, config=cfg_gu)               # [M, 2I]
        gemv(gate_up, w_down[i], out=outs[i], pdl=True, swiglu=True, config=cfg_down)

    by_cublas(0)
    ref = outs[0].clone()
    floor = floor_us(nbytes(w_gu[0], w_down[0]), ceil)
    rows = []
    variants = [("cuBLAS + silu, mul", by_cublas), ("gemv + swiglu gemv", by_gemv)]
    grid_gu = [GemvConfig(8, 256, 1, 3), GemvConfig(4, 512, 1, 3), GemvConfig(16, 256, 2, 3),
               GemvConfig(8, 512, 2, 4)]
    grid_down = [GemvConfig(2, 1024, 1, 5), GemvConfig(4, 512, 1, 4), GemvConfig(1, 2048, 1, 4),
                 GemvConfig(4, 1024, 2, 4)]
    variants += [(f"gate|up {gu}, down {dn}", partial(by_gemv, cfg_gu=gu, cfg_down=dn))
                 for gu, dn in itertools.product(grid_gu, grid_down)]
    for name, fn in variants:
        run_config(f"dense_mlp M={M}", name, [partial(fn, i) for i in range(C)], outs[0], ref,
                   floor, rows, baseline=fn is by_cublas)
    results.extend(rows)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", default=",".join(ALL_CASES),
                    help=f"comma list (default all: {','.join(ALL_CASES)})")
    ap.add_argument("--m", default="1", help="comma list of gemv row counts M (default 1)")
    ap.add_argument("--quick", action="store_true", help="only the default config per case")
    ap.add_argument("--time-budget", type=float, default=500.0,
                    help="seconds for the whole run; sweeps stop when it is spent (default 500)")
    ap.add_argument("--out", help="write the results as JSON here")
    ap.add_argument("--gemv-shapes", default="",
                    help='extra GEMV cases "NxK[:fp32],..." (another model\'s projections), '
                         'run after --cases')
    ap.add_argument("--write-configs", metavar="DIR",
                    help="merge each GEMV case's fastest config into DIR's gemv file for this "
                         "GPU (kdaserve/kernels/configs) where it beats today's by > 2%%")
    args = ap.parse_args(argv)
    from bench_layers import pick_cases, start_gpu_run, write_results

    extra = parse_gemv_shapes(args.gemv_shapes)
    GEMV_CASES.update(extra)
    names = pick_cases(ap, args.cases, ALL_CASES) + list(extra)
    run = start_gpu_run("bench_chain")
    if run is None:
        return 2
    t0, meta, ceil = run
    print("case config per_call_us floor_us ratio(floor/time)", flush=True)
    gemv_names = [n for n in names if n in GEMV_CASES]
    ms = [int(m) for m in args.m.split(",") if m]
    budget = Budget(t0 + args.time_budget,
                    len(gemv_names) * len(ms) + 2 * ("moe" in names) + ("mla" in names))
    results: list[dict] = []
    best: dict = {}
    for name in gemv_names:
        for m in ms:
            bench_gemv_case(name, m, ceil, budget, args.quick, results, best)
    if args.write_configs:
        from kdaserve.kernels.utils import num_sms

        write_gemv_configs(args.write_configs, best, torch.cuda.get_device_name(),
                           num_sms(torch.device("cuda")))
    if "moe" in names:
        bench_moe(ceil, budget, args.quick, results)
    if "mla" in names:
        bench_mla(ceil, budget, args.quick, results)
    if "mla_layer" in names:
        bench_mla_layer(ceil, results)
    if "topk" in names:
        bench_topk(ceil, results)
    if "kda_layer" in names:
        bench_kda_layer(ceil, results)
    if "dense_mlp" in names:
        bench_dense_mlp(ceil, results)
    write_results(args.out, meta, t0, ceil, results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
