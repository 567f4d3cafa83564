"""In-process hybrid prefix-cache benchmark on one GPU (issue 6 figures: W3 and W2).

    python benchmarks/bench_prefix.py MODEL_DIR --out results.json

W3 (shared/bench/workloads.md): 8000-token prompts whose first 7680 tokens were served once,
concurrency 1, internal checkpoint export vs the split-prefill baseline. Per mode and trial:
  cold  - a fresh 8000-token prompt (it exports the checkpoints it crosses: one forward pass
          with internal export, more with split);
  hit   - a prompt sharing its first 7680 tokens with the cold one (a new 320-token suffix).
TTFT here is in-process: wall time from add_request to the step that returns the first token
(no HTTP). Forward passes = engine steps until then; each request also records the steps until
every request of its group had its first token as (ms, scheduled tokens, requests). Both modes run on one loaded model: the
prefix cache's mode is switched while the engine is idle and the cache is reset between modes,
so each mode starts cold.

W2: a 114K-token shared prefix + 6K unique suffix, 400 output tokens: the first request
(cold), then later requests one at a time, then two at once (concurrency 2): TTFT of each, TPOT
p50, and the KV capacity the engine reported at start-up.
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



def tokens(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(1000, vocab - 1000) for _ in range(n)]


def track_scheduled_tokens(engine: LLMEngine) -> None:
    """engine.scheduler.last_scheduled_tokens: tokens of the latest step (for step records)."""
    schedule = engine.scheduler.schedule

    def traced():
        so = schedule()
        engine.scheduler.last_scheduled_tokens = so.total_num_scheduled_tokens
        return so
    engine.scheduler.schedule = traced


def serve(engine: LLMEngine, prompts: dict[str, list[int]], max_tokens: int) -> dict[str, dict]:
    """Run the prompts together to completion; per request: TTFT, forward passes to the first
    token, cached tokens, decode step times."""
    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    t0 = time.perf_counter()
    for rid, p in prompts.items():
        engine.add_request(rid, p, sp)
    rec = {rid: {"steps_to_first_token": 0, "itl_ms": []} for rid in prompts}
    last = {}
    steps = 0
    prefill_steps = []          # (ms, scheduled tokens, requests) of steps that ran a prefill
    while engine.has_unfinished_requests():
        t_step = time.perf_counter()
        outs = engine.step()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        now = time.perf_counter()
        steps += 1
        if any("ttft_ms" not in r for r in rec.values()):
            prefill_steps.append((round((now - t_step) * 1e3, 2),
                                  engine.scheduler.last_scheduled_tokens, len(rec)))
        for o in outs:
            r = rec[o.request_id]
            n = len(o.outputs[0].token_ids)
            if n and "ttft_ms" not in r:
                r["ttft_ms"] = (now - t0) * 1e3
                r["steps_to_first_token"] = steps
                r["num_cached_tokens"] = o.num_cached_tokens
            elif n > r.get("_n", 0):
                r["itl_ms"].append((now - last[o.request_id]) * 1e3)
            r["_n"] = n
            last[o.request_id] = now
    for r in rec.values():
        r["steps_until_all_first_tokens"] = prefill_steps
        r.pop("_n", None)
        itl = r.pop("itl_ms")
        r["tpot_p50_ms"] = statistics.median(itl) if itl else None
    return rec


def w3(engine: LLMEngine, rng: random.Random, vocab: int, trials: int, prefix_len: int,
       suffix_len: int) -> dict:
    pc = engine.scheduler.prefix_cache
    out = {}
    for mode in ("internal", "split"):
        engine.reset_prefix_cache()
        pc.split = mode == "split"
        rows = []
        for t in range(trials):
            prefix = tokens(rng, prefix_len, vocab)
            cold = serve(engine, {f"w3-{mode}-{t}-cold": prefix + tokens(rng, suffix_len, vocab)},
                         1)
            hit = serve(engine, {f"w3-{mode}-{t}-hit": prefix + tokens(rng, suffix_len, vocab)}, 1)
            rows.append({"cold": next(iter(cold.values())), "hit": next(iter(hit.values()))})
            print(f"W3 {mode} trial {t}: cold {rows[-1]['cold']['ttft_ms']:.1f} ms "
                  f"({rows[-1]['cold']['steps_to_first_token']} passes), hit "
                  f"{rows[-1]['hit']['ttft_ms']:.1f} ms ({rows[-1]['hit']['num_cached_tokens']} "
                  f"cached)", flush=True)
        out[mode] = {
            "trials": rows,
            "cold_ttft_ms_median": statistics.median(r["cold"]["ttft_ms"] for r in rows),
            "hit_ttft_ms_median": statistics.median(r["hit"]["ttft_ms"] for r in rows),
            "cold_forward_passes": [r["cold"]["steps_to_first_token"] for r in rows],
        }
    pc.split = engine.engine_config.cache_config.kda_checkpoint_mode == "split"
    return out


def w2(engine: LLMEngine, rng: random.Random, vocab: int, prefix_len: int, suffix_len: int,
       output_len: int) -> dict:
    engine.reset_prefix_cache()
    prefix = tokens(rng, prefix_len, vocab)
    res = {"first": serve(engine, {"w2-0": prefix + tokens(rng, suffix_len, vocab)}, output_len)}
    print(f"W2 first: {res['first']['w2-0']}", flush=True)
    res["later_c1"] = {}
    for i in (1, 2):
        res["later_c1"].update(serve(engine, {f"w2-{i}": prefix + tokens(rng, suffix_len, vocab)},
                                     output_len))
        print(f"W2 later c=1: {res['later_c1'][f'w2-{i}']}", flush=True)
    res["later_c2"] = serve(engine, {f"w2-{i}": prefix + tokens(rng, suffix_len, vocab)
                                     for i in (3, 4)}, output_len)
    print(f"W2 later c=2: {res['later_c2']}", flush=True)
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--load-format", default="dummy")
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("--w3-prefix", type=int, default=7680)
    ap.add_argument("--w3-suffix", type=int, default=320)
    ap.add_argument("--w2-prefix", type=int, default=114_000)
    ap.add_argument("--w2-suffix", type=int, default=6_000)
    ap.add_argument("--w2-output", type=int, default=400)
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192)
    ap.add_argument("--skip", default="", help="comma list of w2,w3 to skip")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    rng = random.Random(0)
    result = {"command": " ".join(sys.argv), "commit": git_commit(),
              "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu", "torch": torch.__version__,
              "ttft": "in-process: add_request to the step returning the first token"}
    t0 = time.perf_counter()
    max_len = args.w2_prefix + args.w2_suffix + args.w2_output + 64
    engine = LLMEngine.from_engine_args(
        model=args.model, load_format=args.load_format, max_model_len=max_len, max_num_seqs=32,
        max_num_batched_tokens=args.max_num_batched_tokens, gpu_memory_utilization=0.9,
        enable_prefix_caching=True,
        async_scheduling=False)   # one step() = one forward pass: serve() counts them
    result["engine_start_s"] = time.perf_counter() - t0
    rn = engine.model_runner
    result["kv_cache_tokens"] = rn.num_blocks * rn.block_size
    result["kda_state_slots"] = rn.num_slots
    result["checkpoint_interval"] = engine.engine_config.cache_config.checkpoint_interval
    vocab = engine.vocab_size
    track_scheduled_tokens(engine)
    serve(engine, {"warmup": tokens(rng, args.w3_prefix + args.w3_suffix, vocab)}, 4)      # compile/autotune outside timing
    print(json.dumps(result, indent=1), flush=True)
    if "w3" not in args.skip:
        result["W3"] = w3(engine, rng, vocab, args.trials, args.w3_prefix, args.w3_suffix)
    if "w2" not in args.skip:
        result["W2"] = w2(engine, rng, vocab, args.w2_prefix, args.w2_suffix, args.w2_output)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
