"""Where a prefill forward's wall time goes: kernels, idle gaps, and the host syncs behind them.

    python benchmarks/prefill_gaps.py MODEL_DIR --tokens 8000 --out gaps.json

One sequence of `tokens` prompt tokens through the model (eager, as prefill chunks run),
timed with CUDA events; then one profiled run (CPU + CUDA activity): the union of kernel
intervals (GPU busy), the idle gaps between kernels (largest first, with the host op that ran
when the gap began), the host calls that wait for the device (synchronize, device-to-host copies,
`.item()` / `.tolist()`) with their Python stack, and the kernels ranked by time.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from kdaserve.attention.builder import build_metadata  # noqa: E402
from kdaserve.attention.forward_context import ForwardContext  # noqa: E402
from kdaserve.bench.report import git_commit  # noqa: E402
from kdaserve.config import (CacheConfig, EngineConfig, KernelConfig, LoadConfig,  # noqa: E402
                             ModelConfig, SchedulerConfig)
from kdaserve.entrypoints.openai.cli_args import optimization_config  # noqa: E402
from kdaserve.worker.worker import Worker  # noqa: E402

SYNC_NAMES = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaMemcpy", "cudaMemcpyAsync",
              "cudaEventSynchronize", "aten::item", "aten::_local_scalar_dense")


def intervals(prof):
    """(kernel intervals [(start_us, end_us, name)], cpu events) from a profile."""
    kernels, cpu = [], []
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            kernels.append((e.time_range.start, e.time_range.end, e.name))
        else:
            cpu.append(e)
    kernels.sort()
    return kernels, cpu


def busy_and_gaps(kernels) -> tuple[float, list[tuple[float, float, str]]]:
    """Sorted kernel intervals [(start_us, end_us, name)] -> (busy us: their union's length,
    idle gaps [(gap_us, gap start, next kernel)])."""
    busy, gaps, cur_end = 0.0, [], None
    for s, e, name in kernels:
        if cur_end is None or s > cur_end:
            if cur_end is not None:
                gaps.append((s - cur_end, cur_end, name))
            busy += e - s
            cur_end = e
        elif e > cur_end:
            busy += e - cur_end
            cur_end = e
    return busy, gaps


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--tokens", type=int, default=8000)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--optimization-config", type=optimization_config, default={})
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    T = args.tokens
    blocks = -(-T // 16) + 1
    config = EngineConfig(
        model_config=ModelConfig(model=args.model, max_model_len=T + 16),
        cache_config=CacheConfig(num_gpu_blocks=blocks, num_state_slots=1,
                                 enable_prefix_caching=False),
        scheduler_config=SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=max(8192, T),
                                         max_model_len=T + 16),
        load_config=LoadConfig(load_format="dummy"), enforce_eager=True,
        kernel_config=KernelConfig(**args.optimization_config))
    worker = Worker(config)
    worker.initialize_cache(blocks, 1)
    runner = worker.model_runner
    vocab = config.model_config.arch.vocab_size
    md = build_metadata([T], [0], [list(range(-(-T // 16)))], [0], 16, runner.device)
    ids = torch.randint(0, vocab, (T,), device=runner.device)

    def forward() -> None:
        with torch.inference_mode():
            runner.model(ids, ForwardContext(md, runner.caches))

    forward()                                       # compiles / autotunes this shape
    torch.cuda.synchronize()
    times = []
    for _ in range(args.reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        forward()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts, with_stack=True) as prof:
        forward()
        torch.cuda.synchronize()
    kernels, cpu = intervals(prof)
    busy, gaps = busy_and_gaps(kernels)
    span = kernels[-1][1] - kernels[0][0]
    gaps.sort(reverse=True)
    top_gaps = []
    for g, t, next_kernel in gaps[:15]:
        # the host op that was running when the GPU went idle: the innermost CPU event covering t
        around = [e for e in cpu if e.time_range.start <= t <= e.time_range.end]
        inner = min(around, key=lambda e: e.time_range.end - e.time_range.start, default=None)
        top_gaps.append({"gap_us": g, "next_kernel": next_kernel[:80],
                         "host_op": inner.name if inner else None,
                         "stack": list(inner.stack[:6]) if inner and inner.stack else []})
    syncs: dict = {}
    for e in cpu:
        if e.name in SYNC_NAMES:
            key = (e.name, tuple(s for s in (e.stack or [])[:4]))
            d = syncs.setdefault(key, {"name": e.name, "stack": list(key[1]), "calls": 0,
                                       "host_us": 0.0})
            d["calls"] += 1
            d["host_us"] += e.time_range.end - e.time_range.start
    per_kernel: dict = {}
    for s, e, name in kernels:
        d = per_kernel.setdefault(name[:90], [0, 0.0])
        d[0] += 1
        d[1] += e - s
    top = sorted(per_kernel.items(), key=lambda kv: -kv[1][1])[:30]
    result = {
        "command": " ".join(sys.argv), "gpu": torch.cuda.get_device_name(), "commit": git_commit(),
        "tokens": T, "forward_ms": sorted(times)[len(times) // 2], "forward_ms_all": times,
        "profiled_span_ms": span / 1e3, "gpu_busy_ms": busy / 1e3,
        "idle_ms": (span - busy) / 1e3, "kernels": len(kernels),
        "gaps_over_50us": sum(1 for g in gaps if g[0] > 50),
        "idle_in_gaps_over_50us_ms": sum(g[0] for g in gaps if g[0] > 50) / 1e3,
        "top_gaps": top_gaps,
        "syncs": sorted(syncs.values(), key=lambda d: -d["host_us"])[:20],
        "top_kernels": [{"name": k, "calls": v[0], "ms": v[1] / 1e3} for k, v in top],
        "optimization_config": args.optimization_config,
    }
    print(f"prefill {T} tokens: forward {result['forward_ms']:.1f} ms (events), profiled span "
          f"{result['profiled_span_ms']:.1f} ms, GPU busy {result['gpu_busy_ms']:.1f} ms, idle "
          f"{result['idle_ms']:.1f} ms in {len(gaps)} gaps ({result['gaps_over_50us']} > 50 us: "
          f"{result['idle_in_gaps_over_50us_ms']:.1f} ms), {len(kernels)} kernels", flush=True)
    for g in top_gaps[:8]:
        print(f"  gap {g['gap_us']:8.0f} us before {g['next_kernel'][:50]}  host: {g['host_op']} "
              f"{g['stack'][:2]}")
    for s in result["syncs"][:8]:
        print(f"  sync {s['name']} x{s['calls']} {s['host_us']:.0f} us  {s['stack'][:3]}")
    for k in result["top_kernels"][:15]:
        print(f"  {k['ms']:8.2f} ms {k['calls']:5d}  {k['name']}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
