# SPDX-License-Identifier: Apache-2.0
"""`kdaserve bench serve`: a closed-loop load generator for any OpenAI-compatible server.

For each concurrency level: `--warmup` unmeasured requests, then `concurrency` workers send
requests back to back until `--num-requests` are done or `--duration` has passed (no request
starts after the deadline; those in flight finish unless `--level-timeout` cancels them).
Prompts are synthetic, of exact token lengths (random vocabulary tokens, re-tokenized until the
count is exact), distinct per request (seeded). Requests stream with stream_options
{include_usage, continuous_usage_stats}; token counts come from the server's usage.

Metrics (vLLM `bench serve` definitions; start = just before the POST):
  TTFT  first SSE event with non-empty choices (chat: the role chunk, sent with token 1)
  E2EL  last choices-bearing event (usage chunk and [DONE] excluded)
  TPOT  (E2EL - TTFT) / (output_tokens - 1), per request; mean/median/pXX over requests
  ITL   gaps between consecutive choices events, pooled over requests (per event, not token)
  throughput  completed requests, output tokens, input+output tokens per second of the level
guidellm-named equivalents (under "guidellm" in the JSON; note the name clash):
  time_to_first_token_ms (first text-bearing event), inter_token_latency_ms (= vLLM TPOT,
  token-weighted), time_per_output_token_ms (includes TTFT: last event / output_tokens),
  request_latency (s, stream closed), output_tokens_per_second, tokens_per_second,
  output_tokens_per_iteration (> 1 when events carry several tokens, e.g. spec decoding)

Output JSON: command, date, commit, gpu, server {base_url, server_flags, /v1/models},
config, probe_request (chat template measurement), levels [{concurrency, metrics (vLLM
names, ms), guidellm, server_counters (deltas of /metrics counters over the level: spec-decode
acceptance, prefix-cache hits, preemptions; null without /metrics), requests (per-request
records: start, ttft, latency, tpot, prompt_tokens, output_tokens, error, ...; with
--save-detailed also the per-event times, token counts and itl),
warmup_requests}].
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import platform
import shlex
import sys
import time

import httpx

from kdaserve.bench import client as bench_client
from kdaserve.bench import server_metrics
from kdaserve.bench.datasets import PromptFactory, load_prompt_tokenizer
from kdaserve.bench.metrics import (
    RequestRecord,
    guidellm_metrics,
    vllm_metrics,
)
from kdaserve.bench.report import format_table, git_commit, gpu_name

RESULT_FORMAT_VERSION = 1


def _int_list(text: str) -> list[int]:
    try:
        vals = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a comma list of integers, got {text!r}")
    if not vals or any(v < 1 for v in vals):
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return vals


def _json_obj(text: str) -> dict:
    try:
        val = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not valid JSON: {text!r} ({e})")
    if not isinstance(val, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r}")
    return val


def _goodput(items: list[str]) -> dict[str, float]:
    slos = {}
    for item in items:
        key, _, val = item.partition(":")
        if key not in ("ttft", "tpot", "e2el") or not val:
            raise ValueError(f"--goodput items are ttft:MS, tpot:MS or e2el:MS, got {item!r}")
        slos[key] = float(val)
    return slos


def add_cli_args(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    g = p.add_argument_group("server")
    g.add_argument("--base-url", default="http://127.0.0.1:8000",
                   help="Server root URL (a trailing /v1 is accepted). Default: %(default)s.")
    g.add_argument("--model", default=None,
                   help="Model name to send. Default: data[0].id of GET /v1/models.")
    g.add_argument("--tokenizer", default=None,
                   help="Tokenizer folder/file or hub id for building prompts. Default: "
                        "data[0].root of /v1/models (vLLM: the model path; kdaserve shows "
                        "no path, so pass its model folder), else the model id.")
    g.add_argument("--trust-remote-code", action="store_true",
                   help="Allow a tokenizer's own code (transformers), e.g. tiktoken-based ones.")
    g.add_argument("--endpoint", choices=["chat", "completions"], default="chat",
                   help="chat = /v1/chat/completions, completions = /v1/completions. "
                        "Default: %(default)s.")
    g.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"),
                   help="Bearer token. Default: $OPENAI_API_KEY.")
    g.add_argument("--server-flags", default="",
                   help="The server's command line, recorded verbatim in the result JSON.")
    g.add_argument("--timeout", type=float, default=600.0,
                   help="Per-request timeout in seconds. Default: %(default)s.")

    g = p.add_argument_group("workload")
    g.add_argument("--input-len", type=int, default=1024,
                   help="Prompt length in tokens (exact). Default: %(default)s.")
    g.add_argument("--output-len", type=int, default=128,
                   help="max_tokens per request (exact with --ignore-eos). Default: %(default)s.")
    g.add_argument("--prompt-len-mode", choices=["total", "content"], default="total",
                   help="chat only. total: the server-side prompt (chat template included) is "
                        "--input-len tokens, the template's tokens being measured with one probe "
                        "request; content: the message content is --input-len tokens. "
                        "Default: %(default)s.")
    g.add_argument("--shared-prefix-len", type=int, default=0,
                   help="First N prompt tokens shared by all requests (prefix-cache workloads). "
                        "Default: 0 (prompts share nothing).")
    g.add_argument("--token-ids", action="store_true",
                   help="Send raw token-id prompts on /v1/completions instead of text.")
    g.add_argument("--concurrency", type=_int_list, default=[1, 4, 16],
                   help="Comma list of concurrency levels, one run each. Default: 1,4,16.")
    g.add_argument("--num-requests", type=int, default=None,
                   help="Measured requests per level. Default: 2 x concurrency.")
    g.add_argument("--duration", type=float, default=None,
                   help="Per-level cap in seconds: no request starts after it (in-flight "
                        "requests finish). Whichever of --num-requests / --duration ends first.")
    g.add_argument("--level-timeout", type=float, default=None,
                   help="Hard cap on each level's wall time in seconds, warm-up included: "
                        "requests still running then are cancelled and count as failed.")
    g.add_argument("--warmup", type=int, default=2,
                   help="Unmeasured warm-up requests per level. Default: %(default)s.")
    g.add_argument("--seed", type=int, default=0, help="Prompt seed. Default: %(default)s.")

    g = p.add_argument_group("sampling")
    g.add_argument("--temperature", type=float, default=None,
                   help="Sent when given; else the server's default.")
    g.add_argument("--top-p", type=float, default=None, help="Sent when given.")
    g.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True,
                   help="Send ignore_eos so every output is --output-len tokens. Default: on.")
    g.add_argument("--extra-body", type=_json_obj, default={},
                   help="JSON object merged into every request body.")

    g = p.add_argument_group("output")
    g.add_argument("--label", default=None, help="Run label (JSON and plot legend).")
    g.add_argument("--out", default=None, help="Write the result JSON here.")
    g.add_argument("--plot", default=None, help="Write a PNG plot here.")
    g.add_argument("--save-detailed", action="store_true",
                   help="Keep each request's per-event lists (event_times, event_tokens, itl) "
                        "in the JSON; without it a request keeps its scalars (vLLM's flag).")
    g.add_argument("--goodput", nargs="+", default=[], metavar="KEY:MS",
                   help="SLOs for goodput, e.g. ttft:500 tpot:20 e2el:10000.")
    g.add_argument("--metric-percentiles", default="50,90,95,99",
                   help="Percentiles to report. Default: %(default)s.")
    return p


def validate_args(args: argparse.Namespace) -> None:
    if args.token_ids and args.endpoint != "completions":
        raise ValueError("--token-ids needs --endpoint completions")
    if args.input_len < 1 or args.output_len < 1:
        raise ValueError(f"--input-len and --output-len must be >= 1, got {args.input_len}, "
                         f"{args.output_len}")
    if not 0 <= args.shared_prefix_len <= args.input_len:
        raise ValueError(f"--shared-prefix-len must be in [0, {args.input_len}], got "
                         f"{args.shared_prefix_len}")
    if args.num_requests is not None and args.num_requests < 1:
        raise ValueError(f"--num-requests must be >= 1, got {args.num_requests}")
    if args.duration is not None and args.duration <= 0:
        raise ValueError(f"--duration must be > 0, got {args.duration}")
    if args.warmup < 0:
        raise ValueError(f"--warmup must be >= 0, got {args.warmup}")
    if args.level_timeout is not None and args.level_timeout <= 0:
        raise ValueError(f"--level-timeout must be > 0, got {args.level_timeout}")
    if args.timeout <= 0:
        raise ValueError(f"--timeout must be > 0, got {args.timeout}")


def _percentiles(text: str) -> tuple[float, ...]:
    try:
        vals = tuple(float(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise ValueError(f"--metric-percentiles must be numbers, got {text!r}")
    if not vals or any(not 0 < v <= 100 for v in vals):
        raise ValueError(f"--metric-percentiles must be in (0, 100], got {text!r}")
    return vals


async def _run_pool(client, cfg, prompts, concurrency: int, t0: float, tag: str,
                    deadline: float | None = None, hard_deadline: float | None = None
                    ) -> tuple[list[RequestRecord], str]:
    """`concurrency` workers send `prompts` back to back. No request starts after `deadline`;
    requests still running at `hard_deadline` are cancelled and recorded as failed. Returns
    the records (completion order) and what stopped the pool: num_requests | duration |
    level_timeout."""
    records: list[RequestRecord] = []
    todo = iter(enumerate(prompts))
    stopped = "num_requests"

    async def worker() -> None:
        nonlocal stopped
        for i, p in todo:
            now = time.perf_counter()
            if hard_deadline is not None and now >= hard_deadline:
                stopped = "level_timeout"
                return
            if deadline is not None and now >= deadline:
                stopped = "duration" if stopped == "num_requests" else stopped
                return
            send = bench_client.send_request(client, cfg, f"{tag}-{i}", p.prompt,
                                             p.prompt_len, t0)
            try:
                timeout = None if hard_deadline is None else hard_deadline - now
                records.append(await asyncio.wait_for(send, timeout))
            except TimeoutError:
                stopped = "level_timeout"
                records.append(RequestRecord(
                    req_id=f"{tag}-{i}", start=now - t0, prompt_len=p.prompt_len,
                    expected_output_len=cfg.output_len,
                    error="cancelled: --level-timeout reached"))

    await asyncio.gather(*(worker() for _ in range(min(concurrency, len(prompts)))))
    return records, stopped


async def run_level(client, cfg, factory: PromptFactory, concurrency: int, level_idx: int,
                    num_requests: int, warmup: int, duration: float | None,
                    prompt_len: int, template_tokens: int, percentiles, slos,
                    level_timeout: float | None = None, detailed: bool = False) -> dict:
    """One concurrency level. `prompt_len` is what the client generates (chat: the message
    content); the server should count `prompt_len + template_tokens`. `level_timeout` bounds
    the whole level (warm-up included): requests still running then are cancelled."""
    warm_prompts = factory.make(warmup, stream=2 * level_idx + 1, input_len=prompt_len)
    prompts = factory.make(num_requests, stream=2 * level_idx + 2, input_len=prompt_len)
    tw = time.perf_counter()
    hard = tw + level_timeout if level_timeout else None
    warm_records, _ = await _run_pool(client, cfg, warm_prompts, concurrency, tw,
                                      f"c{concurrency}-warmup", hard_deadline=hard)
    counters_before = await server_metrics.scrape(client, cfg.base_url, cfg.api_key)
    t0 = time.perf_counter()
    deadline = t0 + duration if duration else None
    records, stopped = await _run_pool(client, cfg, prompts, concurrency, t0,
                                       f"c{concurrency}", deadline, hard)
    elapsed = time.perf_counter() - t0
    counters_after = await server_metrics.scrape(client, cfg.base_url, cfg.api_key)
    records.sort(key=lambda r: r.start)
    ok = [r for r in records if r.success]
    expected = prompt_len + template_tokens
    exact = [r.prompt_tokens == expected for r in ok if r.prompt_tokens is not None]
    return {
        "concurrency": concurrency,
        "num_requests_planned": num_requests,
        "num_requests_sent": len(records),
        "stopped_by": stopped,
        "warmup_failed": sum(not r.success for r in warm_records),
        "expected_prompt_tokens": expected,
        "prompt_tokens_match_rate": (sum(exact) / len(exact)) if exact else None,
        "metrics": vllm_metrics(records, elapsed, percentiles, slos),
        "guidellm": guidellm_metrics(records, elapsed, percentiles),
        "server_counters": server_metrics.level_counters(counters_before, counters_after),
        "requests": [r.to_dict(detailed) for r in records],
        "warmup_requests": [r.to_dict(detailed) for r in warm_records],
    }


async def _probe_template_tokens(client, cfg, factory: PromptFactory) -> tuple[int, dict]:
    """Send one 1-token chat request; return (server prompt tokens - content tokens, record)."""
    probe = factory.make(1, stream=0)[0]
    rec = await bench_client.send_request(client, cfg, "probe", probe.prompt, probe.prompt_len,
                                          time.perf_counter(), max_tokens=1)
    if not rec.success:
        raise RuntimeError(f"probe request failed: {rec.error}")
    if rec.prompt_tokens is None:
        raise RuntimeError("the server reported no usage.prompt_tokens: use "
                           "--prompt-len-mode content")
    return rec.prompt_tokens - probe.prompt_len, rec.to_dict()


async def run_benchmark(args: argparse.Namespace, log=print) -> dict:
    """Run every level; return the result dict (what --out writes)."""
    validate_args(args)
    percentiles = _percentiles(args.metric_percentiles)
    slos = _goodput(args.goodput)
    max_conc = max(args.concurrency)
    async with bench_client.make_client(args.timeout, max_conc + 2) as client:
        base = args.base_url.rstrip("/").removesuffix("/v1")
        try:
            models = await bench_client.get_models(client, base, args.api_key)
        except httpx.HTTPStatusError as e:
            if args.model is None:
                raise RuntimeError(f"GET {base}/v1/models failed ({e}); pass --model") from e
            models = {"error": str(e)}
        data = models.get("data") or []
        if args.model is None and not data:
            raise RuntimeError(f"{base}/v1/models lists no model; pass --model")
        model = args.model or data[0]["id"]
        tokenizer_name = args.tokenizer or (data[0].get("root") if data else None) or model
        tok = load_prompt_tokenizer(tokenizer_name, args.trust_remote_code)
        factory = PromptFactory(tok, args.input_len, args.seed, args.shared_prefix_len,
                                args.token_ids)
        cfg = bench_client.RequestConfig(
            base_url=base, model=model, endpoint=args.endpoint, output_len=args.output_len,
            temperature=args.temperature, top_p=args.top_p, ignore_eos=args.ignore_eos,
            api_key=args.api_key, extra_body=args.extra_body)

        template_tokens, probe, prompt_len = None, None, args.input_len
        if args.endpoint == "chat":
            template_tokens, probe = await _probe_template_tokens(client, cfg, factory)
            if args.prompt_len_mode == "total":
                prompt_len = args.input_len - template_tokens
                if prompt_len < max(args.shared_prefix_len, 1):
                    raise ValueError(f"the chat template takes {template_tokens} tokens: "
                                     f"--input-len {args.input_len} leaves no room")
        log(f"model={model} tokenizer={tokenizer_name} endpoint={cfg.url} "
            f"prompt={prompt_len} tokens"
            + (f" (+{template_tokens} chat template)" if template_tokens is not None else "")
            + f" output={args.output_len}")

        levels = []
        for idx, conc in enumerate(args.concurrency):
            n = args.num_requests if args.num_requests is not None else max(1, 2 * conc)
            level = await run_level(client, cfg, factory, conc, idx, n, args.warmup,
                                    args.duration, prompt_len, template_tokens or 0,
                                    percentiles, slos, args.level_timeout,
                                    args.save_detailed)
            m = level["metrics"]
            log(f"concurrency {conc}: {m['completed']} ok, {m['failed']} failed, "
                f"{m['output_throughput']:.1f} out tok/s, TTFT {m['mean_ttft_ms']:.1f} ms, "
                f"TPOT {m['mean_tpot_ms']:.2f} ms")
            levels.append(level)

    return {
        "format_version": RESULT_FORMAT_VERSION,
        "label": args.label,
        "command": getattr(args, "command_line", None) or shlex.join(sys.argv),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "commit": git_commit(),
        "gpu": gpu_name(),
        "host": platform.node(),
        "server": {"base_url": base, "server_flags": args.server_flags, "models": models},
        "config": {
            "model": model, "tokenizer": tokenizer_name, "endpoint": args.endpoint,
            "input_len": args.input_len, "prompt_len_mode": args.prompt_len_mode,
            "content_prompt_len": prompt_len, "chat_template_tokens": template_tokens,
            "output_len": args.output_len, "shared_prefix_len": args.shared_prefix_len,
            "token_ids": args.token_ids, "concurrency": args.concurrency,
            "num_requests": args.num_requests, "duration": args.duration,
            "level_timeout": args.level_timeout,
            "warmup": args.warmup, "seed": args.seed, "temperature": args.temperature,
            "top_p": args.top_p, "ignore_eos": args.ignore_eos, "extra_body": args.extra_body,
            "percentiles": list(percentiles), "goodput_slos": slos, "timeout": args.timeout,
        },
        "probe_request": probe,
        "levels": levels,
    }


def write_outputs(result: dict, out: str | None, plot: str | None) -> None:
    if out:
        os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
        with open(out, "w") as f:
            json.dump(result, f, indent=1)
    if plot:
        from kdaserve.bench.plot import plot_results

        os.makedirs(os.path.dirname(os.path.abspath(plot)), exist_ok=True)
        plot_results([result], plot, title=result.get("label"))


def main(args: argparse.Namespace) -> int:
    try:
        result = asyncio.run(run_benchmark(args, log=lambda s: print(s, file=sys.stderr)))
    except (ValueError, RuntimeError, OSError, httpx.HTTPError) as e:
        print(f"kdaserve bench serve: error: {type(e).__name__}: {e}", file=sys.stderr)
        return 2
    print(format_table(result["levels"]))
    write_outputs(result, args.out, args.plot)
    failed = sum(lv["metrics"]["failed"] for lv in result["levels"])
    if failed:
        first = next(r["error"] for lv in result["levels"] for r in lv["requests"]
                     if not r["success"])
        print(f"warning: {failed} request(s) failed; first error: {first}", file=sys.stderr)
    return 0
