"""Greedy tokens of tensor / decode-context parallel layouts against the first layout.

    python benchmarks/parallel_equality.py MODEL --load-format dummy --layouts 1,2,2x2 \\
        --prompt-len 2000 --num-prompts 4 --max-tokens 64 --out tp_equality.json

A layout is `TP` or `TPxDCP` (`2x2`: tensor_parallel_size 2, decode_context_parallel_size 2).
Each layout builds a `kdaserve.LLM`, generates greedily (logprobs=5) on the same seeded token-id
prompts, records the tokens, the top logprobs, the KV capacity the engine reports (its stats:
with DCP a block holds dcp x block_size tokens) and its start-up time, and shuts the engine
down before the next layout starts. By default every layout runs in a child process of its own
(this script with --only-layout): the previous layout's device memory (weights, caches, graph
pools) is gone when the next one sizes its caches, and a crash or a hung collective ends one
layout (killed after --layout-timeout, or when --time-budget runs out; an interrupt, e.g.
`timeout -s INT`, ends the current layout and skips the rest) and not the run: the JSON is
written in every case. --in-process runs them all here.

Every layout is compared with the reference (the first layout that ran): per prompt, exact
equality and the first divergence; at a divergence, whether each side's token is among the
other side's top-k logprobs there (vLLM's check_logprobs_close: the ranks' partial sums add in
another order, so in bf16 long greedy runs on a random model may part on near-ties; a
divergence outside the top-k is a real mismatch). Verdict per layout and overall: exact, close
(every divergence within the top-k), mismatch, or error (a layout did not finish: recorded, the
next layout still runs, exit status 1).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import shlex
import signal
import subprocess
import sys
import tempfile
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from kdaserve.bench.report import git_commit, gpu_name


def parse_layout(text: str) -> tuple[int, int]:
    """`2` -> (2, 1); `2x2` -> (2, 2)."""
    parts = text.lower().split("x")
    try:
        tp, dcp = (int(parts[0]), 1) if len(parts) == 1 else (int(parts[0]), int(parts[1]))
    except (ValueError, IndexError):
        raise argparse.ArgumentTypeError(f"a layout is TP or TPxDCP, got {text!r}") from None
    if len(parts) > 2 or tp < 1 or dcp < 1:
        raise argparse.ArgumentTypeError(f"a layout is TP or TPxDCP, got {text!r}")
    return tp, dcp


def layout_name(tp: int, dcp: int) -> str:
    return str(tp) if dcp == 1 else f"{tp}x{dcp}"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", help="HF-style model folder")
    p.add_argument("--layouts", default="1,2,2x2",
                   help="comma list of TP or TPxDCP; the first is the reference")
    p.add_argument("--prompt-len", default="2000",
                   help="tokens per prompt, or a comma list (prompt i: item i mod length)")
    p.add_argument("--num-prompts", type=int, default=None,
                   help="default: the --prompt-len list's length (4 for a single length)")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--logprobs", type=int, default=5, help="top-k of the divergence check")
    p.add_argument("--seed", type=int, default=0, help="seed of the prompts' token ids")
    p.add_argument("--load-format", default=None, help="e.g. dummy (default: the engine's)")
    p.add_argument("--device", default=None, help="cpu | cuda (default: the engine's)")
    p.add_argument("--dtype", default=None, help="default: the engine's (bf16 on CUDA)")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="default: the longest prompt + --max-tokens + 16")
    p.add_argument("--max-num-seqs", type=int, default=None, help="default: --num-prompts")
    p.add_argument("--max-num-batched-tokens", type=int, default=None)
    p.add_argument("--block-size", type=int, default=None)
    p.add_argument("--num-gpu-blocks", type=int, default=None)
    p.add_argument("--gpu-memory-utilization", type=float, default=None)
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument("--engine-args", type=json.loads, default={},
                   help="JSON object of further LLM keyword arguments, e.g. "
                        "'{\"dummy_routing\": \"spread\"}'")
    p.add_argument("--in-process", action="store_true",
                   help="run every layout in this process (default: a child process each)")
    p.add_argument("--layout-timeout", type=float, default=600.0,
                   help="child mode: seconds before a layout's process group is killed")
    p.add_argument("--time-budget", type=float, default=None,
                   help="child mode: seconds for all layouts; each one's timeout is cut to "
                        "what is left, and layouts with nothing left are skipped")
    p.add_argument("--out", default=None)
    p.add_argument("--only-layout", default=None, help=argparse.SUPPRESS)
    p.add_argument("--child-out", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.layout_list = [parse_layout(x.strip()) for x in args.layouts.split(",") if x.strip()]
    if not args.layout_list:
        p.error("--layouts is empty")
    args.prompt_lens = [int(x) for x in args.prompt_len.split(",") if x.strip()]
    if args.num_prompts is None:
        args.num_prompts = len(args.prompt_lens) if len(args.prompt_lens) > 1 else 4
    return args


def make_prompts(model: str, lens: list[int], num: int, seed: int) -> list[list[int]]:
    """Seeded token-id prompts, ids away from both ends of the vocabulary (where the special
    and added tokens sit)."""
    with open(os.path.join(model, "config.json")) as f:
        cfg = json.load(f)
    vocab = int(cfg.get("vocab_size") or cfg.get("text_config", {})["vocab_size"])
    margin = min(1000, vocab // 8)
    rng = random.Random(seed)
    return [[rng.randrange(margin, vocab - margin) for _ in range(lens[i % len(lens)])]
            for i in range(num)]


def engine_kwargs(args: argparse.Namespace) -> dict:
    """The LLM keyword arguments every layout shares."""
    kw = {"max_model_len": args.max_model_len or max(args.prompt_lens) + args.max_tokens + 16,
          "max_num_seqs": args.max_num_seqs or args.num_prompts,
          "max_logprobs": max(20, args.logprobs)}
    for key in ("load_format", "device", "dtype", "max_num_batched_tokens", "block_size",
                "num_gpu_blocks", "gpu_memory_utilization"):
        if getattr(args, key) is not None:
            kw[key] = getattr(args, key)
    if args.enforce_eager:
        kw["enforce_eager"] = True
    return {**kw, **args.engine_args}


def run_layout(args: argparse.Namespace, tp: int, dcp: int,
               prompts: list[list[int]]) -> dict:
    """One layout in this process: its tokens, top logprobs, capacity, times; the engine and
    its rank processes are shut down before it returns. Errors are recorded, not raised."""
    rec: dict = {"layout": layout_name(tp, dcp), "tp": tp, "dcp": dcp, "status": "ok"}
    llm = None
    t0 = time.perf_counter()
    try:
        from kdaserve import LLM, SamplingParams

        llm = LLM(args.model, **engine_kwargs(args), tensor_parallel_size=tp,
                  decode_context_parallel_size=dcp)
        rec["engine_start_s"] = time.perf_counter() - t0
        config = llm.llm_engine.engine_config
        rec["device"] = config.device
        rec["dtype"] = str(config.model_config.torch_dtype(config.device))
        params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True,
                                logprobs=args.logprobs)
        t1 = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        rec["generate_s"] = time.perf_counter() - t1
        rec["tokens"] = [list(o.outputs[0].token_ids) for o in outs]
        rec["top_logprobs"] = [[sorted(([int(t), lp.logprob] for t, lp in pos.items()),
                                       key=lambda x: -x[1])
                                for pos in (o.outputs[0].logprobs or [])] for o in outs]
        stats = llm.llm_engine.get_stats()
        rec["capacity"] = {
            "num_total_kv_tokens": stats.num_total_kv_tokens,
            "num_total_blocks": stats.num_total_blocks,
            "block_size_per_rank": config.cache_config.block_size,
            "tokens_per_block": stats.num_total_kv_tokens // max(stats.num_total_blocks, 1),
            "num_total_state_slots": stats.num_total_state_slots,
            "num_total_kda_checkpoint_slots": stats.num_total_kda_checkpoint_slots}
    except Exception as e:  # noqa: BLE001 - recorded; the next layout still runs
        rec["status"] = "error"
        rec["error"] = f"{type(e).__name__}: {e}"
        rec["traceback"] = traceback.format_exc()[-4000:]
    finally:
        if llm is not None:
            try:
                llm.llm_engine.engine_core.shutdown()
            except Exception as e:  # noqa: BLE001
                rec.setdefault("shutdown_error", f"{type(e).__name__}: {e}")
        del llm
        gc.collect()
        _empty_cuda_cache()
    rec["wall_s"] = time.perf_counter() - t0
    return rec


def _empty_cuda_cache() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def run_child(argv: list[str], tp: int, dcp: int, timeout: float) -> dict:
    """The layout in a child process (this script, --only-layout) in its own process group,
    killed with its rank processes after `timeout` seconds."""
    name = layout_name(tp, dcp)
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "layout.json")
        cmd = [sys.executable, os.path.abspath(__file__), *argv, "--only-layout", name,
               "--child-out", out]
        t0 = time.perf_counter()
        proc = subprocess.Popen(cmd, start_new_session=True)
        try:
            code = proc.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            code = None
        except BaseException:   # interrupted (timeout -s INT): no layout outlives this process
            os.killpg(proc.pid, signal.SIGKILL)
            raise
        if os.path.isfile(out):
            with open(out) as f:
                return json.load(f)
    return {"layout": name, "tp": tp, "dcp": dcp,
            "status": "timeout" if code is None else "error", "wall_s": time.perf_counter() - t0,
            "error": (f"killed after {timeout:.0f} s (--layout-timeout, --time-budget)"
                      if code is None
                      else f"the layout's process exited with status {code} (log above)")}


def compare(ref: dict, got: dict, k: int) -> dict:
    """Per prompt: equal, first divergence, the top-k check there, and the largest difference
    of the chosen tokens' logprobs over the common prefix."""
    prompts = []
    for i, (a, b) in enumerate(zip(ref["tokens"], got["tokens"], strict=True)):
        la, lb = ref["top_logprobs"][i], got["top_logprobs"][i]
        n = min(len(a), len(b))
        div = next((j for j in range(n) if a[j] != b[j]), None if len(a) == len(b) else n)
        row = {"prompt": i, "equal": div is None, "first_divergence": div,
               "num_tokens": [len(a), len(b)]}
        diffs = []
        for j in range(n if div is None else div):
            da, db = dict(la[j]), dict(lb[j])
            if a[j] in da and a[j] in db:
                diffs.append(abs(da[a[j]] - db[a[j]]))
        row["max_abs_logprob_diff"] = max(diffs, default=None)
        if div is not None and div < n:
            top_a = [t for t, _ in la[div][:k]] if div < len(la) else []
            top_b = [t for t, _ in lb[div][:k]] if div < len(lb) else []
            row.update(ref_token=a[div], got_token=b[div], ref_top=la[div][:k],
                       got_top=lb[div][:k], ref_token_in_got_top=a[div] in top_b,
                       got_token_in_ref_top=b[div] in top_a)
            row["within_top_k"] = row["ref_token_in_got_top"] and row["got_token_in_ref_top"]
        elif div is not None:
            row["within_top_k"] = False   # one side stopped early
        prompts.append(row)
    exact = all(r["equal"] for r in prompts)
    close = all(r["equal"] or r["within_top_k"] for r in prompts)
    return {"layout": got["layout"], "reference": ref["layout"],
            "verdict": "exact" if exact else "close" if close else "mismatch",
            "prompts_equal": sum(r["equal"] for r in prompts), "prompts": prompts}


def summary_line(rec: dict, cmp: dict | None) -> str:
    if rec["status"] != "ok":
        return f"layout {rec['layout']}: {rec['status']}: {rec.get('error')}"
    cap = rec["capacity"]
    line = (f"layout {rec['layout']}: start {rec['engine_start_s']:.1f} s, generate "
            f"{rec['generate_s']:.1f} s, KV {cap['num_total_kv_tokens']} tokens "
            f"({cap['num_total_blocks']} blocks of {cap['tokens_per_block']})")
    if cmp is not None:
        divs = [r["first_divergence"] for r in cmp["prompts"] if not r["equal"]]
        line += (f"; vs {cmp['reference']}: {cmp['verdict']} ({cmp['prompts_equal']}/"
                 f"{len(cmp['prompts'])} prompts equal" + (f", first divergences {divs}"
                                                            if divs else "") + ")")
    return line


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    prompts = make_prompts(args.model, args.prompt_lens, args.num_prompts, args.seed)
    if args.only_layout is not None:   # child mode: one layout, its record to --child-out
        rec = run_layout(args, *parse_layout(args.only_layout), prompts)
        with open(args.child_out, "w") as f:
            json.dump(rec, f)
        return 0 if rec["status"] == "ok" else 1
    records, comparisons, ref = [], [], None
    deadline = time.monotonic() + args.time_budget if args.time_budget else None
    for tp, dcp in args.layout_list:
        timeout = args.layout_timeout
        if deadline is not None:
            timeout = min(timeout, deadline - time.monotonic())
        if timeout < 1.0:
            rec = {"layout": layout_name(tp, dcp), "tp": tp, "dcp": dcp,
                   "status": "skipped", "error": "time budget"}
        elif args.in_process:
            rec = run_layout(args, tp, dcp, prompts)
        else:
            try:
                rec = run_child(argv, tp, dcp, timeout)
            except KeyboardInterrupt:   # the caller's timeout: keep what the others gave
                rec = {"layout": layout_name(tp, dcp), "tp": tp, "dcp": dcp,
                       "status": "interrupted", "error": "interrupted (SIGINT)"}
                deadline = time.monotonic()   # the layouts left are skipped
        cmp = None
        if rec["status"] == "ok":
            if ref is None:
                ref = rec
            else:
                cmp = compare(ref, rec, args.logprobs)
                comparisons.append(cmp)
        records.append(rec)
        print(summary_line(rec, cmp), flush=True)
    verdicts = [c["verdict"] for c in comparisons]
    errors = [r["layout"] for r in records if r["status"] != "ok"]
    verdict = ("error" if errors else "mismatch" if "mismatch" in verdicts
               else "close" if "close" in verdicts else "exact")
    caps = {r["layout"]: r["capacity"]["num_total_kv_tokens"] for r in records
            if r["status"] == "ok"}
    result = {
        "command": shlex.join([sys.executable, os.path.abspath(__file__), *argv]),
        "commit": git_commit(), "gpu": gpu_name(), "model": args.model,
        "device": next((r.get("device") for r in records if r.get("device")), args.device),
        "layouts": [layout_name(*x) for x in args.layout_list],
        "reference_layout": ref["layout"] if ref else None,
        "prompt_lens": [len(p) for p in prompts], "max_tokens": args.max_tokens,
        "logprobs": args.logprobs, "seed": args.seed,
        "engine_kwargs": engine_kwargs(args), "isolation":
            "in-process" if args.in_process else "a child process per layout",
        "verdict": verdict, "errors": errors, "kv_tokens": caps,
        "comparisons": comparisons, "results": records}
    print(f"verdict: {verdict}" + (f" (layouts that did not finish: {errors})" if errors
                                   else ""), flush=True)
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
