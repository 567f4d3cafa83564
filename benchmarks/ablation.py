# SPDX-License-Identifier: Apache-2.0
"""Ablation of the engine's optimisation switches (shared/bench/workloads.md, W1 "ablation").

Every optimisation with an engine flag is a switch whose "off" is the plain baseline path. The
driver runs the workload with all switches on, all off, and each switch off alone; per run it
starts `kdaserve serve` with exactly those switch values, runs `bench serve` at each concurrency
level, stops the server and writes one JSON (`<run>.json`) into the output directory. Then it
prints a summary table (output tok/s, mean TTFT, mean TPOT per run and level) and writes
`summary.json`, built from every run JSON in the directory: an ablation may be run in slices
(`--runs`, same `--out-dir`) and summarised at the end.

The switches (SWITCHES below), each passed explicitly in every run, "on" included; "optimization
key" = a key of the server's --optimization-config JSON, "spec key" = of --speculative-config:
  kda-checkpoint-mode   optimization key "kda_checkpoint_mode": internal | split   (W3: prefix
                        caching on, shared prefix; does nothing with prefix caching off)
  adaptive-spec-budget  optimization key "adaptive_spec_budget": true | false   (spec on;
                        matters for long prompts: the static rule takes (K-1) x max_num_seqs
                        tokens off every step's budget)
  kda-state-mode        spec key "kda_state_mode": recover | per_position   (spec on)
  batch-layout          spec key "batch_layout": contiguous | gather   (spec on)
  draft-catchup         spec key "draft_catchup": window | varlen   (draft model on: K+1-row
                        catch-up windows in CUDA graphs vs an eager varlen prefill)
  sampling-threshold-kernel  optimization key "sampling_threshold_kernel": true | false
                        (sort-free top-k / top-p threshold search; W1 samples with top_p 0.95)
  async-scheduling      --async-scheduling | --no-...   (step N+1 scheduled before step N's ids
                        reach the host; CPU too; no spec config: the engine steps one at a
                        time under speculative decoding)
  fused-kda-decode      optimization key "fused_kda_decode": true | false   (one launch per KDA
                        layer in a plain decode step; CUDA; no spec rows: a draft model drafts
                        every step)
  pdl                   optimization key "pdl": true | false   (programmatic dependent launch in
                        the captured decode and verify graphs; CUDA, sm_90+)
  decode-gemv           optimization key "decode_gemv": true | false   (Triton GEMV projections
                        of 1-2 row plain decode steps, i.e. concurrency 1-2; CUDA; no spec rows)
Other kernel-level fusions (shared-expert fold, fused MoE, fused recurrent KDA, ...) have no
engine flag and are not switches here. --decode-gemv is on by default since, with PDL, it won at
batch 1 (benchmarks/results/decode_variants_h200.json: b1 decode graph 2.347 ms with
gemv+pdl+fused-kda-decode against 2.441 ms without the GEMV); it routes 1-2 rows only (it lost
at 4). "all-on" is the engine default.

`--runs auto` (default) does all-on, all-off and the one-off runs of the switches the workload
exercises (W1 with a draft model leaves out fused-kda-decode and decode-gemv: every target
step is a verify step; with ngram async-scheduling too, its steps run one at a time;
`--spec-method none`, W1-nospec, exercises them); `--runs
all` every one-off run; or a comma list (all-on,all-off,no-batch-layout,...).
`--time-budget` bounds the whole invocation: it is split over runs and levels, each level's
request count and duration cap shrink to fit; prompt and output lengths never do.

    kdaserve make-model /tmp/k48 --preset kimi-linear-48b-a3b
    # /tmp/k48-draft is made on first use (small preset, the target's vocabulary)
    python benchmarks/ablation.py /tmp/k48 --workload W1 --draft-model /tmp/k48-draft
    python benchmarks/ablation.py /tmp/k48 --workload W1 --spec-method none   # W1-nospec
    python benchmarks/ablation.py /tmp/k48 --workload W3
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import datetime
import glob
import json
import os
import shlex
import sys
import time
from collections.abc import Callable

BENCH_DIR = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(BENCH_DIR))
sys.path.insert(0, BENCH_DIR)

from seed_table import SPEC_CONFIG, bench_args

from kdaserve.bench.launch import ServerProcess, start_recorded
from kdaserve.bench.report import git_commit, gpu_name
from kdaserve.bench.serve import run_benchmark
from kdaserve.entrypoints.openai.cli_args import optimization_config
from kdaserve.models.make_model import make_draft_model

RESULTS_DIR = os.path.join(BENCH_DIR, "results", "ablation")
RESULT_FORMAT_VERSION = 2
"""2: the optimisation switches are --optimization-config keys (their setting records
`optimization_key` and `value`; the run records `optimization_config`)."""
SAFETY_S = 20.0
"""Kept back from the budget for server shutdowns and writing results."""


# ---------------------------------------------------------------------------------------------
# Switches and workloads


@dataclasses.dataclass(frozen=True)
class Switch:
    """One optimisation. A server-flag switch passes `flag_on` / `flag_off`; a config-key switch
    sets `key` to `value_on` / `value_off` in the JSON of its `config`: "optimization" (the
    server's --optimization-config) or "spec" (--speculative-config)."""

    name: str
    baseline: str
    """What "off" runs."""
    workload: str
    """The workload that exercises it."""
    needs: str
    """"spec" (a speculative config), "draft" (a draft-model spec config), "prefix" (prefix
    caching + a shared prefix), "decode" (any workload: decode steps; kernel switches that only
    act on a CUDA server), "plain-decode" (decode steps without spec rows: no spec config, or
    ngram, whose steps without drafts are plain decode steps; CUDA) or "overlap" (steps that
    async scheduling can overlap: no spec config, or a drafter proposing on the device)."""
    flag_on: tuple[str, ...] = ()
    flag_off: tuple[str, ...] = ()
    config: str | None = None
    key: str | None = None
    value_on: str | bool | None = None
    value_off: str | bool | None = None

    def value(self, on: bool) -> str | bool | None:
        return self.value_on if on else self.value_off

    def setting(self, on: bool, has_spec: bool) -> dict:
        """How this switch is passed in a run, as recorded in the run JSON (a spec-key value is
        None when the run has no speculative config to carry it)."""
        if self.config == "spec":
            return {"on": on, "spec_key": self.key,
                    "value": self.value(on) if has_spec else None}
        if self.config == "optimization":
            return {"on": on, "optimization_key": self.key, "value": self.value(on)}
        return {"on": on, "server_flags": list(self.flag_on if on else self.flag_off)}


def optimization_switch(name: str, **kw) -> Switch:
    """A switch that is the --optimization-config key `name` with dashes as underscores, true
    for on and false for off unless `value_on` / `value_off` say otherwise."""
    return Switch(name, config="optimization", key=name.replace("-", "_"),
                  **{"value_on": True, "value_off": False, **kw})


def spec_switch(name: str, **kw) -> Switch:
    """A switch that is the --speculative-config key `name` with dashes as underscores."""
    return Switch(name, config="spec", key=name.replace("-", "_"), **kw)


SWITCHES: tuple[Switch, ...] = (
    optimization_switch(
        "kda-checkpoint-mode", workload="W3", needs="prefix",
        baseline="split: a prefill crossing a KDA checkpoint ends its chunk there (one more "
                 "forward pass) instead of exporting the state from inside the same pass",
        value_on="internal", value_off="split"),
    optimization_switch(
        "adaptive-spec-budget", workload="W1", needs="spec",
        baseline="static spec budget: (K - 1) x max_num_seqs draft slots reserved from every "
                 "step's token budget (long prompts take more prefill chunks)"),
    spec_switch("kda-state-mode", workload="W1", needs="spec",
                baseline="per_position: the KDA state after every verified window token is "
                         "written into 1 + K slots per request and the accepted one kept",
                value_on="recover", value_off="per_position"),
    spec_switch("batch-layout", workload="W1", needs="spec",
                baseline="gather: plain request order, each KDA group index_selected / "
                         "index_copied out of the mixed batch",
                value_on="contiguous", value_off="gather"),
    spec_switch("draft-catchup", workload="W1", needs="draft",
                baseline="varlen: the draft model's catch-up over the accepted tokens is an "
                         "eager varlen prefill of exactly those tokens (no CUDA graph)",
                value_on="window", value_off="varlen"),
    optimization_switch(
        "sampling-threshold-kernel", workload="W1", needs="decode",
        baseline="top-k / top-p by a full sort of the vocabulary per row (CUDA only; the CPU "
                 "always sorts)"),
    Switch("async-scheduling", workload="W1", needs="overlap",
           baseline="one step at a time: the next step is scheduled only after the last step's "
                    "sampled ids reached the host (the host work of each step no longer "
                    "overlaps the device work)",
           flag_on=("--async-scheduling",), flag_off=("--no-async-scheduling",)),
    optimization_switch(
        "fused-kda-decode", workload="W1", needs="plain-decode",
        baseline="five launches per KDA layer in a decode step (conv update, f_b/g_b bmm, fla "
                 "fused recurrent, beta copy, gated norm) instead of one"),
    optimization_switch(
        "pdl", workload="W1", needs="decode",
        baseline="the decode graphs' Triton kernels launched without programmatic dependent "
                 "launch"),
    optimization_switch(
        "decode-gemv", workload="W1", needs="plain-decode",
        baseline="projections of 1-2 row decode batches on cuBLAS instead of the Triton GEMV"),
)
SWITCH_NAMES = tuple(s.name for s in SWITCHES)
RESERVED_SERVER_FLAGS = ("--speculative-config", "-sc", "--optimization-config",
                         "--enable-prefix-caching", "--no-enable-prefix-caching",
                         "--load-format", "--device",
                         *{f for s in SWITCHES for f in (*s.flag_on, *s.flag_off)
                           if f.startswith("-")})
"""Flags the driver sets itself; --server-args may not carry them."""


@dataclasses.dataclass(frozen=True)
class Workload:
    input_len: int
    output_len: int
    concurrency: tuple[int, ...]
    prefix_caching: bool
    shared_prefix_len: int
    endpoint: str
    spec: bool
    """Whether the preset speculates (the spec switches need it)."""


WORKLOADS = {
    # W1 seed-8k1k: chat, 8000 / 1000 tokens, spec decoding on, prefix caching off.
    "W1": Workload(8000, 1000, (1, 4, 16), prefix_caching=False, shared_prefix_len=0,
                   endpoint="chat", spec=True),
    # W3-like prefix-checkpoint: 8000-token token-id prompts sharing their first 7680 tokens
    # (cached by the warm-up requests), prefix caching on, concurrency 1.
    "W3": Workload(8000, 64, (1,), prefix_caching=True, shared_prefix_len=7680,
                   endpoint="completions", spec=False),
}
BASE_SERVER_ARGS = ("--max-num-seqs 32 --max-num-batched-tokens 8192 --max-model-len 12288 "
                    "--gpu-memory-utilization 0.90")
"""W1's reference server flags less those the driver sets itself (load format, prefix caching,
device, spec config)."""


@dataclasses.dataclass(frozen=True)
class Run:
    name: str
    switches: dict[str, bool]
    """Switch name -> on."""


def run_matrix(names: list[str] | None = None) -> list[Run]:
    """all-on, all-off, then no-<switch> for each switch in SWITCHES order; `names` picks (and
    orders as the matrix does) a subset, unknown names raise."""
    runs = [Run("all-on", {s: True for s in SWITCH_NAMES}),
            Run("all-off", {s: False for s in SWITCH_NAMES})]
    runs += [Run(f"no-{s}", {t: t != s for t in SWITCH_NAMES}) for s in SWITCH_NAMES]
    if names is None:
        return runs
    known = {r.name for r in runs}
    bad = [n for n in names if n not in known]
    if bad or not names:
        raise ValueError(f"--runs takes {', '.join(sorted(known))}, auto or all; got {names}")
    return [r for r in runs if r.name in names]


def exercised(switch: Switch, spec: dict | None, prefix_caching: bool,
              shared_prefix_len: int) -> bool:
    """Whether the workload reaches the code the switch changes."""
    if switch.needs == "decode":
        return True
    if switch.needs == "overlap":     # under spec decoding only drafters proposing on the
        return spec is None or (        # device overlap steps (SpecDecoder.device_drafts)
            spec.get("method") in ("dspark", "mtp", "draft_model")
            and spec.get("draft_catchup", "window") == "window"
            and spec.get("disable_by_batch_size") is None)
    if switch.needs == "plain-decode":  # verify rows take the other path; a draft model
        return spec is None or spec.get("method") != "draft_model"  # drafts every step
    if switch.needs == "spec":
        return spec is not None
    if switch.needs == "draft":
        return spec is not None and spec.get("method") == "draft_model"
    return prefix_caching and shared_prefix_len > 0


def run_server_args(run: Run, base: list[str], spec: dict | None,
                    optimization: dict | None = None
                    ) -> tuple[list[str], dict | None, dict]:
    """The server flags of `run` (base + every server-flag switch's flag + the two JSON
    options), its speculative config (`spec` + every spec-key switch's value; None without a
    speculative config) and its optimization config (`optimization` + every optimization-key
    switch's value)."""
    flags = list(base)
    run_spec = dict(spec) if spec is not None else None
    run_opt = dict(optimization or {})
    for s in SWITCHES:
        on = run.switches[s.name]
        if s.config == "optimization":
            run_opt[s.key] = s.value(on)
        elif s.config == "spec":
            if run_spec is not None:
                run_spec[s.key] = s.value(on)
        else:
            flags += s.flag_on if on else s.flag_off
    flags += ["--optimization-config", json.dumps(run_opt)]
    if run_spec is not None:
        flags += ["--speculative-config", json.dumps(run_spec)]
    return flags, run_spec, run_opt


# ---------------------------------------------------------------------------------------------
# Arguments


def _int_list(text: str) -> tuple[int, ...]:
    try:
        vals = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a comma list of integers, got {text!r}")
    if not vals or min(vals) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return vals


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", help="Model folder (e.g. `kdaserve make-model --preset "
                                 "kimi-linear-48b-a3b`).")
    p.add_argument("--workload", choices=sorted(WORKLOADS), default="W1",
                   help="Preset for the lengths, levels, prefix caching and spec decoding "
                        "below. Default: %(default)s.")
    p.add_argument("--runs", default="auto",
                   help="auto (all-on, all-off, no-X for each switch the workload exercises), "
                        "all, or a comma list of all-on, all-off, "
                        + ", ".join(f"no-{s}" for s in SWITCH_NAMES) + ".")
    p.add_argument("--load-format", default="dummy", choices=["auto", "safetensors", "dummy"],
                   help="Default: %(default)s.")
    p.add_argument("--device", default=None, choices=["auto", "cuda", "cpu"],
                   help="Server --device. Default: the engine's (auto).")
    p.add_argument("--base-server-args", default=BASE_SERVER_ARGS,
                   help="Server flags of every run. Default: %(default)r.")
    p.add_argument("--server-args", default="", help="Extra server flags for every run.")
    p.add_argument("--prefix-caching", action=argparse.BooleanOptionalAction, default=None,
                   help="Default: the workload's.")
    p.add_argument("--spec-method", default=None, choices=["draft_model", "ngram", "none"],
                   help="Default: the workload's (W1: draft_model with --draft-model, else "
                        "ngram; W3: none).")
    p.add_argument("--draft-model", default=None,
                   help="Draft model folder (spec \"model\"); one without config.json is "
                        "made first (make_draft_model: `small` preset, the target's "
                        "vocabulary).")
    p.add_argument("--spec-config", default=None,
                   help="Speculative config JSON (without the switch keys). Default: "
                        f"{json.dumps({k: v for k, v in SPEC_CONFIG.items() if k != 'method'})} "
                        "with --spec-method.")
    p.add_argument("--optimization-config", type=optimization_config, default={},
                   help="The server's --optimization-config keys of every run, less the switch "
                        "keys (e.g. '{\"kda_checkpoint_interval\": 1024}'). Default: none.")
    p.add_argument("--input-len", type=int, default=None, help="Default: the workload's.")
    p.add_argument("--output-len", type=int, default=None, help="Default: the workload's.")
    p.add_argument("--concurrency", type=_int_list, default=None,
                   help="Comma list. Default: the workload's.")
    p.add_argument("--shared-prefix-len", type=int, default=None,
                   help="Default: the workload's.")
    p.add_argument("--endpoint", choices=["chat", "completions"], default=None,
                   help="completions sends token-id prompts. Default: the workload's.")
    p.add_argument("--requests-per-concurrency", type=int, default=2,
                   help="Measured requests per level = this x concurrency, before the time "
                        "budget shrinks it. Default: %(default)s.")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--level-duration", type=float, default=150.0,
                   help="Cap on each level's measured phase (s). Default: %(default)s.")
    p.add_argument("--time-budget", type=float, default=3600.0,
                   help="This invocation, server starts included (s). Default: %(default)s.")
    p.add_argument("--startup-timeout", type=float, default=420.0)
    p.add_argument("--out-dir", default=None,
                   help="Default: benchmarks/results/ablation/<UTC time stamp>/.")
    p.add_argument("--port", type=int, default=None)
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=None,
                   help="The server's --tensor-parallel-size (default: the server's, 1).")
    p.add_argument("--decode-context-parallel-size", "-dcp", type=int, default=None,
                   help="The server's --decode-context-parallel-size (default: the server's, "
                        "1).")
    args = p.parse_args(argv)
    try:
        resolve_args(args)
    except ValueError as e:
        p.error(str(e))
    return args


def resolve_args(args: argparse.Namespace) -> None:
    """Fill the workload's defaults, build the spec config, pick the runs; ValueError on
    contradictions."""
    w = WORKLOADS[args.workload]
    for name in ("input_len", "output_len", "concurrency", "shared_prefix_len", "endpoint"):
        if getattr(args, name) is None:
            setattr(args, name, getattr(w, name))
    if args.prefix_caching is None:
        args.prefix_caching = w.prefix_caching
    if min(args.input_len, args.output_len, args.requests_per_concurrency) < 1:
        raise ValueError(f"--input-len, --output-len and --requests-per-concurrency must be "
                         f">= 1, got {args.input_len}, {args.output_len}, "
                         f"{args.requests_per_concurrency}")
    if not 0 <= args.shared_prefix_len < args.input_len:
        raise ValueError(f"--shared-prefix-len must be in [0, {args.input_len}), got "
                         f"{args.shared_prefix_len}")
    for flag in shlex.split(args.base_server_args) + shlex.split(args.server_args):
        if flag.split("=", 1)[0] in RESERVED_SERVER_FLAGS:
            raise ValueError(f"server flag {flag!r} is set by the driver (switches, "
                             f"--load-format, --device, --[no-]prefix-caching, --spec-*, "
                             f"--optimization-config)")
    clash = [s.key for s in SWITCHES if s.config == "optimization"
             and s.key in args.optimization_config]
    if clash:
        raise ValueError(f"--optimization-config may not set the switch keys {clash}: the "
                         f"driver does")
    args.spec = build_spec(args, w)
    names = None
    if args.runs == "auto":
        on = [s.name for s in SWITCHES
              if exercised(s, args.spec, args.prefix_caching, args.shared_prefix_len)]
        names = ["all-on", "all-off", *(f"no-{s}" for s in on)]
    elif args.runs != "all":
        names = [r.strip() for r in args.runs.split(",") if r.strip()]
    args.run_list = run_matrix(names)
    args.out_dir = args.out_dir or os.path.join(
        RESULTS_DIR, datetime.datetime.now(datetime.UTC).strftime("%Y%m%dT%H%M%S"))


def build_spec(args: argparse.Namespace, w: Workload) -> dict | None:
    method = args.spec_method
    if method is None:
        method = ("draft_model" if args.draft_model else "ngram") if w.spec else "none"
    if method == "none":
        if args.spec_config or args.draft_model:
            raise ValueError("--spec-config / --draft-model given with --spec-method none")
        return None
    spec = dict(SPEC_CONFIG)
    if args.spec_config:
        try:
            spec = json.loads(args.spec_config)
        except json.JSONDecodeError as e:
            raise ValueError(f"--spec-config is not valid JSON: {args.spec_config!r} ({e})")
        if not isinstance(spec, dict):
            raise ValueError(f"--spec-config must be a JSON object, got {args.spec_config!r}")
    spec["method"] = method
    if args.draft_model:
        spec["model"] = args.draft_model
    if method == "draft_model" and not spec.get("model"):
        raise ValueError("--spec-method draft_model needs --draft-model (a folder with the "
                         "target's vocabulary, e.g. `kdaserve make-model DIR --preset small`)")
    clash = [s.key for s in SWITCHES if s.config == "spec" and s.key in spec]
    if clash:
        raise ValueError(f"--spec-config may not set the switch keys {clash}: the driver does")
    return spec


# ---------------------------------------------------------------------------------------------
# One run


def base_flags(args: argparse.Namespace) -> list[str]:
    flags = shlex.split(args.base_server_args) + shlex.split(args.server_args)
    flags += ["--load-format", args.load_format]
    flags.append("--enable-prefix-caching" if args.prefix_caching else
                 "--no-enable-prefix-caching")
    if args.device:
        flags += ["--device", args.device]
    return flags


def plan_requests(planned: int, concurrency: int, duration: float,
                  est_request_s: float | None) -> int:
    """Measured requests for a level: `planned`, shrunk to what `duration` holds at
    `est_request_s` per request (whole rounds of `concurrency`, at least one)."""
    if not est_request_s:
        return planned
    rounds = max(1, int(duration / est_request_s))
    return max(1, min(planned, rounds * concurrency))


def command_line(args: argparse.Namespace) -> str:
    """The ablation invocation itself (also when main() is called with an argv list)."""
    return shlex.join([sys.executable, os.path.abspath(__file__), *args.argv])


def run_levels(args: argparse.Namespace, server: ServerProcess, record: dict, deadline: float,
               estimates: dict[int, float], log: Callable[[str], None]) -> None:
    """Every concurrency level against the started server, inside `deadline`; appends to
    record["levels"] and fills `estimates` (concurrency -> mean E2E latency, s)."""
    levels = list(args.concurrency)
    for i, conc in enumerate(levels):
        share = (deadline - time.monotonic()) / (len(levels) - i)
        est = estimates.get(conc) or (estimates.get(levels[i - 1]) if i else None) or 0.0
        warm_rounds = -(-args.warmup // max(min(conc, args.warmup), 1)) if args.warmup else 0
        duration = min(args.level_duration, share - (warm_rounds + 1) * est)
        if duration < 1.0:
            record["levels"].append({"concurrency": conc, "skipped": "time budget"})
            log(f"concurrency {conc}: skipped (time budget)")
            continue
        n = plan_requests(args.requests_per_concurrency * conc, conc, duration,
                          estimates.get(conc))
        ns = bench_args(args, server, conc, duration, min(deadline - time.monotonic(),
                                                          1.5 * share), record["run"])
        ns.num_requests, ns.shared_prefix_len = n, args.shared_prefix_len
        ns.command_line = command_line(args)
        try:
            result = asyncio.run(run_benchmark(ns, log=log))
        except Exception as e:  # noqa: BLE001 - recorded; the other runs still go
            record["status"] = "failed"
            record["error"] = f"concurrency {conc}: {type(e).__name__}: {e}"
            record["server_log_tail"] = server.log_tail()
            log(record["error"])
            return
        level = result.pop("levels")[0]
        level["duration_cap_s"] = duration
        record["levels"].append(level)
        record.setdefault("bench", result)
        if level["metrics"]["completed"]:
            estimates[conc] = level["metrics"]["mean_e2el_ms"] / 1000.0


def run_one(args: argparse.Namespace, run: Run, deadline: float,
            estimates: dict[int, float], log: Callable[[str], None]) -> dict:
    """Start the server for `run`, run its levels, stop it; the run's record."""
    flags, spec, optimization = run_server_args(run, base_flags(args), args.spec,
                                                args.optimization_config)
    server = ServerProcess(args.model, flags, os.path.join(args.out_dir, f"{run.name}_server.log"),
                           port=args.port, tensor_parallel_size=args.tensor_parallel_size,
                           decode_context_parallel_size=args.decode_context_parallel_size)
    by_name = {s.name: s for s in SWITCHES}
    record = {
        "format_version": RESULT_FORMAT_VERSION, "run": run.name, "status": "ok",
        "workload": args.workload, "command": command_line(args), "commit": git_commit(),
        "gpu": gpu_name(), "model": args.model,
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "switches": {n: {**by_name[n].setting(on, spec is not None),
                         "exercised": exercised(by_name[n], args.spec, args.prefix_caching,
                                                args.shared_prefix_len)}
                     for n, on in run.switches.items()},
        "server_flags": flags, "server_command": server.command_line,
        "speculative_config": spec, "optimization_config": optimization,
        "server_log": server.log_path,
        "config": {"input_len": args.input_len, "output_len": args.output_len,
                   "concurrency": list(args.concurrency), "endpoint": args.endpoint,
                   "shared_prefix_len": args.shared_prefix_len,
                   "prefix_caching": args.prefix_caching, "load_format": args.load_format,
                   "warmup": args.warmup, "seed": args.seed,
                   "requests_per_concurrency": args.requests_per_concurrency},
        "levels": [],
    }
    log(f"starting: {server.command_line}")
    with server:
        if not start_recorded(server, min(args.startup_timeout,
                                          deadline - time.monotonic() - 30.0), record, log):
            return record
        run_levels(args, server, record, deadline, estimates, log)
    record["server_returncode"] = server.proc.returncode if server.proc else None
    return record


# ---------------------------------------------------------------------------------------------
# Summary


def _fmt(v, fmt: str) -> str:
    return "-" if v is None else fmt.format(v)


def summary_rows(records: list[dict]) -> list[dict]:
    """One row per (run, level), with the change of output tok/s against all-on's level."""
    base = next((r for r in records if r["run"] == "all-on"), None)
    base_tok = {lv["concurrency"]: lv["metrics"]["output_throughput"]
                for lv in (base or {}).get("levels", []) if "metrics" in lv}
    rows = []
    for r in records:
        if not r["levels"]:
            rows.append({"run": r["run"], "concurrency": None, "status": r["status"]})
        for lv in r["levels"]:
            row = {"run": r["run"], "concurrency": lv["concurrency"], "status": r["status"]}
            if "metrics" not in lv:
                row["status"] = lv.get("skipped", r["status"])
                rows.append(row)
                continue
            m, c = lv["metrics"], lv.get("server_counters") or {}
            row.update(output_tok_s=m["output_throughput"], mean_ttft_ms=m["mean_ttft_ms"],
                       mean_tpot_ms=m["mean_tpot_ms"], completed=m["completed"],
                       failed=m["failed"],
                       spec_draft_tokens=c.get("spec_decode_num_draft_tokens"),
                       spec_acceptance_rate=c.get("spec_decode_acceptance_rate"),
                       spec_acceptance_length=c.get("spec_decode_acceptance_length"),
                       prefix_cache_hit_rate=c.get("prefix_cache_hit_rate"),
                       kda_state_bytes_per_verify=c.get("spec_decode_kda_state_bytes_per_verify"),
                       kv_cache_tokens=r.get("server_capacity", {}).get("kv_cache_tokens"))
            ref = base_tok.get(lv["concurrency"])
            if ref and r["run"] != "all-on":
                row["vs_all_on"] = m["output_throughput"] / ref - 1.0
            rows.append(row)
    return rows


def format_markdown(rows: list[dict]) -> str:
    head = ["run", "conc", "output tok/s", "vs all-on", "mean TTFT", "mean TPOT", "note"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in rows:
        note = [f"{row['completed']} req"] if "completed" in row else [row["status"]]
        if row.get("failed"):
            note.append(f"{row['failed']} failed")
        if row.get("spec_draft_tokens") == 0:
            note.append("spec: no drafts")
        if row.get("spec_acceptance_rate") is not None:
            note.append(f"acceptance rate {row['spec_acceptance_rate']:.2f}")
        if row.get("spec_acceptance_length") is not None:
            note.append(f"acceptance length {row['spec_acceptance_length']:.2f}")
        if row.get("prefix_cache_hit_rate") is not None:
            note.append(f"prefix hit rate {row['prefix_cache_hit_rate']:.2f}")
        if row.get("kda_state_bytes_per_verify") is not None:
            note.append(f"KDA state {row['kda_state_bytes_per_verify'] / 2**20:.1f} MiB/verify")
        if row.get("kv_cache_tokens") is not None:
            note.append(f"KV {row['kv_cache_tokens']} tokens")
        vs = row.get("vs_all_on")
        cells = [row["run"], _fmt(row["concurrency"], "{}"),
                 _fmt(row.get("output_tok_s"), "{:.1f}"),
                 "-" if vs is None else f"{100 * vs:+.1f}%",
                 _fmt(row.get("mean_ttft_ms"), "{:.1f} ms"),
                 _fmt(row.get("mean_tpot_ms"), "{:.2f} ms"), "; ".join(note)]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def load_records(out_dir: str) -> list[dict]:
    """Every run JSON in `out_dir`, in matrix order (runs of earlier slices included)."""
    order = {r.name: i for i, r in enumerate(run_matrix())}
    records = []
    for path in glob.glob(os.path.join(out_dir, "*.json")):
        if os.path.basename(path) == "summary.json":
            continue
        with open(path) as f:
            rec = json.load(f)
        if rec.get("run") in order:
            records.append(rec)
    return sorted(records, key=lambda r: order[r["run"]])


def write_summary(args: argparse.Namespace, wall_s: float) -> tuple[str, str]:
    records = load_records(args.out_dir)
    rows = summary_rows(records)
    table = format_markdown(rows)
    configs = {json.dumps(r.get("config"), sort_keys=True) for r in records}
    summary = {
        "format_version": RESULT_FORMAT_VERSION, "workload": args.workload,
        "model": args.model, "gpu": gpu_name(), "commit": git_commit(),
        "command": command_line(args), "wall_s": wall_s,
        "switches": [dataclasses.asdict(s) for s in SWITCHES],
        "runs": {r["run"]: {"status": r["status"], "file": f"{r['run']}.json",
                            "switches": {n: s["on"] for n, s in r["switches"].items()}}
                 for r in records},
        "mixed_configs": len(configs) > 1,
        "rows": rows, "table_markdown": table,
    }
    path = os.path.join(args.out_dir, "summary.json")
    with open(path, "w") as f:
        json.dump(summary, f, indent=1)
    return path, table


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    os.makedirs(args.out_dir, exist_ok=True)
    t_begin = time.monotonic()
    if args.draft_model and not os.path.isfile(os.path.join(args.draft_model, "config.json")):
        print(f"making the draft model {args.draft_model} for {args.model}", file=sys.stderr)
        make_draft_model(args.model, args.draft_model)
    deadline = t_begin + args.time_budget - SAFETY_S

    def logger(run: str) -> Callable[[str], None]:
        return lambda msg: print(f"[{time.monotonic() - t_begin:6.1f}s] [{run}] {msg}",
                                 file=sys.stderr, flush=True)

    skipped = [s.name for s in SWITCHES
               if not exercised(s, args.spec, args.prefix_caching, args.shared_prefix_len)]
    if skipped:
        logger("ablation")(f"not exercised by this workload (their on/off runs are alike): "
                           f"{', '.join(skipped)}")
    estimates: dict[int, float] = {}
    statuses = []
    for i, run in enumerate(args.run_list):
        run_deadline = time.monotonic() + (deadline - time.monotonic()) / (len(args.run_list) - i)
        record = run_one(args, run, run_deadline, estimates, logger(run.name))
        record["wall_s"] = time.monotonic() - t_begin
        path = os.path.join(args.out_dir, f"{run.name}.json")
        with open(path, "w") as f:
            json.dump(record, f, indent=1)
        statuses.append(record["status"])
        logger(run.name)(f"wrote {path}")

    path, table = write_summary(args, time.monotonic() - t_begin)
    print(f"ablation {args.workload} ({args.input_len}/{args.output_len} tokens) on "
          f"{gpu_name()}, {time.monotonic() - t_begin:.0f} s\n")
    print(table)
    print(f"\nresults: {path}")
    return 0 if all(s == "ok" for s in statuses) else 1


if __name__ == "__main__":
    sys.exit(main())
