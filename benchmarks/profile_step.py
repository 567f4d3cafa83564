"""Where a step's GPU time goes: torch.profiler over eager decode steps and one prefill.

    python benchmarks/profile_step.py MODEL_DIR --batch 1 --context 8000 --out prof.json

Prints the kernels ranked by total CUDA time (eager mode, so each kernel is visible) and the
kernel count per step, which is what CUDA graphs replay.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from kdaserve.attention.builder import build_metadata  # noqa: E402
from kdaserve.attention.forward_context import ForwardContext  # noqa: E402
from kdaserve.bench.report import git_commit  # noqa: E402
from kdaserve.bench.roofline import run_point  # noqa: E402
from kdaserve.config import (CacheConfig, EngineConfig, KernelConfig, LoadConfig,  # noqa: E402
                             ModelConfig, SchedulerConfig)
from kdaserve.entrypoints.openai.cli_args import optimization_config  # noqa: E402
from kdaserve.worker.cuda_graphs import DecodeGraphs  # noqa: E402
from kdaserve.worker.worker import Worker  # noqa: E402


def top_kernels(prof, n: int) -> list[dict]:
    rows = []
    for evt in prof.key_averages():
        t = getattr(evt, "device_time_total", None) or getattr(evt, "cuda_time_total", 0)
        if t and evt.device_type == torch.autograd.DeviceType.CUDA:
            rows.append({"name": evt.key[:90], "calls": evt.count, "cuda_us": t})
    rows.sort(key=lambda r: -r["cuda_us"])
    return rows[:n]


def graph_replay_ms(runner, batch: int, reps: int = 50) -> float:
    """GPU time of the captured decode graph (the model forward, without the lm_head, the
    sampler and the host work of a step): back-to-back replays timed with CUDA events, on the
    inputs of the last step run."""
    return replay_ms(runner.graphs.graph(DecodeGraphs.descriptor(
        runner.graphs.padded_size(batch))), reps)


def replay_ms(graph: torch.cuda.CUDAGraph, reps: int = 50) -> float:
    """GPU ms of one replay of `graph`: back-to-back replays timed with CUDA events."""
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--context", type=int, default=8000)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--prefill", type=int, default=8000)
    ap.add_argument("--graphs", action="store_true",
                    help="decode with CUDA graphs (kernels as replayed; the gap is step time "
                         "minus kernel time)")
    ap.add_argument("--optimization-config", type=optimization_config, default={},
                    help="as `kdaserve serve`'s, its KernelConfig keys only, e.g. "
                         "'{\"pdl\": false}' (default: the engine's KernelConfig)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    kernel_keys = {f.name for f in dataclasses.fields(KernelConfig)}
    other = sorted(set(args.optimization_config) - kernel_keys)
    if other:
        ap.error(f"--optimization-config: {other} are not KernelConfig keys (this script "
                 f"builds its own cache and scheduler config, without prefix caching)")
    max_len = max(args.context, args.prefill) + args.steps + 16
    blocks = max(args.batch, 1) * -(-max_len // 16) + 1
    config = EngineConfig(
        model_config=ModelConfig(model=args.model, max_model_len=max_len),
        cache_config=CacheConfig(num_gpu_blocks=blocks, num_state_slots=max(args.batch, 1),
                                 enable_prefix_caching=False),
        scheduler_config=SchedulerConfig(max_num_seqs=max(args.batch, 1),
                                         max_num_batched_tokens=max(8192, args.prefill),
                                         max_model_len=max_len),
        load_config=LoadConfig(load_format="dummy"), enforce_eager=not args.graphs,
        kernel_config=KernelConfig(**args.optimization_config))
    worker = Worker(config)
    worker.initialize_cache(blocks, max(args.batch, 1))
    runner = worker.model_runner
    vocab = config.model_config.arch.vocab_size
    run_point(runner, args.batch, args.context, 3, vocab, 0)        # warm-up
    result = {"command": " ".join(sys.argv), "gpu": torch.cuda.get_device_name(),
              "commit": git_commit()}
    times = run_point(runner, args.batch, args.context, args.steps, vocab, 1)
    result["decode_step_ms_median"] = sorted(times)[len(times) // 2] * 1e3
    if runner.graphs is not None:
        result["decode_graph_ms"] = graph_replay_ms(runner, args.batch)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        run_point(runner, args.batch, args.context, args.steps, vocab, 1)
    result["decode_top"] = top_kernels(prof, 40)
    every = top_kernels(prof, 10**6)
    launches = sum(r["calls"] for r in every)
    result["decode_kernels_per_step"] = launches / (args.steps + 1)
    result["decode_kernel_us_per_step"] = sum(r["cuda_us"] for r in every) / (args.steps + 1)
    result["graphs"] = args.graphs
    print(f"decode step {result['decode_step_ms_median']:.3f} ms (unprofiled), kernels "
          f"{result['decode_kernel_us_per_step'] / 1e3:.3f} ms per step, model graph alone "
          f"{result.get('decode_graph_ms', float('nan')):.3f} ms", flush=True)
    if args.prefill:
        md = build_metadata([args.prefill], [0], [list(range(-(-args.prefill // 16)))], [0],
                            16, runner.device)
        ids = torch.randint(0, vocab, (args.prefill,), device=runner.device)

        def prefill() -> None:
            with torch.inference_mode():
                runner.model(ids, ForwardContext(md, runner.caches))
            torch.cuda.synchronize()

        prefill()   # first use autotunes fla's kernels for this shape: keep that out
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            prefill()
        result["prefill_top"] = top_kernels(prof, 40)
    for key in ("decode_top", "prefill_top"):
        if key not in result:
            continue
        total = sum(r["cuda_us"] for r in top_kernels(prof, 10**6)) if key == "prefill_top" \
            else None
        print(f"== {key} ==" + (f" (total {total / 1e3:.1f} ms)" if total else ""))
        for r in result[key][:25]:
            print(f"{r['cuda_us'] / 1e3:9.3f} ms  {r['calls']:6d}  {r['name']}")
    print("decode kernels per step:", result["decode_kernels_per_step"])
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
