"""Sort-free top-k / top-p threshold against the sampler's sort path, per decode step on the GPU.

    python benchmarks/bench_top_p.py --vocab 163840 --batches 1,4,16 --out top_p.json

For each batch and setting (top_p 0.95; top_k 50; top_k 50 + top_p 0.95) times, by CUDA-graph
replay (bench_layers.bench_graph_ms: median, no launch overhead):
- new:  tau = kdaserve.kernels.sample.top_p.top_k_top_p_threshold, then logits < tau -> -inf;
- sort: kdaserve.sample.sampler.apply_top_k_top_p with the host flags the sampler would pass.
floor = the masking's bytes (read + write the logits) / measured copy bandwidth. The logits are
random normal with standard deviation --scales (1: a wide top-p nucleus; 0.03: a dummy-weight
model's near-flat logits, where the search's window holds most tokens for several passes).
Also records the mean kept tokens of both, and with --tiles the new path at other search-pass
tiles (tokens a step, warps).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

SETTINGS = {"top_p 0.95": (0, 0.95), "top_k 50": (50, 1.0), "top_k 50 + top_p 0.95": (50, 0.95)}


def make_case(batch: int, vocab: int, top_k: int, top_p: float, scale: float = 1.0):
    """(logits [B, V], top_k [B] or None, top_p [B] or None) on the GPU; the logits normal with
    standard deviation `scale` (a dummy-weight model's are nearly flat: ~0.03)."""
    logits = torch.randn(batch, vocab, device="cuda") * scale
    k = torch.full((batch,), top_k, dtype=torch.int32, device="cuda") if top_k > 0 else None
    p = torch.full((batch,), top_p, dtype=torch.float32, device="cuda") if top_p < 1 else None
    return logits, k, p


def new_path(logits, k, p, tiles=None):
    from kdaserve.kernels.sample.top_p import top_k_top_p_threshold

    tau = top_k_top_p_threshold(logits, k, p, tiles=tiles)  # [B]
    return logits.masked_fill(logits < tau.unsqueeze(1), float("-inf"))


def sort_path(logits, k, p, top_k: int):
    from kdaserve.sample.sampler import apply_top_k_top_p

    return apply_top_k_top_p(logits, k, p, max_top_k=top_k, all_top_k=top_k > 0)


def bench_case(batch: int, vocab: int, name: str, copy_gbps: float,
               tiles: list[tuple[int, int]], scale: float = 1.0) -> dict:
    from bench_layers import bench_graph_ms

    top_k, top_p = SETTINGS[name]
    logits, k, p = make_case(batch, vocab, top_k, top_p, scale)
    kept_new = (new_path(logits, k, p) > float("-inf")).sum(1).double().mean().item()
    kept_sort = (sort_path(logits, k, p, top_k) > float("-inf")).sum(1).double().mean().item()
    new_ms = bench_graph_ms(lambda: new_path(logits, k, p))
    sort_ms = bench_graph_ms(lambda: sort_path(logits, k, p, top_k))
    floor_ms = 2 * logits.numel() * 4 / (copy_gbps * 1e6)
    print(f"batch {batch:>3}  scale {scale:<5g} {name:<22} new {new_ms * 1e3:8.1f} us  "
          f"sort {sort_ms * 1e3:8.1f} us  floor {floor_ms * 1e3:6.1f} us  "
          f"kept {kept_new:.1f} vs {kept_sort:.1f}", flush=True)
    by_tiles = {}
    for t in tiles:
        by_tiles[f"{t[0]}x{t[1]}"] = ms = bench_graph_ms(lambda t=t: new_path(logits, k, p, t))
        print(f"batch {batch:>3}  scale {scale:<5g} {name:<22} new, search tiles {t}: "
              f"{ms * 1e3:8.1f} us", flush=True)
    return {"batch": batch, "setting": name, "logit_scale": scale, "new_ms": new_ms,
            "sort_ms": sort_ms, "floor_ms": floor_ms, "speedup": sort_ms / new_ms,
            "kept_new": kept_new, "kept_sort": kept_sort, "new_ms_by_search_tiles": by_tiles}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--vocab", type=int, default=163840)
    ap.add_argument("--batches", default="1,4,16")
    ap.add_argument("--tiles", default="",
                    help="search-pass tiles to time besides the default, as TOKENSxWARPS "
                         "comma list (e.g. 64x1,128x2,512x4,1024x8)")
    ap.add_argument("--scales", default="1",
                    help="logit standard deviations, comma list (0.03: a dummy model's)")
    ap.add_argument("--settings", default=",".join(SETTINGS),
                    help=f"comma list of {list(SETTINGS)}")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    tiles = [tuple(int(v) for v in t.split("x")) for t in args.tiles.split(",") if t]
    if not torch.cuda.is_available():
        raise SystemExit("bench_top_p.py needs a CUDA GPU")
    from bench_layers import bench_meta, measure_ceilings, write_results

    t0 = time.time()
    ceil = measure_ceilings()
    names = [n.strip() for n in args.settings.split(",") if n.strip()]
    if bad := [n for n in names if n not in SETTINGS]:
        raise SystemExit(f"unknown --settings {bad}; choose from {list(SETTINGS)}")
    rows = [bench_case(int(b), args.vocab, name, ceil["copy_GBps"], tiles, float(sc))
            for sc in args.scales.split(",") for b in args.batches.split(",") for name in names]
    write_results(args.out, bench_meta(vocab=args.vocab), t0, ceil, rows)

if __name__ == "__main__":
    main()
