"""In-process engine benchmark on one GPU, or on several with -tp / -dcp (issues 2, 3, 25).

    python benchmarks/bench_engine.py MODEL_DIR --load-format dummy --out results.json
    python benchmarks/bench_engine.py MODEL_DIR -tp 2 -dcp 2 --batches 1,16 --skip-throughput

MODEL_DIR is an HF-style folder (e.g. `kdaserve make-model /tmp/k48 --preset
kimi-linear-48b-a3b`: config + tokenizer only). Measures: load time; the KV capacity (the
engine's stats: with DCP a block holds dcp x block_size tokens); one 8000-token prefill and
32 decode steps (time of each); decode step time at batch 1/4/16 with 8K context, CUDA graphs on
and off, next to the byte floor; offline throughput of 16 x (8000 in, 1000 out).

Under tensor parallelism the engine holds rank 0's worker in this process and the other ranks
follow its launch / collect commands; what this script does to rank 0 alone must not change the
work the ranks do. So with TP > 1: no eager runs (switching rank 0's CUDA graphs off would leave
the other ranks replaying theirs: collectives of other shapes); experts touched are counted on
rank 0's model without a collective (roofline.experts_touched); the byte floor is one rank's:
rank 0's weight shard, its KDA heads (1/tp) and its share of each context's latent KV (1/dcp),
as the engine's own floor gauge counts it. Toggling async scheduling is the engine core's
business (the ranks follow rank 0's calls), so the graphs_sync rows still run.
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
from kdaserve.entrypoints.openai.cli_args import (model_loader_extra_config,  # noqa: E402
                                                  optimization_config)
from kdaserve.bench.roofline import byte_floor, experts_touched, measure_copy_bandwidth  # noqa: E402,E501
from kdaserve.attention.caches import state_bytes_per_slot  # noqa: E402



W4_COPY_BYTES_PER_S = 4.23e12
"""The copy bandwidth workloads.md's W4 byte floor divides by (measured on the H200 model)."""


def run_until_done(engine: LLMEngine) -> list[float]:
    """Wall time between consecutive step() returns. No device sync in between: with async
    scheduling a step returns while the next one runs on the device, and in steady state the
    interval is the time per step that bounds throughput (with synchronous scheduling each
    step() waits for its own sampled ids, so the interval is the step's own time)."""
    torch.cuda.synchronize()
    times, t = [], time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
        now = time.perf_counter()
        times.append(now - t)
        t = now
    return times


def prompt(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(1000, vocab - 1000) for _ in range(n)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--load-format", default="dummy")
    ap.add_argument("--model-loader-extra-config", type=model_loader_extra_config, default={},
                    help="as `kdaserve serve`'s, e.g. '{\"dummy_routing\": \"spread\"}'")
    ap.add_argument("--prompt-len", type=int, default=8000)
    ap.add_argument("--batches", default="1,4,16")
    ap.add_argument("--throughput-requests", type=int, default=16)
    ap.add_argument("--throughput-output", type=int, default=1000)
    ap.add_argument("--skip-throughput", action="store_true")
    ap.add_argument("--optimization-config", type=optimization_config, default={},
                    help="as `kdaserve serve`'s, e.g. '{\"pdl\": false}' (default: the "
                         "engine's)")
    ap.add_argument("--no-async-scheduling", action="store_true",
                    help="one step at a time (the decode rows then have no graphs_sync twin)")
    ap.add_argument("--tensor-parallel-size", "-tp", type=int, default=1)
    ap.add_argument("--decode-context-parallel-size", "-dcp", type=int, default=1)
    ap.add_argument("--max-num-seqs", type=int, default=None,
                    help="default: max(32, largest batch); KDA slots take memory from the KV")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    rng = random.Random(0)
    tp, dcp = args.tensor_parallel_size, args.decode_context_parallel_size
    result = {"command": " ".join(sys.argv), "commit": git_commit(),
              "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
              "tensor_parallel_size": tp, "decode_context_parallel_size": dcp,
              "gpus_visible": torch.cuda.device_count()}
    skipped = []    # parts left out under TP > 1 (module docstring)
    bw = measure_copy_bandwidth(torch.device("cuda"))
    result["copy_bandwidth_TBps"] = bw / 1e12
    batches = [int(x) for x in args.batches.split(",")]
    t0 = time.perf_counter()
    # every batch of --batches must fit in max_num_seqs, or its "decode steps" are steps of
    # max_num_seqs rows (the rest of the requests wait)
    engine = LLMEngine.from_engine_args(
        model=args.model, load_format=args.load_format, **args.model_loader_extra_config,
        max_model_len=12288, max_num_seqs=args.max_num_seqs or max(32, *batches),
        max_num_batched_tokens=8192, gpu_memory_utilization=0.9, **args.optimization_config,
        async_scheduling=not args.no_async_scheduling, tensor_parallel_size=tp,
        decode_context_parallel_size=dcp)
    result["engine_start_s"] = time.perf_counter() - t0
    rn = engine.model_runner            # rank 0's runner under TP
    stats = engine.get_stats()
    result["kv_cache_tokens"] = stats.num_total_kv_tokens   # logical: per-rank blocks x dcp x bs
    result["kv_blocks_per_rank"] = rn.num_blocks
    result["block_size_per_rank"] = rn.block_size
    result["kda_state_slots"] = rn.num_slots
    result["max_num_seqs"] = engine.engine_config.scheduler_config.max_num_seqs
    vocab = engine.vocab_size
    print(json.dumps(result, indent=1), flush=True)

    # 1. One 8000-token prefill and 32 decode steps; the same greedy run in eager mode must
    #    give the same tokens as with CUDA graphs. A first request of the same length runs
    #    untimed: kernels autotuned per shape on first use (fla) would otherwise be in the figure
    #    (1011 ms vs 161 ms steady on the H200).
    sp = SamplingParams(temperature=0.0, max_tokens=33, ignore_eos=True)
    engine.add_request("warmup", prompt(rng, args.prompt_len, vocab),
                       SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))
    t0 = time.perf_counter()
    run_until_done(engine)
    result["first_prefill_incl_autotune_ms"] = (time.perf_counter() - t0) * 1e3
    p0 = prompt(rng, args.prompt_len, vocab)
    engine.add_request("p0", p0, sp)
    times = []
    sched = engine.engine_config.scheduler_config
    use_async, sched.async_scheduling = sched.async_scheduling, False   # one step = one pass
    while engine.has_unfinished_requests():
        torch.cuda.synchronize()
        t = time.perf_counter()
        outs = engine.step()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
        graph_tokens = outs[0].outputs[0].token_ids if outs else None
    sched.async_scheduling = use_async
    if tp == 1:
        saved, rn.graphs = rn.graphs, None
        engine.add_request("p0-eager", p0, sp)
        while engine.has_unfinished_requests():
            outs = engine.step()
            eager_tokens = outs[0].outputs[0].token_ids if outs else None
        rn.graphs = saved
        result["graphs_equal_eager_greedy_tokens"] = graph_tokens == eager_tokens
        print("graphs vs eager greedy tokens equal:", graph_tokens == eager_tokens, flush=True)
    else:
        result["graphs_equal_eager_greedy_tokens"] = None
        skipped.append("eager runs (graphs vs eager tokens, step_ms_eager*): rank 0 alone "
                       "cannot switch its graphs off")
    result["prefill_8000_ms"] = times[0] * 1e3
    result["decode_32_steps_ms"] = [t * 1e3 for t in times[1:]]
    print(f"prefill {args.prompt_len}: {times[0] * 1e3:.1f} ms; decode steps median "
          f"{statistics.median(times[1:]) * 1e3:.2f} ms", flush=True)

    # 2. Decode step time at batch B with ~8K context, graphs on and off.
    result["decode"] = []
    for b in batches:
        ps = [prompt(rng, args.prompt_len, vocab) for _ in range(b)]
        with torch.inference_mode():
            touched = experts_touched(rn.model, torch.tensor([p[-1] for p in ps], device="cuda"))
        arch = engine.engine_config.model_config.arch
        # one rank's bytes: rank 0's shard, its KDA heads, its 1/dcp of each context's latents
        floor = byte_floor(rn.model, arch, b, -(-args.prompt_len // dcp), touched, bw,
                           state_bytes_per_slot(arch, rn.dtype, tp))
        row = {"batch": b, "context": args.prompt_len, **floor}
        sched = engine.engine_config.scheduler_config
        use_async = sched.async_scheduling
        runs = [("graphs", True, use_async)] + ([("eager", False, use_async)] if tp == 1 else [])
        if use_async:   # the same without async scheduling
            runs += [("graphs_sync", True, False)] + (
                [("eager_sync", False, False)] if tp == 1 else [])
        for key, graphs, async_on in runs:
            saved = rn.graphs
            if not graphs:
                rn.graphs = None
            sched.async_scheduling = async_on
            for i, p in enumerate(ps):
                engine.add_request(f"d{b}-{key}-{i}", p, SamplingParams(
                    temperature=0.0, max_tokens=48, ignore_eos=True))
            times = run_until_done(engine)
            rn.graphs = saved
            decode = times[-40:]          # every request is past its prefill here
            row[f"step_ms_{key}"] = statistics.median(decode) * 1e3
            row[f"ratio_{key}"] = row[f"step_ms_{key}"] / floor["floor_ms"]
        sched.async_scheduling = use_async
        row["async_scheduling"] = use_async
        row["floor_ms_w4"] = floor["total_bytes"] / W4_COPY_BYTES_PER_S * 1e3
        row["ratio_graphs_w4"] = row["step_ms_graphs"] / row["floor_ms_w4"]
        print(f"batch {b}: graphs {row['step_ms_graphs']:.2f} ms, eager "
              f"{row.get('step_ms_eager', float('nan')):.2f} ms, graphs without async scheduling "
              f"{row.get('step_ms_graphs_sync', float('nan')):.2f} ms, floor "
              f"{floor['floor_ms']:.2f} ms at the measured copy bandwidth (ratio "
              f"{row['ratio_graphs']:.2f}), W4 floor {row['floor_ms_w4']:.2f} ms (ratio "
              f"{row['ratio_graphs_w4']:.2f}), experts/layer {touched}", flush=True)
        result["decode"].append(row)

    # 3. Offline throughput: N x (8000 in, 1000 out).
    if not args.skip_throughput:
        n, out_len = args.throughput_requests, args.throughput_output
        for i in range(n):
            engine.add_request(f"t{i}", prompt(rng, args.prompt_len, vocab), SamplingParams(
                temperature=1.0, top_p=0.95, seed=i, max_tokens=out_len, ignore_eos=True))
        t0 = time.perf_counter()
        times = run_until_done(engine)
        wall = time.perf_counter() - t0
        result["throughput"] = {"requests": n, "prompt_len": args.prompt_len,
                                "output_len": out_len, "wall_s": wall,
                                "output_tok_per_s": n * out_len / wall,
                                "total_tok_per_s": n * (out_len + args.prompt_len) / wall,
                                "steps": len(times)}
        print(f"offline throughput: {n} x ({args.prompt_len} in, {out_len} out) in "
              f"{wall:.1f} s = {n * out_len / wall:.0f} output tok/s", flush=True)
    result["floor_scope"] = ("per rank: rank 0's weight shard, KDA state of 1/tp of the heads, "
                             "1/dcp of each context's latent KV" if tp > 1 else "the model")
    result["skipped_under_tp"] = skipped
    result["experts_touched_method"] = (
        "rank 0's model alone: ids folded into its vocabulary rows, no collective" if tp > 1
        else "embedding + first MoE layer's router")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
