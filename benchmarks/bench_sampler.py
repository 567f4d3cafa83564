"""Sampler time per decode step on the GPU: greedy and W1's settings (temperature 1.0,
top_p 0.95), at the model's vocabulary, for a few batch sizes.

    python benchmarks/bench_sampler.py --vocab 163840 --batches 1,4,16 --out sampler.json

Times `Sampler.forward` (metadata built once, outside the timing) with CUDA events over many
iterations, for each sampler the engine can build: the full sort, the threshold search (top-k /
top-p), and the threshold search with the fused race draw (kernels/sample/race.py, the default);
the logits are random normal, so the top-p nucleus is wide (a pessimistic case for sort-free
methods, irrelevant for the full sort).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench_layers import bench_ms, capture  # noqa: E402

from kdaserve.bench.report import git_commit  # noqa: E402
from kdaserve.sample.metadata import SamplingMetadata  # noqa: E402
from kdaserve.sample.sampler import Sampler  # noqa: E402
from kdaserve.sampling_params import SamplingParams  # noqa: E402

SETTINGS = {
    "greedy": SamplingParams(temperature=0.0),
    "W1 (T=1, top_p=0.95)": SamplingParams(temperature=1.0, top_p=0.95),
    "T=1, top_k=50": SamplingParams(temperature=1.0, top_k=50),
}


def time_ms(fn, iters: int = 50) -> float:
    for _ in range(5):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def graph_us(fn, calls: int = 8) -> float:
    """One call's time inside a CUDA graph of `calls` back-to-back calls (launch cost as the
    decode graph pays it): bench_layers' capture and median replay time."""
    graph = capture(lambda: [fn() for _ in range(calls)])
    return bench_ms(graph.replay) * 1e3 / calls


def race_caps(batches: list[int], vocab: int, caps: list[int],
              programs: list[int] | None = None) -> list[dict]:
    """The race kernels alone at each RACE_MAX_SPLITS cap x RACE_PROGRAMS_PER_SM (module
    constants the launches read at call time; programs None: the current value): the
    exponential race over W1-tempered logits, and a DSpark Markov position (rank-32 bias added
    in place, then the race)."""
    from kdaserve.kernels.sample import race

    current = race.RACE_MAX_SPLITS, race.RACE_PROGRAMS_PER_SM
    rows = []
    try:
        for b in batches:
            logits = torch.randn(b, vocab, device="cuda")
            seeds = torch.arange(b, dtype=torch.int64, device="cuda")
            temp = torch.ones(b, device="cuda")
            emb = torch.randn(vocab, 32, device="cuda", dtype=torch.bfloat16)
            proj = torch.randn(vocab, 32, device="cuda", dtype=torch.bfloat16) * 0.01
            prev = torch.zeros(b, dtype=torch.int64, device="cuda")
            out = torch.zeros(b, dtype=torch.int64, device="cuda")
            for cap, per_sm in ((c, n) for c in caps for n in programs or [current[1]]):
                race.RACE_MAX_SPLITS, race.RACE_PROGRAMS_PER_SM = cap, per_sm
                splits = race.race_splits(b, vocab, torch.cuda.get_device_properties(0)
                                          .multi_processor_count)
                plain = graph_us(lambda: race.race_sample(logits, seeds, None, temp))
                markov = graph_us(lambda: race.markov_race(logits, emb, proj, prev, seeds,
                                                           temp, out))
                rows.append({"batch": b, "cap": cap, "programs_per_sm": per_sm,
                             "splits": splits[0],
                             "race_us": round(plain, 2), "markov_race_us": round(markov, 2)})
                print(f"race batch {b:>3} cap {cap:>4} x{per_sm:<2} ({splits[0]} splits): "
                      f"race {plain:7.2f} us, Markov position {markov:7.2f} us", flush=True)
    finally:
        race.RACE_MAX_SPLITS, race.RACE_PROGRAMS_PER_SM = current
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--vocab", type=int, default=163840)
    ap.add_argument("--batches", default="1,4,16")
    ap.add_argument("--race-caps", default="",
                    help="comma-separated RACE_MAX_SPLITS values: also time the race kernels "
                         "alone (race_sample, and a DSpark Markov position at rank 32) in a CUDA "
                         "graph at each cap, the current value first")
    ap.add_argument("--race-programs", default="",
                    help="comma-separated RACE_PROGRAMS_PER_SM values to time at each cap "
                         "(default: the current value)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_sampler.py needs a CUDA GPU")
    samplers = {"sort": Sampler(), "threshold": Sampler(threshold_kernel=True),
                "threshold + race": Sampler(threshold_kernel=True, race_kernel=True)}
    rows = []
    for b in (int(x) for x in args.batches.split(",")):
        logits = torch.randn(b, args.vocab, device="cuda")
        for name, sp in SETTINGS.items():
            md = SamplingMetadata.build([sp] * b, device="cuda")
            for label, sampler in samplers.items():
                ms = time_ms(lambda sampler=sampler: sampler(logits, md))
                rows.append({"batch": b, "setting": name, "sampler": label, "ms": ms})
                print(f"batch {b:>3}  {name:<22} {label:<17} {ms * 1e3:8.1f} us", flush=True)
    race_rows = race_caps([int(b) for b in args.batches.split(",")], args.vocab,
                          [int(c) for c in args.race_caps.split(",") if c],
                          [int(n) for n in args.race_programs.split(",") if n] or None)
    result = {"command": " ".join(sys.argv), "gpu": torch.cuda.get_device_name(),
              "commit": git_commit() or "unknown", "vocab": args.vocab, "rows": rows,
              "race_caps": race_rows}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
