# SPDX-License-Identifier: Apache-2.0
"""W2 `agentic-long` served at several parallel layouts: decode context parallelism against
plain tensor parallelism (shared/bench/workloads.md; the reference's DCP figures in
shared/reference/seed.md item 7).

For each layout (`TP` or `TPxDCP`, default 2 then 2x2) starts `kdaserve serve MODEL` with prefix
caching on and a max_model_len that holds a whole W2 request, waits for /health, runs `kdaserve
bench serve` (token-id prompts on /v1/completions: 120000 tokens of which the first 114000 are
shared by every request, 400 output tokens, ignore_eos; concurrency 1 then 2; the warm-up
request computes the shared prefix, the measured ones hit it), and stops the server. Per layout
it records the KV capacity (the start-up log line, and the /metrics gauge), TTFT, TPOT p50 and
the request errors of each level; the summary puts them next to the reference's.

    kdaserve make-model /tmp/k48 --preset kimi-linear-48b-a3b
    python benchmarks/w2_dcp.py /tmp/k48 --layouts 2,2x2 --out w2_dcp.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import sys
import time

import httpx

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from kdaserve.bench.launch import ServerProcess, start_recorded
from kdaserve.bench.report import git_commit, gpu_name
from kdaserve.bench.serve import add_cli_args, run_benchmark
from kdaserve.bench.server_metrics import parse_prometheus

BASE_SERVER_ARGS = ("--load-format dummy --max-model-len 122880 --max-num-seqs 16 "
                    "--max-num-batched-tokens 8192 --gpu-memory-utilization 0.90 "
                    "--enable-prefix-caching")
# The reference (seed.md item 7, TP8 -> DCP8 on its GPUs): KV capacity in tokens, and TPOT p50
# (ms) by concurrency.
REFERENCE = {"kv_cache_tokens": {"tp8": 1_930_000, "dcp8": 19_750_000},
             "p50_tpot_ms": {"tp8": {1: 13.8, 2: 16.2}, "dcp8": {1: 10.5, 2: 11.8}},
             "request_errors": 0}
SAFETY_S = 15.0
"""Kept back from the budget for server shutdowns and writing results."""


def parse_layout(text: str) -> tuple[int, int]:
    tp, _, dcp = text.lower().partition("x")
    return int(tp), int(dcp or 1)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model")
    p.add_argument("--layouts", default="2,2x2", help="comma list of TP or TPxDCP")
    p.add_argument("--base-server-args", default=BASE_SERVER_ARGS,
                   help="server flags of every layout. Default: %(default)r")
    p.add_argument("--server-args", default="", help="appended to every layout's flags")
    p.add_argument("--input-len", type=int, default=120_000)
    p.add_argument("--shared-prefix-len", type=int, default=114_000)
    p.add_argument("--output-len", type=int, default=400)
    p.add_argument("--concurrency", default="1,2")
    p.add_argument("--num-requests", type=int, default=4, help="measured requests per level")
    p.add_argument("--warmup", type=int, default=1,
                   help="warm-up requests per level (the first computes the shared prefix)")
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--time-budget", type=float, default=560.0,
                   help="whole run, server starts included (s), split over the layouts")
    p.add_argument("--startup-timeout", type=float, default=360.0)
    p.add_argument("--out-dir", default=".", help="server logs")
    p.add_argument("--out", default=None, help="the result JSON")
    args = p.parse_args(argv)
    args.layout_list = [parse_layout(x) for x in args.layouts.split(",") if x.strip()]
    return args


def bench_args(args: argparse.Namespace, server: ServerProcess, level_timeout: float,
               label: str) -> argparse.Namespace:
    argv = ["--base-url", server.base_url, "--endpoint", "completions", "--token-ids",
            "--input-len", str(args.input_len), "--shared-prefix-len",
            str(args.shared_prefix_len), "--output-len", str(args.output_len),
            "--concurrency", args.concurrency, "--warmup", str(args.warmup),
            "--seed", str(args.seed), "--ignore-eos", "--label", label,
            "--level-timeout", f"{level_timeout:.1f}", "--timeout", "900",
            "--num-requests", str(args.num_requests),
            "--server-flags", server.command_line, "--tokenizer", args.model]
    ns = add_cli_args(argparse.ArgumentParser()).parse_args(argv)
    ns.command_line = shlex.join([sys.executable, *sys.argv])
    return ns


def capacity_gauge(base_url: str) -> float | None:
    """kv_cache_capacity_tokens from the server's /metrics (None without it)."""
    try:
        resp = httpx.get(base_url + "/metrics", timeout=10.0, trust_env=False)
    except httpx.HTTPError:
        return None
    if resp.status_code != 200:
        return None
    return parse_prometheus(resp.text).get("kv_cache_capacity_tokens")


def level_row(name: str, record: dict, level: dict) -> dict:
    m = level["metrics"]
    counters = level.get("server_counters") or {}
    return {"layout": name, "concurrency": level["concurrency"],
            "kv_cache_tokens": record.get("server_capacity", {}).get("kv_cache_tokens"),
            "completed": m["completed"], "errors": m["failed"],
            "warmup_errors": level.get("warmup_failed"),
            "p50_tpot_ms": m.get("p50_tpot_ms"), "mean_tpot_ms": m["mean_tpot_ms"],
            "median_ttft_ms": m["median_ttft_ms"], "mean_ttft_ms": m["mean_ttft_ms"],
            "prefix_cache_hit_rate": counters.get("prefix_cache_hit_rate"),
            "prompt_tokens_match_rate": level.get("prompt_tokens_match_rate")}


def run_layout(args: argparse.Namespace, tp: int, dcp: int, deadline: float, log) -> dict:
    name = str(tp) if dcp == 1 else f"{tp}x{dcp}"
    flags = shlex.split(args.base_server_args) + shlex.split(args.server_args)
    server = ServerProcess(args.model, flags,
                           os.path.join(args.out_dir, f"w2_server_{name}.log"),
                           tensor_parallel_size=tp,
                           decode_context_parallel_size=dcp if dcp > 1 else None)
    record = {"layout": name, "tp": tp, "dcp": dcp, "status": "ok",
              "server_command": server.command_line, "server_log": server.log_path}
    log(f"[{name}] starting: {server.command_line}")
    with server:
        if not start_recorded(server, min(args.startup_timeout, deadline - time.monotonic()),
                              record, lambda msg: log(f"[{name}] {msg}")):
            return record
        record["kv_capacity_metric"] = capacity_gauge(server.base_url)
        levels = len(args.concurrency.split(","))
        level_timeout = max(1.0, (deadline - time.monotonic()) / levels)
        try:
            result = asyncio.run(run_benchmark(bench_args(args, server, level_timeout,
                                                          f"W2 {name}"),
                                               log=lambda s: log(f"[{name}] {s}")))
        except Exception as e:  # noqa: BLE001 - recorded; the next layout still runs
            record.update(status="failed", error=f"{type(e).__name__}: {e}",
                          server_log_tail=server.log_tail())
            log(f"[{name}] {record['error']}")
            return record
        record["bench"] = result
        record["rows"] = [level_row(name, record, lv) for lv in result["levels"]]
        if any(r["errors"] or r["warmup_errors"] for r in record["rows"]):
            record["status"] = "request errors"
    record["server_returncode"] = server.proc.returncode if server.proc else None
    return record


def format_markdown(rows: list[dict]) -> str:
    head = ["layout", "concurrency", "KV tokens", "completed", "errors", "TPOT p50 ms",
            "TTFT median ms", "prefix hit rate"]
    f = lambda v, fmt: "-" if v is None else fmt.format(v)
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        lines.append("| " + " | ".join([
            r["layout"], str(r["concurrency"]), f(r["kv_cache_tokens"], "{:,}"),
            str(r["completed"]), str(r["errors"]), f(r["p50_tpot_ms"], "{:.2f}"),
            f(r["median_ttft_ms"], "{:.0f}"), f(r["prefix_cache_hit_rate"], "{:.3f}")]) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    os.makedirs(args.out_dir, exist_ok=True)
    t_begin = time.monotonic()
    deadline = t_begin + args.time_budget - SAFETY_S

    def log(msg: str) -> None:
        print(f"[{time.monotonic() - t_begin:6.1f}s] {msg}", file=sys.stderr, flush=True)

    records = []
    for i, (tp, dcp) in enumerate(args.layout_list):
        share = (deadline - time.monotonic()) / (len(args.layout_list) - i)
        records.append(run_layout(args, tp, dcp, time.monotonic() + share, log))
    rows = [r for rec in records for r in rec.get("rows", [])]
    caps = {rec["layout"]: rec.get("server_capacity", {}).get("kv_cache_tokens")
            for rec in records}
    table = format_markdown(rows)
    result = {
        "workload": "W2 agentic-long", "command": shlex.join([sys.executable, *sys.argv]),
        "commit": git_commit(), "gpu": gpu_name(), "model": args.model,
        "config": {"input_len": args.input_len, "shared_prefix_len": args.shared_prefix_len,
                   "output_len": args.output_len, "concurrency": args.concurrency,
                   "warmup": args.warmup, "base_server_args": args.base_server_args,
                   "server_args": args.server_args},
        "kv_cache_tokens": caps, "rows": rows, "table_markdown": table,
        "status": {rec["layout"]: rec["status"] for rec in records},
        "reference": REFERENCE, "wall_s": time.monotonic() - t_begin, "layouts": records}
    print(table)
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return 0 if all(rec["status"] == "ok" for rec in records) else 1


if __name__ == "__main__":
    sys.exit(main())
