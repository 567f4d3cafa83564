"""Decode kernels at batch 16-64 and the prefill MoE, against their floors, with tile sweeps.

    python benchmarks/bench_batch.py --cases kda,mla,moe,moe_prefill --out batch.json

Kimi-Linear-48B shapes. Each decode case runs `calls` launches back to back in one CUDA graph,
each on its own slice of the caches (so the working set exceeds L2 as in a decode step), and
reports microseconds per call for the default config and for every config of a small grid;
`moe_prefill` times the fused Triton MoE at prefill-sized token counts against its compute
floor. MoE cases use the routing of the served dummy model (every token on the same 8 experts
plus the folded shared expert) and a spread routing.

`moe_kernels` splits the fused MoE at each batch (and one token) into its launches: device time per
call of each kernel (torch.profiler, PDL off: with PDL a kernel's span includes its wait for the
previous one) next to the whole call in a graph with PDL on and off.

`dense` times the dense projections (DENSE_SHAPES) at each batch's rows: the skinny GEMM
(kernels/linear/skinny.py) at its default and over a tile grid, against cuBLAS (F.linear), with
the weight-stream floor; `--write-configs DIR` merges the winners into DIR's skinny_gemm file.

`kda_verify` sweeps RecoverSSM's verify kernel at `--verify-requests` windows of 9 tokens.
Speculative verification steps run the same kernels at 1 + K rows a request: `--batches
72,144,288` times the MoE at the verify rows of 8 / 16 / 32 requests (K = 8; from 65 rows the
grid also varies block_m, since with shared experts a small block_m re-reads each expert's
weights once per row block), and `--mla-rows-per-seq 9` the MLA decode with 9 rows a sequence
(one request's window: one block table, context lengths ctx - 8 .. ctx), batches counting
rows.
"""

from __future__ import annotations

import argparse
import itertools
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_layers import bench_ms, capture, start_gpu_run, write_results  # noqa: E402

from kdaserve.kernels import reference as ref  # noqa: E402
from kdaserve.kernels.kda import decode_fused as kdad  # noqa: E402
from kdaserve.kernels.mla import decode as mla  # noqa: E402
from kdaserve.kernels.moe import fused_moe as moe  # noqa: E402

HEADS, KV_RANK, ROPE = 32, 512, 64
HIDDEN, MOE_INTER, EXPERTS, TOP_K = 2304, 1024, 256, 8
KDA_HEADS, KDA_DIM, CONV_W = 32, 128, 4
CASES = ("kda", "kda_verify", "conv_verify", "mla", "moe", "moe_prefill", "moe_kernels", "dense")
DENSE_SHAPES = {"kda_in": (12576, 2304), "o_proj": (2304, 4096), "mla_in": (6720, 2304),
                "dense_gate_up": (18432, 2304), "dense_down": (2304, 9216)}
"""The 48B's dense projections (N, K) that decode and verify steps run above the GEMV's rows:
KDA q|k|v|gates (20 layers), o_proj (27), MLA q|kv_a (7), layer 0's MLP."""


def per_call_us(fns) -> float:
    """fns: one closure per call; all captured back to back in one graph; us per call."""
    graph = capture(lambda: [f() for f in fns])
    return bench_ms(graph.replay) * 1e3 / len(fns)


def sweep(name, rows, default_fn, grid, make_fn, floor_us, deadline):
    """Time default_fn and make_fn(cfg) for cfg in grid (until the deadline)."""
    row = {"case": name, "floor_us": floor_us}
    row["default_us"] = per_call_us(default_fn)
    best = (row["default_us"], "default")
    tried = []
    for cfg in grid:
        if time.time() > deadline:
            row["cut_by_budget"] = True
            break
        try:
            t = per_call_us(make_fn(cfg))
        except Exception as exc:  # out of resources / unsupported tile
            tried.append({"config": str(cfg), "error": type(exc).__name__})
            continue
        tried.append({"config": str(cfg), "us": t})
        if t < best[0]:
            best = (t, str(cfg))
    row["best_us"], row["best_config"] = best
    row["tried"] = sorted((t for t in tried if "us" in t), key=lambda t: t["us"])[:8]
    print(f"{name:<28} floor {floor_us:7.1f}  default {row['default_us']:7.1f}  best "
          f"{best[0]:7.1f} us  {best[1]}", flush=True)
    rows.append(row)


def floor_us(nbytes: int, ceil: dict) -> float:
    return nbytes / (ceil["copy_GBps"] * 1e3)


# ----------------------------------------------------------------------------------- KDA decode

def bench_kda(rows, ceil, n, deadline, calls=4):
    H, d = KDA_HEADS, KDA_DIM
    P = H * d
    dev, bf = "cuda", torch.bfloat16
    proj = torch.randn(n, 3 * P + 2 * d + H, device=dev, dtype=bf)
    conv_w = torch.randn(3 * P, CONV_W, device=dev, dtype=bf) * 0.3
    slots = calls * n + 1
    conv_cache = torch.randn(slots, 3 * P, CONV_W - 1, device=dev, dtype=bf)
    rec = torch.randn(slots, H, d, d, device=dev, dtype=torch.float32) * 0.1
    fgb = torch.randn(2, P, d, device=dev, dtype=bf) * 0.05
    a_log = torch.randn(H, device=dev)
    dt_bias = torch.randn(P, device=dev)
    onw = torch.ones(d, device=dev, dtype=bf)
    perm = torch.randperm(calls * n, device=dev, dtype=torch.int32)
    idx = [perm[i * n:(i + 1) * n].contiguous() for i in range(calls)]
    outs = [torch.empty(n, P, device=dev, dtype=bf) for _ in range(calls)]
    tickets = [torch.zeros(n * H, device=dev, dtype=torch.int32) for _ in range(calls)]

    def fns(gates=False, **kw):
        # gates: the f_b / g_b projections as one GEMM per call first (timed with the kernel)
        def one(i):
            g = kdad.gate_projections(proj, fgb, H, d) if gates else None
            return kdad.kda_decode_fused(proj, conv_w, conv_cache, rec, idx[i], fgb, a_log,
                                         dt_bias, onw, 1e-5, H, d, out=outs[i],
                                         tickets=tickets[i], gates=g, **kw)
        return [lambda i=i: one(i) for i in range(calls)]

    nbytes = n * H * d * d * 4 * 2 + proj[:, :3 * P].numel() * 2 + n * P * 2
    grid = [dict(gates=True, v_block=bv, num_warps=nw) for bv, nw in
            itertools.product((64, 32, 16, 128), (4, 2, 8))]
    grid += [dict(v_block=bv, num_warps=nw) for bv, nw in
             itertools.product((16, 32, 64, 128), (2, 4, 8, 16))]
    sweep(f"kda_decode_fused N={n}", rows, fns(), grid, lambda c: fns(**c),
          floor_us(nbytes, ceil), deadline)


def bench_kda_verify(rows, ceil, n, deadline, window=9, calls=4):
    """RecoverSSM's verify kernel (kernels/kda/recover.py kda_spec_verify) over n requests'
    windows of `window` tokens, gates activated in the kernel as in the model: its grid of
    KDAVerifyConfig (column block, warps). Floor: each request's state
    read once plus the window's inputs and records."""
    from kdaserve.kernels.kda import recover as rc

    H, d = KDA_HEADS, KDA_DIM
    T = n * window
    dev, bf = "cuda", torch.bfloat16
    proj = torch.randn(T, 3 * H * d, device=dev, dtype=bf)
    q, k, v = proj.view(T, 3, H, d).unbind(1)
    graw = torch.randn(T, H, d, device=dev, dtype=bf)
    beta = torch.randn(T, H, device=dev, dtype=bf)
    gate = rc.KDAGateParams(torch.randn(H, device=dev) * 0.3, torch.randn(H * d, device=dev),
                            None)
    pool = torch.randn(calls * n + 1, H, d, d, device=dev) * 0.1
    cu = torch.arange(0, T + 1, window, device=dev, dtype=torch.int32)
    perm = torch.randperm(calls * n, device=dev, dtype=torch.int32)
    idx = [perm[i * n:(i + 1) * n].contiguous() for i in range(calls)]

    def fns(config=None):
        return [lambda i=i: rc.kda_spec_verify(q, k, v, graw, beta, cu, pool, idx[i],
                                               gate=gate, config=config)
                for i in range(calls)]

    # state read; q, k, v, the raw gate, beta read; o, u, k_hat, g recorded
    nbytes = n * H * d * d * 4 + T * H * (4 * d * 2 + 2) + T * H * d * (2 + 4 + 4 + 4)
    grid = [rc.KDAVerifyConfig(bv, nw) for bv, nw in itertools.product((64, 32, 16), (2, 4, 8))]
    sweep(f"kda_spec_verify N={n} x {window}", rows, fns(), grid, fns,
          floor_us(nbytes, ceil), deadline)


def bench_conv_verify(rows, ceil, n, deadline, window=9, calls=4):
    """The verify windows' conv (kernels/kda/recover.py conv_spec_verify) over n requests'
    windows of `window` tokens of the q | k | v channels, into the layer's planes: the default
    (a chunk of rows' loads at once) against one token at a time (chunk 0, the baseline) and
    other chunks. Floor: the inputs read and the planes written once."""
    from kdaserve.kernels.kda import recover as rc

    D = 3 * KDA_HEADS * KDA_DIM
    T = n * window
    x = torch.randn(T, D, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(D, CONV_W, device="cuda", dtype=torch.bfloat16)
    pool = torch.randn(calls * n + 1, D, CONV_W - 1, device="cuda", dtype=torch.bfloat16)
    cu = torch.arange(0, T + 1, window, device="cuda", dtype=torch.int32)
    perm = torch.randperm(calls * n, device="cuda", dtype=torch.int32)
    idx = [perm[i * n:(i + 1) * n].contiguous() for i in range(calls)]
    outs = [torch.empty(3, T, D // 3, device="cuda", dtype=torch.bfloat16) for _ in range(calls)]

    def fns(chunk=8):
        return [lambda i=i: rc.conv_spec_verify(x, w, cu, pool, idx[i], out=outs[i],
                                                chunk=chunk) for i in range(calls)]

    nbytes = 2 * T * D * 2 + n * D * (CONV_W - 1) * 2
    sweep(f"conv_spec_verify N={n} x {window}", rows, fns(), [dict(chunk=c) for c in (0, 16, 32)],
          lambda c: fns(**c), floor_us(nbytes, ceil), deadline)


# ----------------------------------------------------------------------------------- MLA decode

def bench_mla(rows, ceil, b, deadline, ctx=8192, page=16, rows_per_seq=1):
    """b query rows; rows_per_seq consecutive rows share a sequence (a verify window: one
    block table, lengths ctx - rows_per_seq + 1 .. ctx)."""
    D = KV_RANK + ROPE
    blocks = ctx // page
    seqs = -(-b // rows_per_seq)
    kv = torch.randn(seqs * blocks + 1, page, D, device="cuda", dtype=torch.bfloat16)
    bt = torch.randperm(seqs * blocks, device="cuda", dtype=torch.int32).view(seqs, blocks)
    bt = bt.repeat_interleave(rows_per_seq, dim=0)[:b].contiguous()
    q = torch.randn(b, HEADS, D, device="cuda", dtype=torch.bfloat16)
    offs = torch.arange(b, device="cuda") % rows_per_seq
    seq_lens = (ctx - rows_per_seq + 1 + offs).to(torch.int32)
    out = torch.empty(b, HEADS, KV_RANK, device="cuda", dtype=torch.bfloat16)
    scale = 192 ** -0.5

    def fns(**kw):
        if rows_per_seq > 1 and b % rows_per_seq == 0:
            kw.setdefault("rows_per_seq", rows_per_seq)
        return [lambda: mla.mla_decode(q, kv, bt, seq_lens, scale, KV_RANK, out=out, **kw)]

    C = mla.MLADecodeConfig
    cfgs = [C(32, 32, 4, 3), C(32, 64, 8, 2), C(32, 32, 8, 2), C(32, 64, 4, 2, True),
            C(32, 64, 8, 2, True), C(32, 128, 8, 2, True), C(32, 64, 4, 3, True),
            C(16, 64, 4, 2), C(16, 32, 4, 3), C(16, 64, 4, 2, True), C(32, 16, 4, 4),
            C(64, 32, 8, 2), C(64, 64, 8, 2, True), C(32, 32, 8, 2, True),
            # 32 keys a step: two programs an SM fit in shared memory
            C(32, 32, 4, 3, True), C(32, 32, 4, 4, True)]
    splits = (None, 2, 4, 8, 16)
    if rows_per_seq > 1:   # first the fold kernel: 2 / 4 rows of a window as a program's columns
        cfgs = [C(32, bn, nw, ns, True, rows=r) for r, bn, nw, ns in
                ((2, 32, 8, 2), (2, 16, 8, 1), (2, 64, 8, 2), (4, 32, 8, 2))] + cfgs[3:7] \
            + [C(32, 32, 8, 2, True)]
        splits = (None, 4, 8, 16, 2)
    grid = [dict(config=c, num_kv_splits=s) for c in cfgs for s in splits]
    nbytes = seqs * ctx * D * 2        # each sequence's latent KV read once
    tag = f" ({rows_per_seq} rows a sequence)" if rows_per_seq > 1 else ""
    sweep(f"mla_decode B={b} ctx={ctx}{tag}", rows, fns(), grid, lambda c: fns(**c),
          floor_us(nbytes, ceil), deadline)


# ----------------------------------------------------------------------------------- MoE

def moe_inputs(n, same, E=EXPERTS + 1, k=TOP_K + 1):
    """E routed experts + the folded shared one (the last), k = top-8 + shared."""
    logits = torch.randn(n, E - 1, device="cuda")
    w, ids = ref.moe_topk_sigmoid(logits, torch.zeros(E - 1, device="cuda"), TOP_K, True, 2.446)
    if same:
        ids = torch.randperm(E - 1, device="cuda")[:TOP_K].expand(n, TOP_K).contiguous()
    ids = torch.cat([ids.int(), torch.full((n, 1), E - 1, device="cuda", dtype=torch.int32)], 1)
    w = torch.cat([w.float(), torch.ones(n, 1, device="cuda")], 1)
    return w.contiguous(), ids.contiguous()


def moe_weights(E=EXPERTS + 1):
    w13 = torch.randn(E, 2 * MOE_INTER, HIDDEN, device="cuda", dtype=torch.bfloat16) * 0.02
    w2 = torch.randn(E, HIDDEN, MOE_INTER, device="cuda", dtype=torch.bfloat16) * 0.02
    return w13, w2


def bench_moe(rows, ceil, w13, w2, n, same, deadline):
    x = torch.randn(n, HIDDEN, device="cuda", dtype=torch.bfloat16)
    w, ids = moe_inputs(n, same)
    out = torch.empty_like(x)
    touched = int(torch.unique(ids).numel())
    nbytes = touched * 3 * HIDDEN * MOE_INTER * 2

    def fns(**kw):
        return [lambda: moe.fused_moe(x, w13, w2, w, ids, out=out, pdl=True, **kw)]

    C = moe.MoEGemmConfig
    d = moe.default_config(n, TOP_K + 1, EXPERTS + 1, torch.bfloat16)
    bm = d.gemm1.block_m
    grid = []
    # one GEMM's tile (block_n, block_k, warps, stages) at a time, the other at its default
    for bn, bk, nw, ns in ((16, 256, 2, 4), (32, 256, 4, 4), (32, 128, 2, 5), (64, 256, 8, 3),
                           (32, 128, 4, 6), (16, 128, 2, 6), (64, 64, 4, 6), (128, 128, 8, 3)):
        grid.append(dict(config=moe.FusedMoEConfig(C(bm, bn, bk, 1, nw, ns), d.gemm2)))
    for bn, bk, nw, ns in ((32, 128, 4, 4), (64, 128, 4, 4), (64, 256, 8, 3), (32, 256, 4, 4),
                           (16, 256, 2, 4), (128, 64, 4, 6), (256, 64, 8, 4)):
        grid.append(dict(config=moe.FusedMoEConfig(d.gemm1, C(bm, bn, bk, 1, nw, ns))))
    if bm >= 64:   # the default tiles with the weights by TMA (KernelConfig.moe_tma_weights)
        grid.append(dict(config=moe.default_config(n, TOP_K + 1, EXPERTS + 1, torch.bfloat16,
                                                   tma_weights=True)))
    if n > 64:   # both GEMMs at a larger block_m (fewer row blocks per shared expert)
        for m, bn1, bn2, nw, ns in ((64, 64, 128, 4, 4), (64, 128, 128, 8, 3),
                                    (128, 64, 128, 8, 3), (128, 128, 256, 8, 3)):
            grid.append(dict(config=moe.FusedMoEConfig(C(m, bn1, 64, 4, nw, ns),
                                                       C(m, bn2, 64, 4, nw, ns))))
    name = f"fused_moe N={n} {'same8' if same else 'spread'} ({touched} experts)"
    sweep(name, rows, fns(), grid, lambda c: fns(**c), floor_us(nbytes, ceil), deadline)


def bench_moe_kernels(rows, ceil, w13, w2, n, same, calls=20):
    """fused_moe at n rows split into its launches: mean device us per call of each kernel
    (profiled, PDL off), and the call in a one-call graph with PDL on / off."""
    x = torch.randn(n, HIDDEN, device="cuda", dtype=torch.bfloat16)
    w, ids = moe_inputs(n, same)
    out = torch.empty_like(x)
    touched = int(torch.unique(ids).numel())
    row = {"case": f"moe_kernels N={n} {'same8' if same else 'spread'} ({touched} experts)",
           "floor_us": floor_us(touched * 3 * HIDDEN * MOE_INTER * 2, ceil)}
    for pdl in (True, False):
        row[f"graph_us_pdl_{'on' if pdl else 'off'}"] = per_call_us(
            [lambda pdl=pdl: moe.fused_moe(x, w13, w2, w, ids, out=out, pdl=pdl)])
    for _ in range(3):
        moe.fused_moe(x, w13, w2, w, ids, out=out)
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            moe.fused_moe(x, w13, w2, w, ids, out=out)
        torch.cuda.synchronize()
    per: dict[str, float] = {}
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            per[ev.name[:40]] = per.get(ev.name[:40], 0.0) + ev.device_time_total
    row["kernel_us"] = {k: round(v / calls, 2) for k, v in per.items()}
    print(f"{row['case']:<36} floor {row['floor_us']:.1f}  graph {row['graph_us_pdl_on']:.1f} "
          f"(PDL off {row['graph_us_pdl_off']:.1f}) us  kernels {row['kernel_us']}", flush=True)
    rows.append(row)


def bench_dense(rows, ceil, n, deadline, best, calls=4):
    """Each DENSE_SHAPES projection at n rows, `calls` weights back to back in one graph (their
    bytes exceed L2): the skinny GEMM (default config, then a grid) against cuBLAS. best
    collects shape key -> (fields, us, default us) for --write-configs."""
    import dataclasses

    from kdaserve.kernels.configs import shape_key
    from kdaserve.kernels.linear import skinny

    bf = torch.bfloat16
    for left, (name, (N, K)) in zip(range(len(DENSE_SHAPES), 0, -1), DENSE_SHAPES.items()):
        until = time.time() + max(0.0, deadline - time.time()) / left     # this shape's share
        ws = [torch.randn(N, K, device="cuda", dtype=bf) * K ** -0.5 for _ in range(calls)]
        x = torch.randn(n, K, device="cuda", dtype=bf)
        outs = [torch.empty(n, N, device="cuda", dtype=bf) for _ in range(calls)]
        want = torch.nn.functional.linear(x.float(), ws[0].float())

        def fns(cfg=None):
            return [lambda i=i: skinny.skinny_gemm(x, ws[i], out=outs[i], config=cfg, pdl=True)
                    for i in range(calls)]

        err = ((skinny.skinny_gemm(x, ws[0]).float() - want).norm() / want.norm()).item()
        cublas = per_call_us([lambda i=i: torch.nn.functional.linear(x, ws[i])
                              for i in range(calls)])
        bm = skinny.block_m(n)
        tiles = [skinny.SkinnyConfig(bn, bk, nw, st) for bn, bk, nw, st in itertools.product(
            (16, 32, 64, 128), (128, 256, 512), (4, 8), (3, 5))
            if (bm + bn) * bk * 2 * st <= 200 * 1024]
        # the default tile with its first weight tile read before the PDL wait first (the
        # budget may cut the rest), then every tile without and with that prefetch
        dflt = skinny.default_config(n, N, K, bf, torch.device("cuda"))
        grid = [dataclasses.replace(dflt, prefetch=1)] + tiles + [
            dataclasses.replace(c, prefetch=1) for c in tiles]
        before = len(rows)
        sweep(f"dense {name} N={n}", rows, fns(), grid, fns, floor_us(N * K * 2, ceil), until)
        row = rows[before]
        row.update(cublas_us=cublas, rel_err=err, shape=[n, N, K],
                   default_config=str(dflt))
        print(f"{'':<28} cuBLAS {cublas:7.1f} us, rel err {err:.1e}", flush=True)
        if row["best_config"] != "default":
            cfg = next(c for c in grid if str(c) == row["best_config"])
            best[shape_key(M=bm, N=N, K=K, dtype=bf)] = (dataclasses.asdict(cfg),
                                                         row["best_us"], row["default_us"])
        del ws, outs


def write_skinny_configs(config_dir: str, best: dict, gain: float = 0.02) -> None:
    """Merge each shape's fastest tile into config_dir/skinny_gemm_device_name=<GPU>.json where
    it beats the default by more than `gain`."""
    import json

    from kdaserve.kernels.configs import config_file_name

    path = Path(config_dir) / config_file_name("skinny_gemm", torch.cuda.get_device_name())
    merged = json.loads(path.read_text()) if path.is_file() else {}
    for key, (fields, us, base_us) in sorted(best.items()):
        if us < base_us * (1 - gain):
            merged[key] = fields
    path.write_text("{\n" + ",\n".join(f"  {json.dumps(k)}: {json.dumps(v)}"
                                        for k, v in sorted(merged.items())) + "\n}\n")
    print(f"wrote {path} ({len(merged)} shapes)", flush=True)


def bench_moe_prefill(rows, ceil, w13, w2, n, same):
    x = torch.randn(n, HIDDEN, device="cuda", dtype=torch.bfloat16)
    w, ids = moe_inputs(n, same)
    flops = 2 * n * (TOP_K + 1) * 3 * HIDDEN * MOE_INTER
    triton_ms = bench_ms(lambda: moe.fused_moe(x, w13, w2, w, ids))
    # the same tiles with the expert weights by TMA (KernelConfig.moe_tma_weights)
    tma_ms = bench_ms(lambda: moe.fused_moe(x, w13, w2, w, ids, tma_weights=True))
    floor_ms = flops / (ceil["bf16_gemm_TFLOPs"] * 1e9)
    row = {"case": f"moe_prefill N={n} {'same8' if same else 'spread'}", "floor_ms": floor_ms,
           "triton_ms": triton_ms, "triton_TFLOPs": flops / triton_ms / 1e9,
           "tma_ms": tma_ms, "tma_TFLOPs": flops / tma_ms / 1e9}
    print(f"{row['case']:<28} floor {floor_ms:.3f}  triton {triton_ms:.3f}  tma {tma_ms:.3f} ms",
          flush=True)
    rows.append(row)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--batches", default="16,32,64")
    ap.add_argument("--prefill-tokens", default="512,1024,2048,8000")
    ap.add_argument("--time-budget", type=float, default=240.0, help="seconds for the sweeps")
    ap.add_argument("--mla-rows-per-seq", type=int, default=1,
                    help="query rows a sequence in the MLA cases (9: K = 8 verify windows)")
    ap.add_argument("--mla-ctx", type=int, default=8192)
    ap.add_argument("--verify-requests", default="1,16,32",
                    help="kda_verify: requests of 9-token windows")
    ap.add_argument("--write-configs", metavar="DIR",
                    help="dense: merge the skinny GEMM's winning tiles into DIR")
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    start = start_gpu_run("bench_batch")
    if start is None:
        return 2
    t0, meta, ceil = start
    import triton

    print(f"triton {triton.__version__}, bf16 GEMM {ceil['bf16_gemm_TFLOPs']:.0f} TFLOP/s")
    cases = [c for c in args.cases.split(",") if c]
    batches = [int(b) for b in args.batches.split(",")]
    # the sweep budget: 45% MoE (two routings), 20% KDA, 35% MLA, split evenly over batches;
    # the first batch of each kind also pays the Triton compiles of its grid
    share = {"moe": 0.45 / 2, "kda": 0.20, "kda_verify": 0.10, "conv_verify": 0.05, "mla": 0.35,
             "dense": 0.50}
    kinds = [c for c in share if c in cases]
    total = sum(share[c] for c in kinds) or 1.0
    per = {c: args.time_budget * share[c] / total / len(batches) for c in kinds}
    rows: list[dict] = []
    if "moe_prefill" in cases:
        w13, w2 = moe_weights()
        for n in map(int, args.prefill_tokens.split(",")):
            for same in (True, False):
                bench_moe_prefill(rows, ceil, w13, w2, n, same)
        del w13, w2
    if "moe_kernels" in cases:
        w13, w2 = moe_weights()
        for n in [1] + batches:
            for same in (True, False) if n > 1 else (True,):
                bench_moe_kernels(rows, ceil, w13, w2, n, same)
        del w13, w2
    if "moe" in cases:
        w13, w2 = moe_weights()
        for n in batches:
            for same in (True, False):
                bench_moe(rows, ceil, w13, w2, n, same, time.time() + per['moe'])
        del w13, w2
    if "kda" in cases:
        for n in batches:
            bench_kda(rows, ceil, n, time.time() + per['kda'])
    if "kda_verify" in cases:   # --verify-requests windows of 1 + K = 9 tokens
        for n in map(int, args.verify_requests.split(",")):
            bench_kda_verify(rows, ceil, n, time.time() + per['kda_verify'])
    if "conv_verify" in cases:   # the same windows' conv
        for n in map(int, args.verify_requests.split(",")):
            bench_conv_verify(rows, ceil, n, time.time() + per['conv_verify'])
    if "mla" in cases:
        for b in batches:
            bench_mla(rows, ceil, b, time.time() + per['mla'], ctx=args.mla_ctx,
                      rows_per_seq=args.mla_rows_per_seq)
    if "dense" in cases:
        best: dict = {}
        for n in batches:
            bench_dense(rows, ceil, n, time.time() + per['dense'], best)
        if args.write_configs:
            write_skinny_configs(args.write_configs, best)
    write_results(args.out, meta, t0, ceil, rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
