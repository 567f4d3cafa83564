"""Where a decode step's wall time goes, in-process on one GPU (a diagnostic, not a figure).

    python benchmarks/step_breakdown.py MODEL_DIR [--draft-model DIR] --out breakdown.json

For each case (batch, sampling, speculative or not) it starts requests with short random
prompts, runs them past prefill, then times `--steps` engine steps (CUDA-synchronised wall
time per step) and profiles the same steps with cProfile. The JSON holds ms/step per case and
the top functions by cumulative and by own time, so the host-side cost of a step (sampling
metadata, the sampler, detokenisation, drafting, the KDA commit) can be told apart from the
graph replay that bench_engine.py and the roofline time. On CUDA each case also records the
device side of the same steps (`device`: busy time against span from a torch.profiler trace,
the kernels with the most time, and each captured graph of the case's size replayed alone), so
a step can be told host-bound (busy well under the wall time) from device-bound.

Cases: greedy and W1 sampling (temperature 1.0, top_p 0.95, unseeded as the served W1's
requests: a seed gives a request its own generator, which no captured graph draws from) at the given
batches without speculation; with --draft-model instead, the W1 speculative config (8 drafts,
synthetic acceptance length 4.0; --draft-method dspark for a DSpark drafter) at the given spec batches (one engine per invocation: run
the script twice for both).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import random
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.prefill_gaps import busy_and_gaps, intervals  # noqa: E402
from benchmarks.profile_step import replay_ms  # noqa: E402
from kdaserve import SamplingParams  # noqa: E402
from kdaserve.bench.report import git_commit  # noqa: E402
from kdaserve.engine.llm_engine import LLMEngine  # noqa: E402
from kdaserve.entrypoints.openai.cli_args import optimization_config  # noqa: E402

SPEC = {"method": "draft_model", "num_speculative_tokens": 8,
        "rejection_sample_method": "synthetic", "synthetic_acceptance_length": 4.0}


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def sampling(kind: str) -> SamplingParams:
    if kind == "greedy":
        return SamplingParams(temperature=0.0, max_tokens=4000, ignore_eos=True)
    return SamplingParams(temperature=1.0, top_p=0.95, max_tokens=4000, ignore_eos=True)


def top_functions(prof: cProfile.Profile, key: str, n: int) -> list[dict]:
    st = pstats.Stats(prof, stream=io.StringIO())
    st.sort_stats(key)
    rows = []
    for func in st.fcn_list[:n]:
        cc, nc, tt, ct, _ = st.stats[func]
        rows.append({"function": f"{os.path.basename(func[0])}:{func[1]}({func[2]})",
                     "calls": nc, "own_ms": tt * 1e3, "cum_ms": ct * 1e3})
    return rows


def run_case(engine: LLMEngine, name: str, batch: int, kind: str, prompt_len: int,
             steps: int, rng: random.Random) -> dict:
    vocab = engine.vocab_size
    ids = [f"{name}-{i}" for i in range(batch)]
    for rid in ids:
        engine.add_request(rid, [rng.randrange(1000, vocab - 1000) for _ in range(prompt_len)],
                           sampling(kind))
    reqs = engine.scheduler.requests
    while any(reqs[rid].num_computed_tokens < prompt_len for rid in ids if rid in reqs):
        engine.step()
    for _ in range(5):
        engine.step()
    times = []
    for _ in range(steps):
        _sync()
        t = time.perf_counter()
        engine.step()
        _sync()
        times.append((time.perf_counter() - t) * 1e3)
    # Back to back, one sync at the end: the steady-state step under async scheduling, where
    # a step's host work overlaps the previous step's device work (the synced times above
    # serialise them).
    _sync()
    t = time.perf_counter()
    for _ in range(steps):
        engine.step()
    _sync()
    pipelined_ms = (time.perf_counter() - t) * 1e3 / steps
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(steps):
        engine.step()
    _sync()
    prof.disable()
    device = device_trace(engine, steps) if torch.cuda.is_available() else None
    if device:
        device["graph_replay_ms"] = graph_replay_times(engine, batch)
    engine.abort_request(ids)
    times.sort()
    out = {"case": name, "batch": batch, "sampling": kind, "median_step_ms": times[len(times) // 2],
           "mean_step_ms": sum(times) / len(times), "pipelined_step_ms": pipelined_ms,
           "top_cumulative": top_functions(prof, "cumulative", 40),
           "top_own": top_functions(prof, "tottime", 25), "device": device}
    print(f"{name}: batch {batch} {kind}: median {out['median_step_ms']:.2f} ms/step synced, "
          f"{pipelined_ms:.2f} ms/step back to back", flush=True)
    for r in out["top_cumulative"][:28]:
        print(f"   {r['cum_ms'] / steps:8.3f} ms/step cum {r['own_ms'] / steps:8.3f} own  "
              f"{r['calls'] // steps:>5}x  {r['function']}", flush=True)
    if device:
        print(f"  device: {device['busy_ms_per_step']:.3f} ms/step busy of "
              f"{device['span_ms_per_step']:.3f} ms/step span, {device['kernels_per_step']:.0f} "
              "kernels/step", flush=True)
        for g, ms in device["graph_replay_ms"].items():
            print(f"   {ms:8.3f} ms a replay: graph {g}", flush=True)
        for k in device["top_kernels"]:
            print(f"   {k['ms_per_step']:8.3f} ms/step {k['calls_per_step']:6.1f}x  {k['name']}",
                  flush=True)
    return out


def graph_replay_times(engine: LLMEngine, batch: int, reps: int = 20) -> dict[str, float]:
    """GPU time of each captured graph at this batch's capture size (decode forward, or the
    verify forward, its commit and a drafter's graphs), back-to-back replays on the inputs of
    the last step, CUDA events. Replays rewrite the same cache slots and scratch; the case's
    requests are aborted right after."""
    graphs = engine.model_runner.graphs
    if graphs is None or graphs.padded_size(batch) is None:
        return {}
    size = graphs.padded_size(batch)
    return {f"{d.mode.name.lower()}/{d.stage}/{d.num_reqs}x{d.tokens_per_req}":
            replay_ms(graphs.graph(d), reps) for d in graphs.batches() if d.num_reqs == size}


def device_trace(engine: LLMEngine, steps: int, top: int = 25) -> dict:
    """The device side of `steps` back-to-back steps (torch.profiler, CUDA activity only, kernels
    inside graph replays included): busy time (the union of kernel intervals) against the span
    from the first kernel to the last, and the kernels with the most time. Busy well under span
    means the step waits on the host; busy near span means the device work itself is the cost."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            engine.step()
        _sync()
    kernels, _ = intervals(prof)
    if not kernels:
        return None
    busy, _ = busy_and_gaps(kernels)
    per_name, each = {}, {}
    for s, e, name in kernels:
        t, n = per_name.get(name, (0.0, 0))
        per_name[name] = (t + e - s, n + 1)
        each.setdefault(name, []).append(e - s)
    span = max(e for _, e, _ in kernels) - kernels[0][0]
    rows = sorted(per_name.items(), key=lambda kv: -kv[1][0])[:top]
    return {"busy_ms_per_step": busy / 1e3 / steps, "span_ms_per_step": span / 1e3 / steps,
            "kernels_per_step": len(kernels) / steps,
            "top_kernels": [{"name": name[:100], "ms_per_step": t / 1e3 / steps,
                             "calls_per_step": n / steps,
                             "us_by_position": _by_position(each[name], steps)}
                            for name, (t, n) in rows]}


def _by_position(times_us: list[float], steps: int, most: int = 12) -> list[float] | None:
    """Mean time of a kernel's k-th launch within a step (e.g. each top-p search pass), for
    kernels launched the same small number of times every step; None otherwise."""
    if len(times_us) % steps or not 1 < len(times_us) // steps <= most:
        return None
    per = len(times_us) // steps
    return [round(sum(times_us[k::per]) / steps, 2) for k in range(per)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("--draft-model", default=None,
                    help="Run only the speculative cases, with this draft model (made first "
                         "when the folder has no config.json).")
    ap.add_argument("--draft-method", default="draft_model", choices=["draft_model", "dspark"],
                    help="The speculative config's method (the drafter made if missing is of it).")
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--spec-batches", default="1,4")
    ap.add_argument("--prompt-len", type=int, default=1000)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--load-format", default="dummy")
    ap.add_argument("--max-model-len", type=int, default=12288)
    ap.add_argument("--optimization-config", type=optimization_config, default={},
                    help="as `kdaserve serve`'s, e.g. '{\"pdl\": false}': kernel times in the "
                         "device trace overlap their predecessor's under PDL, so attributing a "
                         "step's time to kernels needs PDL off")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    rng = random.Random(0)
    result = {"command": " ".join(sys.argv), "commit": git_commit(),
              "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
              "cases": []}
    common = dict(model=args.model, load_format=args.load_format, max_model_len=args.max_model_len, max_num_seqs=32,
                  max_num_batched_tokens=8192, gpu_memory_utilization=0.9,
                  enable_prefix_caching=False, **args.optimization_config)
    if not args.draft_model:
        engine = LLMEngine.from_engine_args(**common)
        for b in (int(x) for x in args.batches.split(",")):
            for kind in ("greedy", "w1"):
                result["cases"].append(run_case(engine, f"nospec-{kind}-b{b}", b, kind,
                                                args.prompt_len, args.steps, rng))
    else:
        from kdaserve.models.make_model import make_draft_model, make_dspark_model

        if not os.path.isfile(os.path.join(args.draft_model, "config.json")):
            make = make_dspark_model if args.draft_method == "dspark" else make_draft_model
            make(args.model, args.draft_model)
        spec = {**SPEC, "method": args.draft_method, "model": args.draft_model}
        if args.draft_method == "dspark":
            spec["draft_sample_method"] = "probabilistic"
        engine = LLMEngine.from_engine_args(**common, speculative_config=spec)
        for b in (int(x) for x in args.spec_batches.split(",")):
            result["cases"].append(run_case(engine, f"spec-w1-b{b}", b, "w1", args.prompt_len,
                                            args.steps, rng))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
