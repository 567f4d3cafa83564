"""Which engine steps compile or autotune kernels on first use, and how long they take.

    python benchmarks/first_steps.py MODEL_DIR --waves 4,16 --out first_steps.json
    python benchmarks/first_steps.py MODEL_DIR --async-scheduling --output-len 64 \
        --speculative-config '{"method":"dspark","model":DRAFT_DIR,"num_speculative_tokens":8}'

Serves W1-like waves in-process (N requests of 8000 prompt tokens arriving together, short
outputs, the seed server's flags, optionally a drafter), one step at a time with a device sync
around each, and logs per step: its composition (requests, prefill / verification / decode
rows, tokens), wall time, and every Triton kernel that was compiled or loaded from the disk
cache during it (Triton's JIT hooks) plus every autotuning run (Triton's autotune printout, on
stdout). Each wave runs twice: the second pass
shows the steady time of the same compositions, so a slow first step with no compile event
points elsewhere (fla's own caches, cuBLAS, the allocator).

Cold start-up (an empty Triton cache) with and without fla's stored configs, and the configs
fla's autotuning chose written where kdaserve ships them:

    TRITON_CACHE_DIR=$(mktemp -d) FLA_CACHE_MODE=disabled python benchmarks/first_steps.py \
        MODEL_DIR --waves '' --compile-workers 0 --dump-fla-configs kdaserve/kernels/configs/fla \
        --out cold.json
    TRITON_CACHE_DIR=$(mktemp -d) python benchmarks/first_steps.py MODEL_DIR --waves '' \
        --compile-workers 0 --out cold_stored.json
    TRITON_CACHE_DIR=$(mktemp -d) python benchmarks/first_steps.py MODEL_DIR --waves '' \
        --out cold_pool.json                    # the default pool
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from kdaserve import SamplingParams  # noqa: E402
from kdaserve.kernels.jit_log import CompileLog  # noqa: E402
from kdaserve.bench.report import git_commit  # noqa: E402
from kdaserve.engine.llm_engine import LLMEngine  # noqa: E402


def run_wave(engine: LLMEngine, log: CompileLog, tag: str, n: int, prompt_len: int,
             out_len: int, rng: random.Random, top_p: bool) -> list[dict]:
    vocab = engine.vocab_size
    for i in range(n):
        params = (SamplingParams(temperature=1.0, top_p=0.95, seed=i, max_tokens=out_len,
                                 ignore_eos=True) if top_p else
                  SamplingParams(temperature=0.0, max_tokens=out_len, ignore_eos=True))
        engine.add_request(f"{tag}-{i}", [rng.randrange(1000, vocab - 1000)
                                          for _ in range(prompt_len)], params)
    runner, seen = engine.model_runner, {}
    launch = runner.launch

    def spy(so):
        seen["so"] = so
        return launch(so)

    runner.launch = spy
    steps = []
    try:
        while engine.has_unfinished_requests():
            torch.cuda.synchronize()
            t = time.perf_counter()
            engine.step()
            torch.cuda.synchronize()
            ms = (time.perf_counter() - t) * 1e3
            so = seen.pop("so", None)
            rows = so.num_scheduled_tokens if so is not None else {}
            drafts = so.scheduled_spec_decode_tokens if so is not None else {}
            prefill = len(so.prefill_req_ids()) if so is not None else 0
            verify = sum(1 for r in rows if drafts.get(r))
            events = log.take()
            row = {"ms": round(ms, 2), "requests": len(rows), "prefill_rows": prefill,
                   "verify_rows": verify, "decode_rows": len(rows) - prefill - verify,
                   "tokens": sum(rows.values()), "compiles": events}
            if prefill or events or ms > 50:
                print(f"{tag}: {row['ms']:8.1f} ms  {row['requests']:2d} req "
                      f"({prefill} prefill, {verify} verify) {row['tokens']:5d} tok  compiles "
                      f"{[e['kernel'] + ':' + str(e['s']) for e in events]}", flush=True)
            steps.append(row)
    finally:
        runner.launch = launch
    return steps


def compile_summary(events: list[dict]) -> dict:
    """Compile (or disk-cache load) events: how many, their seconds, and per kernel (count,
    seconds), most seconds first. On an empty Triton cache an autotuned kernel shows one event
    per candidate config; the benchmarking between them is not in the seconds."""
    by: dict[str, list] = {}
    for e in events:
        n_s = by.setdefault(e["kernel"], [0, 0.0])
        n_s[0] += 1
        n_s[1] += e["s"]
    ranked = sorted(by.items(), key=lambda kv: -kv[1][1])
    return {"events": len(events), "seconds": round(sum(e["s"] for e in events), 2),
            "by_kernel": [(k, n, round(sec, 2)) for k, (n, sec) in ranked]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--waves", default="4,16",
                    help="requests per wave, comma list ('': start-up only)")
    ap.add_argument("--prompt-len", type=int, default=8000)
    ap.add_argument("--output-len", type=int, default=16)
    ap.add_argument("--sampling", choices=("greedy", "top_p"), default="greedy",
                    help="top_p: temperature 1, top_p 0.95, a seed per request")
    ap.add_argument("--async-scheduling", action="store_true",
                    help="as the server runs (step times then overlap the next launch)")
    ap.add_argument("--speculative-config", type=json.loads, default=None,
                    help="as kdaserve serve's (JSON), e.g. a DSpark drafter: "
                         '\'{"method":"dspark","model":DIR,"num_speculative_tokens":8,'
                         '"draft_sample_method":"probabilistic"}\'')
    ap.add_argument("--compile-workers", type=int, default=None,
                    help="the engine's compile_workers (start-up compiles in N processes; "
                         "0: none; default: the engine's, as many as the CPUs allow)")
    ap.add_argument("--dump-fla-configs", default=None, metavar="ROOT",
                    help="after start-up, write the configs fla's autotuners chose into "
                         "ROOT/{GPU}/ (kdaserve/kernels/configs/fla is the shipped root)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    log = CompileLog()
    t0 = time.perf_counter()
    engine = LLMEngine.from_engine_args(
        model=args.model, load_format="dummy", max_model_len=12288, max_num_seqs=32,
        max_num_batched_tokens=8192, gpu_memory_utilization=0.9,
        async_scheduling=args.async_scheduling, speculative_config=args.speculative_config,
        compile_workers=args.compile_workers)
    start_s = time.perf_counter() - t0
    compiles = log.take()
    result = {"command": " ".join(sys.argv), "commit": git_commit(),
              "gpu": torch.cuda.get_device_name(), "engine_start_s": start_s,
              "env": {k: os.environ.get(k) for k in ("TRITON_CACHE_DIR", "FLA_CACHE_MODE",
                                                     "FLA_CONFIG_DIR")},
              "start_summary": compile_summary(compiles), "start_compiles": compiles,
              "waves": []}
    summary = result["start_summary"]
    print(f"engine start {start_s:.1f} s, {summary['events']} kernels compiled or loaded in "
          f"{summary['seconds']:.1f} s; by kernel (count, s): {summary['by_kernel'][:12]}",
          flush=True)
    if args.dump_fla_configs:
        from pathlib import Path

        from kdaserve.kernels.fla_configs import device_traits, dump_configs

        result["fla_configs_written"] = dump_configs(torch.cuda.get_device_name(),
                                                     Path(args.dump_fla_configs),
                                                     traits=device_traits(0))
        print(f"fla configs written: {result['fla_configs_written']}", flush=True)
    rng = random.Random(0)
    for n in [int(x) for x in args.waves.split(",") if x]:
        for rep in (1, 2):
            steps = run_wave(engine, log, f"w{n}.{rep}", n, args.prompt_len, args.output_len, rng,
                             args.sampling == "top_p")
            slow = [s for s in steps if s["prefill_rows"]]
            result["waves"].append({"requests": n, "pass": rep, "steps": steps,
                                    "prefill_steps_ms": [s["ms"] for s in slow]})
            print(f"wave {n} pass {rep}: prefill-step ms {[s['ms'] for s in slow]}", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
