# SPDX-License-Identifier: Apache-2.0
"""The result JSONs of benchmarks/multi_gpu.sh that no benchmark script writes itself.

    python benchmarks/multi_gpu_report.py tests LOG OUT.json
        pytest -v output -> each test's outcome and the summary line's counts
    python benchmarks/multi_gpu_report.py merge OUT.json KEY=FILE ...
        several result JSONs under one file, one key each (bench_engine.py per layout)
    python benchmarks/multi_gpu_report.py guidellm OUT.json DIR ... [--server-log LOG]
        guidellm 0.8.1 runs (DIR/guidellm.json, one concurrency level each) -> per level the
        reference table's columns (mean latency, output tok/s, mean TTFT) and the request
        totals, next to the reference's rows (shared/reference/seed.md)

Every file carries command, commit and gpu (benchmarks/results conventions).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from kdaserve.bench.launch import parse_capacity
from kdaserve.bench.report import git_commit, gpu_name

# seed.md's headline table (8K prompt / 1K output, TP8, B300, DSpark K=8): concurrency ->
# (mean latency s, throughput tok/s, mean TTFT ms), vLLM v0.27.1 baseline and optimised.
SEED_REFERENCE = {"baseline": {1: (12.37, 83.3, 2262.9), 4: (23.67, 166.7, 2314.9),
                               16: (55.90, 258.3, 7601.1)},
                  "optimised": {1: (5.30, 183.3, 376.3), 4: (10.50, 416.7, 640.5),
                                16: (22.17, 725.0, 1121.0)}}
_TEST_LINE = re.compile(r"^(\S+::\S+)\s+(PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)")
_COUNT = re.compile(r"(\d+) (passed|failed|errors?|skipped|deselected|xfailed|xpassed)")


def provenance() -> dict:
    return {"command": shlex.join([sys.executable, *sys.argv]), "commit": git_commit(),
            "gpu": gpu_name()}


def tests_report(log_text: str) -> dict:
    outcomes = {}
    for line in log_text.splitlines():
        if m := _TEST_LINE.match(line.strip()):
            outcomes[m.group(1)] = m.group(2)
    summary = next((line for line in reversed(log_text.splitlines())
                    if _COUNT.search(line) and " in " in line), "")
    counts = {k.rstrip("s") if k.startswith("error") else k: int(n)
              for n, k in _COUNT.findall(summary)}
    return {"tests": outcomes, "counts": counts, "summary": summary.strip("= "),
            "ok": counts.get("passed", 0) > 0 and not counts.get("failed")
            and not counts.get("error")}


def guidellm_level(report: dict) -> list[dict]:
    """One row per benchmark (concurrency level) of a guidellm report."""
    rows = []
    for bench in report["benchmarks"]:
        m = bench["metrics"]
        ok = {k: m[k]["successful"] for k in ("request_latency", "output_tokens_per_second",
                                              "time_to_first_token_ms", "inter_token_latency_ms",
                                              "output_tokens_per_iteration")}
        totals = m["request_totals"]
        rows.append({"streams": bench["config"]["strategy"].get("streams"),
                     "duration_s": bench.get("duration"),
                     "successful": totals["successful"], "errored": totals["errored"],
                     "incomplete": totals["incomplete"],
                     "mean_latency_s": ok["request_latency"]["mean"],
                     "output_tok_s": ok["output_tokens_per_second"]["mean"],
                     "mean_ttft_ms": ok["time_to_first_token_ms"]["mean"],
                     "median_itl_ms": ok["inter_token_latency_ms"]["median"],
                     "output_tokens_per_iteration":
                         ok["output_tokens_per_iteration"]["mean"]})
    return rows


def guidellm_report(dirs: list[str], server_log: str | None) -> dict:
    levels, runs = [], []
    for d in dirs:
        path = os.path.join(d, "guidellm.json")
        if not os.path.isfile(path):
            runs.append({"dir": d, "status": "no guidellm.json"})
            continue
        with open(path) as f:
            report = json.load(f)
        rows = guidellm_level(report)
        levels += rows
        runs.append({"dir": d, "status": "ok", "guidellm": report.get("metadata"),
                     "spec": report.get("config", {}).get("spec")})
    out = {"levels": sorted(levels, key=lambda r: r["streams"] or 0), "runs": runs,
           "reference": {k: {str(c): dict(zip(("mean_latency_s", "output_tok_s",
                                                "mean_ttft_ms"), v)) for c, v in t.items()}
                         for k, t in SEED_REFERENCE.items()}}
    if server_log and os.path.isfile(server_log):
        with open(server_log, errors="replace") as f:
            out["server_capacity"] = parse_capacity(f.read())
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="kind", required=True)
    t = sub.add_parser("tests")
    t.add_argument("log")
    t.add_argument("out")
    mg = sub.add_parser("merge")
    mg.add_argument("out")
    mg.add_argument("items", nargs="+", metavar="KEY=FILE")
    g = sub.add_parser("guidellm")
    g.add_argument("out")
    g.add_argument("dirs", nargs="+")
    g.add_argument("--server-log", default=None)
    g.add_argument("--server-command", default=None)
    args = p.parse_args(argv)
    result = provenance()
    if args.kind == "tests":
        with open(args.log, errors="replace") as f:
            result.update(tests_report(f.read()))
    elif args.kind == "merge":
        result["runs"] = {}
        for item in args.items:
            key, _, path = item.partition("=")
            try:
                with open(path) as f:
                    result["runs"][key] = json.load(f)
            except (OSError, json.JSONDecodeError) as e:
                result["runs"][key] = {"status": "missing", "error": f"{path}: {e}"}
    else:
        result["server_command"] = args.server_command
        result.update(guidellm_report(args.dirs, args.server_log))
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
