# SPDX-License-Identifier: Apache-2.0
"""W1 `seed-8k1k` / W1-nospec reference table (shared/bench/workloads.md) on one GPU machine.

For each config, starts `kdaserve serve MODEL --load-format dummy ...` (subprocess), waits for
/health, runs `kdaserve bench serve` (chat, streaming, 8000-token prompts, 1000 output tokens,
temperature 1.0, top_p 0.95, seed 42, ignore_eos) at concurrency 1, 4, 16, writes one JSON per
config into benchmarks/results/ and prints the table in the reference layout next to the
vLLM 0.26.0 and HF transformers reference points.

W1 adds `--speculative-config` (draft model, 8 tokens, synthetic acceptance length 4.0); a
server that refuses it (exits before /health) is recorded as refused. The run fits
`--time-budget` (default 10 min) by capping each level's duration and request count; prompt and
output lengths are never scaled.

    kdaserve make-model /tmp/k48 --preset kimi-linear-48b-a3b
    python benchmarks/seed_table.py /tmp/k48
    python benchmarks/seed_table.py /tmp/k48 --configs W1-nospec --server-args "--enforce-eager"
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import shlex
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from kdaserve.bench.launch import ServerProcess, start_recorded
from kdaserve.bench.report import git_commit, gpu_name
from kdaserve.bench.serve import add_cli_args, run_benchmark

RESULTS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")

# The reference server flags (vLLM 0.26.0 run of workloads.md).
BASE_SERVER_ARGS = ("--load-format dummy --max-num-seqs 32 --max-num-batched-tokens 8192 "
                    "--max-model-len 12288 --gpu-memory-utilization 0.90 "
                    "--no-enable-prefix-caching")
SPEC_CONFIG = {"method": "draft_model", "num_speculative_tokens": 8,
               "rejection_sample_method": "synthetic", "synthetic_acceptance_length": 4.0}
CONFIGS = ("W1-nospec", "W1")

# Reference points on one H200 (workloads.md). vLLM 0.26.0, W1-nospec:
# concurrency -> (mean latency s, output tok/s, mean TTFT ms, mean TPOT ms, median ITL ms)
VLLM_REF = {1: (4.17, 240.0, 209.7, 3.96, 3.95),
            4: (6.27, 637.1, 561.3, 5.72, 5.61),
            16: (7.95, 2006.7, 1497.7, 6.46, 4.92)}
# HF transformers 5.17 + fla-core 0.6.0, batch -> (TTFT ms, decode ms/step, output tok/s)
HF_REF = {1: (307.0, 91.8, 10.9), 4: (1131.0, 96.0, 41.7), 16: (4485.0, 114.6, 139.7)}
SAFETY_S = 20.0
"""Kept back from the budget for server shutdowns and writing results."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", help="Model folder (e.g. from `kdaserve make-model --preset "
                                 "kimi-linear-48b-a3b`).")
    p.add_argument("--configs", default=",".join(CONFIGS),
                   help="Comma list of W1, W1-nospec, run in this order. Default: %(default)s.")
    p.add_argument("--base-server-args", default=BASE_SERVER_ARGS,
                   help="Server flags of every config. Default: %(default)r.")
    p.add_argument("--server-args", default="",
                   help="Extra server flags appended to every config (ablations).")
    p.add_argument("--spec-config", default=json.dumps(SPEC_CONFIG),
                   help="W1's --speculative-config JSON. Default: %(default)s.")
    p.add_argument("--draft-model", default=None,
                   help="Draft model folder, put into the spec config's \"model\" (made if "
                        "missing: a DSpark drafter for \"method\": \"dspark\", else a small "
                        "draft model).")
    p.add_argument("--concurrency", default="1,4,16")
    p.add_argument("--input-len", type=int, default=8000)
    p.add_argument("--output-len", type=int, default=1000)
    p.add_argument("--endpoint", choices=["chat", "completions"], default="chat")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--level-duration", type=float, default=150.0,
                   help="Cap on each level's measured phase (s). Default: %(default)s.")
    p.add_argument("--time-budget", type=float, default=600.0,
                   help="Whole run, server starts included (s). Default: %(default)s.")
    p.add_argument("--startup-timeout", type=float, default=420.0,
                   help="Longest wait for a server's /health (s). Default: %(default)s.")
    p.add_argument("--out-dir", default=RESULTS_DIR)
    p.add_argument("--tag", default=None, help="File name tag. Default: UTC time stamp.")
    p.add_argument("--hf-results", default=None,
                   help="JSON from benchmarks/hf_baseline.py to show as measured HF rows.")
    p.add_argument("--port", type=int, default=None)
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=None,
                   help="The server's --tensor-parallel-size (default: the server's, 1).")
    p.add_argument("--decode-context-parallel-size", "-dcp", type=int, default=None,
                   help="The server's --decode-context-parallel-size (default: the server's, "
                        "1).")
    args = p.parse_args(argv)
    args.configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    bad = [c for c in args.configs if c not in CONFIGS]
    if bad or not args.configs:
        p.error(f"--configs takes {', '.join(CONFIGS)}; got {args.configs}")
    args.tag = args.tag or datetime.datetime.now(datetime.UTC).strftime("%Y%m%dT%H%M%S")
    return args


def server_args_for(args: argparse.Namespace, config: str) -> list[str]:
    flags = shlex.split(args.base_server_args) + shlex.split(args.server_args)
    if config == "W1":
        spec = json.loads(args.spec_config)
        if args.draft_model:
            if not os.path.isfile(os.path.join(args.draft_model, "config.json")):
                # a random drafter of the spec's method (the synthetic acceptance decides what
                # is accepted; the drafter's weights only have to run)
                from kdaserve.models.make_model import make_draft_model, make_dspark_model

                make = make_dspark_model if spec.get("method") == "dspark" else make_draft_model
                make(args.model, args.draft_model)
            spec["model"] = args.draft_model
        flags += ["--speculative-config", json.dumps(spec)]
    return flags


def bench_args(args: argparse.Namespace, server: ServerProcess, concurrency: int,
               duration: float, level_timeout: float, label: str) -> argparse.Namespace:
    argv = ["--base-url", server.base_url, "--endpoint", args.endpoint,
            "--level-timeout", f"{level_timeout:.1f}",
            "--input-len", str(args.input_len), "--output-len", str(args.output_len),
            "--concurrency", str(concurrency), "--num-requests", str(2 * concurrency),
            "--duration", f"{duration:.1f}", "--warmup", str(args.warmup),
            "--seed", str(args.seed), "--temperature", "1.0", "--top-p", "0.95",
            "--ignore-eos", "--label", label, "--server-flags", server.command_line,
            "--timeout", "900", "--tokenizer", args.model]
    if args.endpoint == "completions":
        argv.append("--token-ids")
    ns = add_cli_args(argparse.ArgumentParser()).parse_args(argv)
    ns.command_line = shlex.join([sys.executable, *sys.argv])
    return ns


def run_config(args: argparse.Namespace, config: str, deadline: float, log) -> dict:
    """Start the server, run every level inside `deadline` (time.monotonic), stop it."""
    levels = [int(c) for c in args.concurrency.split(",")]
    log_path = os.path.join(args.out_dir, f"seed_table_{args.tag}_{config}_server.log")
    server = ServerProcess(args.model, server_args_for(args, config), log_path, port=args.port,
                           tensor_parallel_size=args.tensor_parallel_size,
                           decode_context_parallel_size=args.decode_context_parallel_size)
    record = {"workload": config, "status": "ok", "tag": args.tag,
              "server_command": server.command_line, "server_log": log_path, "levels": []}
    log(f"[{config}] starting: {server.command_line}")
    with server:
        if not start_recorded(server, min(args.startup_timeout, deadline - time.monotonic() - 30.0),
                              record, lambda msg: log(f"[{config}] {msg}")):
            return record
        est_request_s = 0.0  # mean E2E latency of the previous level: the drain reserve
        for i, conc in enumerate(levels):
            share = (deadline - time.monotonic()) / (len(levels) - i)
            # Warm-ups take about one request time per round, the drain one more.
            warm_rounds = -(-args.warmup // max(min(conc, args.warmup), 1)) if args.warmup else 0
            duration = min(args.level_duration, share - (warm_rounds + 1) * est_request_s)
            if duration < 1.0:
                record["levels"].append({"concurrency": conc, "skipped": "time budget"})
                log(f"[{config}] concurrency {conc}: skipped (time budget)")
                continue
            # Hard stop: requests still running past it are cancelled (counted as failed).
            level_timeout = min(deadline - time.monotonic(), 1.5 * share)
            try:
                result = asyncio.run(run_benchmark(
                    bench_args(args, server, conc, duration, level_timeout, config),
                    log=lambda s: log(f"[{config}] {s}")))
            except Exception as e:  # noqa: BLE001 - record it; the other configs still run
                record["status"] = "failed"
                record["error"] = f"concurrency {conc}: {type(e).__name__}: {e}"
                record["server_log_tail"] = server.log_tail()
                log(f"[{config}] {record['error']}")
                break
            level = result.pop("levels")[0]
            level["duration_cap_s"] = duration
            record["levels"].append(level)
            for k, v in result.items():
                record.setdefault(k, v)
            est_request_s = level["metrics"]["mean_e2el_ms"] / 1000.0
    record["server_returncode"] = server.proc.returncode if server.proc else None
    return record


# ---------------------------------------------------------------------------------------------
# Table


def _row(name: str, conc: int, lat_s, tok_s, ttft, tpot, itl, note: str = "") -> list[str]:
    f = lambda v, fmt: "-" if v is None else fmt.format(v)
    return [name, str(conc), f(lat_s, "{:.2f} s"), f(tok_s, "{:.1f}"), f(ttft, "{:.1f} ms"),
            f(tpot, "{:.2f} ms"), f(itl, "{:.2f} ms"), note]


def _note(record: dict, level: dict, same_lengths: bool) -> str:
    m = level["metrics"]
    parts = [f"{m['completed']} req" + (f", {m['failed']} failed" if m["failed"] else "")]
    if level.get("stopped_by") in ("duration", "level_timeout"):
        parts.append(level["stopped_by"].replace("_", " "))
    vr = VLLM_REF.get(level["concurrency"])
    if same_lengths and vr and m["output_throughput"]:
        parts.append(f"{m['output_throughput'] / vr[1]:.2f}x vLLM tok/s")
    if record["workload"] == "W1":
        c = level.get("server_counters") or {}
        if not c:
            parts.append("spec: no /metrics")
        elif not c.get("spec_decode_num_draft_tokens"):
            parts.append("spec: NO drafts (not active)")
        else:
            rate = c.get("spec_decode_acceptance_rate", 0.0)
            parts.append(f"spec acceptance {rate:.2f}" + (
                f", length {c['spec_decode_acceptance_length']:.2f}"
                if "spec_decode_acceptance_length" in c else ""))
    return "; ".join(parts)


def table_rows(records: list[dict], concurrency: list[int], input_len: int, output_len: int,
               hf_measured: dict | None) -> list[list[str]]:
    """Rows grouped by concurrency: each kdaserve config, then the reference points (measured
    with 8000-token prompts and 1000 output tokens; ratios only when the lengths match)."""
    same_lengths = (input_len, output_len) == (8000, 1000)
    rows = []
    for c in concurrency:
        for r in records:
            lv = next((x for x in r["levels"] if x["concurrency"] == c), None)
            name = f"kdaserve {r['workload']}"
            if lv is None or "skipped" in lv:
                status = r["status"] if r["status"] != "ok" else "skipped (time budget)"
                rows.append(_row(name, c, None, None, None, None, None, status))
                continue
            m = lv["metrics"]
            rows.append(_row(name, c, m["mean_e2el_ms"] / 1000, m["output_throughput"],
                             m["mean_ttft_ms"], m["mean_tpot_ms"], m["median_itl_ms"],
                             _note(r, lv, same_lengths)))
        if c in VLLM_REF:
            rows.append(_row("vLLM 0.26.0 W1-nospec (ref)", c, *VLLM_REF[c], "8000/1000"))
        for name, ref, out_len in (
                ("HF transformers+fla (ref)", HF_REF.get(c), 1000),
                ("HF transformers (measured)", (hf_measured or {}).get(c), output_len)):
            if ref:
                ttft, step, tok_s = ref
                rows.append(_row(name, c, (ttft + (out_len - 1) * step) / 1000, tok_s, ttft,
                                 step, step, "batch = concurrency; latency/TPOT/ITL derived"))
    return rows


def format_markdown(rows: list[list[str]]) -> str:
    head = ["config", "concurrency", "mean latency", "output tok/s", "mean TTFT", "mean TPOT",
            "median ITL", "note"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def load_hf_measured(path: str | None) -> dict | None:
    if not path:
        return None
    with open(path) as f:
        hf = json.load(f)
    return {b["batch_size"]: (b["ttft_ms"], b["decode_ms_per_step"], b["output_tok_s"])
            for b in hf["batches"] if "ttft_ms" in b}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    os.makedirs(args.out_dir, exist_ok=True)
    t_begin = time.monotonic()
    deadline = t_begin + args.time_budget - SAFETY_S

    def log(msg: str) -> None:
        print(f"[{time.monotonic() - t_begin:6.1f}s] {msg}", file=sys.stderr, flush=True)

    records, files = [], []
    for i, config in enumerate(args.configs):
        config_deadline = time.monotonic() + (deadline - time.monotonic()) / (len(args.configs) - i)
        record = run_config(args, config, config_deadline, log)
        record["wall_s"] = time.monotonic() - t_begin
        path = os.path.join(args.out_dir, f"seed_table_{args.tag}_{config}.json")
        with open(path, "w") as f:
            json.dump(record, f, indent=1)
        files.append(path)
        records.append(record)
        log(f"[{config}] wrote {path}")

    rows = table_rows(records, [int(c) for c in args.concurrency.split(",")], args.input_len,
                      args.output_len, load_hf_measured(args.hf_results))
    table = format_markdown(rows)
    summary = {
        "tag": args.tag, "model": args.model, "gpu": gpu_name(), "commit": git_commit(),
        "command": shlex.join([sys.executable, *sys.argv]), "files": files,
        "wall_s": time.monotonic() - t_begin, "input_len": args.input_len,
        "output_len": args.output_len, "table_markdown": table,
        "reference": {"vllm_0_26_w1_nospec": VLLM_REF, "hf_transformers_fla": HF_REF},
        "status": {r["workload"]: r["status"] for r in records},
    }
    summary_path = os.path.join(args.out_dir, f"seed_table_{args.tag}.json")
    with open(summary_path, "w") as f:
        json.dump(summary, f, indent=1)
    print(f"W1 seed-{args.input_len}/{args.output_len} on {summary['gpu']} "
          f"(kdaserve {summary['commit']}), {summary['wall_s']:.0f} s\n")
    print(table)
    print(f"\nresults: {summary_path}")
    return 0 if all(r["status"] == "ok" for r in records) else 1


if __name__ == "__main__":
    sys.exit(main())
