"""Mixed steps (a prefill chunk among running decodes) against their parts, and bursts of new
requests: the engine's share of issue 19's TTFT and TPOT at concurrency 4-64.

    python benchmarks/bench_mixed.py MODEL_DIR --decodes 4,16,32,63 --bursts 4,16 --out mixed.json

One engine with the served flags of the issue-19 table (max_num_batched_tokens 8192,
max_model_len 12288, max_num_seqs 64, no prefix caching). Scheduling is synchronous while timing,
so each step() is one step and its wall time (device synchronised on both sides) is the step's:
- prefill alone: the step of one 8000-token prompt, median of --repeats;
- for B in --decodes: B requests decoding at ~8K context, decode-only steps (median of 8), then
  one new prompt joins: its first step (the B decodes + a chunk of up to 8192 - B prompt
  tokens) against prefill alone + decode alone;
- for c in --bursts: c prompts arrive at once, as a bench-serve level starts: each step's time
  and composition until every request has its first token, and each request's time to its
  first token from the first step (the engine's part of TTFT, client and HTTP excluded);
- with --profile: torch.profiler over a lone prefill step and over the second chunk of a
  --long-prompt (a chunk after cached context): wall time, kernel time, the largest kernels
  and the host ops with the most self time.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from kdaserve import SamplingParams  # noqa: E402
from kdaserve.bench.report import git_commit  # noqa: E402
from kdaserve.engine.llm_engine import LLMEngine  # noqa: E402
from kdaserve.entrypoints.openai.cli_args import optimization_config  # noqa: E402

BUDGET = 8192


def prompt(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(1000, vocab - 1000) for _ in range(n)]


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed_step(engine: LLMEngine) -> dict:
    """One synchronous step: its wall time and what it computed (prompt tokens, decode rows,
    requests whose prompt it finished)."""
    reqs = engine.scheduler.requests
    before = {rid: (r.num_computed_tokens, r.num_prompt_tokens) for rid, r in reqs.items()}
    sync()
    t = time.perf_counter()
    engine.step()
    sync()
    ms = (time.perf_counter() - t) * 1e3
    prefill = decodes = 0
    first_tokens = []
    for rid, (done, n_prompt) in before.items():
        r = reqs.get(rid)
        if r is None:
            continue
        delta = r.num_computed_tokens - done
        if done < n_prompt:
            prefill += delta
            if r.num_computed_tokens >= n_prompt:
                first_tokens.append(rid)
        elif delta:
            decodes += 1
    return {"ms": ms, "prefill_tokens": prefill, "decode_rows": decodes,
            "first_tokens": first_tokens}


def step_until(engine: LLMEngine, done) -> list[dict]:
    steps = []
    while not done():
        steps.append(timed_step(engine))
    return steps


def profile_one(engine: LLMEngine, label: str) -> dict:
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=acts) as prof:
        s = timed_step(engine)
    events = prof.key_averages()
    dev = sorted(((e.key, e.self_device_time_total / 1e3, e.count) for e in events
                  if e.self_device_time_total > 0), key=lambda x: -x[1])
    host = sorted(((e.key, e.self_cpu_time_total / 1e3, e.count) for e in events),
                  key=lambda x: -x[1])
    row = {"label": label, "wall_ms": s["ms"], "prefill_tokens": s["prefill_tokens"],
           "kernel_ms": sum(x[1] for x in dev),
           "top_kernels": [{"name": k[:120], "ms": ms, "calls": c} for k, ms, c in dev[:15]],
           "top_host_ops": [{"name": k[:120], "self_ms": ms, "calls": c}
                            for k, ms, c in host[:15]]}
    print(f"profile {label}: wall {s['ms']:.1f} ms (profiled), kernels {row['kernel_ms']:.1f} ms, "
          f"{s['prefill_tokens']} prompt tokens", flush=True)
    for k in row["top_kernels"][:10]:
        print(f"   {k['ms']:8.2f} ms {k['calls']:5d}x  {k['name'][:90]}", flush=True)
    print("   host self time:", flush=True)
    for k in row["top_host_ops"][:10]:
        print(f"   {k['self_ms']:8.2f} ms {k['calls']:5d}x  {k['name'][:90]}", flush=True)
    return row


def profile_steps(engine: LLMEngine, rng: random.Random, n: int, long_len: int,
                  sp: SamplingParams) -> list[dict]:
    """A lone prefill step, then the two chunks of a long_len prompt (the second one runs
    after the first one's cached context)."""
    rows = []
    engine.add_request("prof-a", prompt(rng, n, engine.vocab_size), sp)
    rows.append(profile_one(engine, f"prefill alone, {n} tokens"))
    engine.abort_request("prof-a")
    engine.add_request("prof-b", prompt(rng, long_len, engine.vocab_size), sp)
    rows.append(profile_one(engine, f"first chunk of {long_len}"))
    rows.append(profile_one(engine, f"second chunk of {long_len}, after cached context"))
    engine.abort_request("prof-b")
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--load-format", default="dummy")
    ap.add_argument("--prompt-len", type=int, default=8000)
    ap.add_argument("--max-model-len", type=int, default=12288)
    ap.add_argument("--decodes", default="4,16,32,63")
    ap.add_argument("--bursts", default="4,16")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--optimization-config", type=optimization_config, default={})
    ap.add_argument("--enforce-eager", action="store_true",
                    help="no CUDA graphs (a faster start; prompt-bearing steps run eager anyway)")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--long-prompt", type=int, default=12000)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    rng = random.Random(0)
    decodes = [int(x) for x in args.decodes.split(",") if x]
    bursts = [int(x) for x in args.bursts.split(",") if x]
    t0 = time.perf_counter()
    engine = LLMEngine.from_engine_args(
        model=args.model, load_format=args.load_format, max_model_len=args.max_model_len,
        max_num_seqs=64, max_num_batched_tokens=BUDGET, gpu_memory_utilization=0.9,
        enable_prefix_caching=False, enforce_eager=args.enforce_eager, **args.optimization_config)
    engine.engine_config.scheduler_config.async_scheduling = False   # one step() = one step
    result = {"command": " ".join(sys.argv), "commit": git_commit(),
              "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
              "torch": torch.__version__,
              "engine_start_s": time.perf_counter() - t0, "prompt_len": args.prompt_len}
    vocab, reqs, n = engine.vocab_size, engine.scheduler.requests, args.prompt_len
    long_run = SamplingParams(temperature=0.0, max_tokens=4000, ignore_eos=True)

    def prefilled(ids) -> bool:
        return all(reqs[i].num_computed_tokens >= reqs[i].num_prompt_tokens for i in ids)

    def add_prompts(prefix: str, count: int) -> list[str]:
        ids = [f"{prefix}-{i}" for i in range(count)]
        for rid in ids:
            engine.add_request(rid, prompt(rng, n, vocab), long_run)
        return ids

    # prefill alone (the first request also builds whatever the warm-up left)
    alone = []
    for i in range(args.repeats + 1):
        engine.add_request(f"p{i}", prompt(rng, n, vocab), long_run)
        steps = step_until(engine, lambda i=i: prefilled([f"p{i}"]))
        engine.abort_request(f"p{i}")
        if i:
            alone.append(steps[0]["ms"])
    result["prefill_alone_ms"] = alone
    prefill_ms = statistics.median(alone)
    print(f"prefill alone ({n} tokens): {prefill_ms:.1f} ms (runs {[round(x, 1) for x in alone]})",
          flush=True)

    result["mixed"] = []
    for b in decodes:
        ids = add_prompts(f"d{b}", b)
        step_until(engine, lambda: prefilled(ids))
        for _ in range(3):
            timed_step(engine)
        dec = [timed_step(engine) for _ in range(8)]
        decode_ms = statistics.median(s["ms"] for s in dec)
        engine.add_request(f"m{b}", prompt(rng, n, vocab), long_run)
        mixed = step_until(engine, lambda: prefilled([f"m{b}"]))
        after = [timed_step(engine) for _ in range(4)]
        engine.abort_request(ids + [f"m{b}"])
        first = mixed[0]
        parts = prefill_ms * first["prefill_tokens"] / n + decode_ms
        row = {"decodes": b, "decode_ms": decode_ms, "mixed_steps": mixed,
               "decode_after_ms": [s["ms"] for s in after],
               "first_mixed_ms": first["ms"], "parts_ms": parts,
               "excess_ms": first["ms"] - parts}
        result["mixed"].append(row)
        print(f"B={b}: decode {decode_ms:.2f} ms; mixed step ({first['prefill_tokens']} prompt "
              f"tokens + {first['decode_rows']} decodes) {first['ms']:.1f} ms against parts "
              f"{parts:.1f} (prefill scaled to its tokens + decode): excess "
              f"{first['ms'] - parts:+.1f} ms; then {[round(s['ms'], 1) for s in mixed[1:]]}",
              flush=True)

    result["bursts"] = []
    for c in bursts:
        ids = add_prompts(f"b{c}", c)
        steps, ttft, t_start = [], {}, time.perf_counter()
        while not prefilled(ids):
            s = timed_step(engine)
            steps.append(s)
            for rid in s["first_tokens"]:
                ttft[rid] = (time.perf_counter() - t_start) * 1e3
        engine.abort_request(ids)
        mean = statistics.mean(ttft.values())
        # the step that holds a request's last prompt token ends its TTFT: chunks of BUDGET
        # tokens (the last one shorter) at prefill alone's rate per token
        ideal = statistics.mean(min(-(-(k + 1) * n // BUDGET) * BUDGET, c * n) / n * prefill_ms
                                for k in range(c))
        row = {"concurrency": c, "steps": [{k: v for k, v in s.items() if k != "first_tokens"}
                                           for s in steps],
               "ttft_ms": [ttft[r] for r in ids], "mean_ttft_ms": mean,
               "mean_ttft_at_prefill_alone_rate_ms": ideal}
        result["bursts"].append(row)
        print(f"burst of {c}: {len(steps)} steps, mean engine TTFT {mean:.0f} ms (at the "
              f"prefill-alone rate: {ideal:.0f}); step ms "
              f"{[round(s['ms']) for s in steps][:20]}", flush=True)
    if args.profile:
        result["profile"] = profile_steps(engine, rng, n, args.long_prompt, long_run)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
