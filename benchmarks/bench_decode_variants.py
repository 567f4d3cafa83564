"""Decode kernel variants: the CUDA-graph time of a decode step per batch size.

    python benchmarks/bench_decode_variants.py MODEL_DIR --variants base,gemv,gemv+pdl --out v.json

Kernel backends are fixed when a model is built, so each variant is a worker of its own (model
load, caches, graphs), one after the other. Per batch (8K context by default) it reports the model
graph alone (CUDA events around back-to-back replays: no lm_head, sampler or host work) and
`runner.execute_model` per step (synchronous: graph + lm_head + sampler + host). Variant names
join KernelConfig flags with '+': gemv = decode_gemv, pdl, fkda = fused_kda_decode; base = none.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.profile_step import graph_replay_ms  # noqa: E402
from kdaserve.bench.report import git_commit  # noqa: E402
from kdaserve.bench.roofline import run_point  # noqa: E402
from kdaserve.config import (CacheConfig, EngineConfig, KernelConfig, LoadConfig,  # noqa: E402
                             ModelConfig, SchedulerConfig)
from kdaserve.worker.worker import Worker  # noqa: E402

FLAGS = {"gemv": "decode_gemv", "pdl": "pdl", "fkda": "fused_kda_decode"}


def kernel_config(variant: str) -> KernelConfig:
    names = [] if variant == "base" else variant.split("+")
    bad = [n for n in names if n not in FLAGS]
    if bad:
        raise ValueError(f"unknown variant flags {bad} in {variant!r}; known: {sorted(FLAGS)}")
    off = {flag: False for flag in FLAGS.values()}        # the defaults turn some on
    return KernelConfig(**{**off, **{FLAGS[n]: True for n in names}})


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--variants", default="base,gemv,gemv+pdl")
    ap.add_argument("--batches", default="1,4,16")
    ap.add_argument("--context", type=int, default=8000)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    variants = args.variants.split(",")
    configs = {v: kernel_config(v) for v in variants}        # bad names fail before loading
    max_len = args.context + args.steps + 16
    max_b = max(batches)
    blocks = max_b * -(-max_len // 16) + 1
    result = {"command": " ".join(sys.argv), "gpu": torch.cuda.get_device_name(),
              "commit": git_commit(), "context": args.context, "rows": []}
    for variant in variants:
        config = EngineConfig(
            model_config=ModelConfig(model=args.model, max_model_len=max_len),
            cache_config=CacheConfig(num_gpu_blocks=blocks, num_state_slots=max_b,
                                     enable_prefix_caching=False),
            scheduler_config=SchedulerConfig(max_num_seqs=max_b, max_num_batched_tokens=8192,
                                             max_model_len=max_len),
            load_config=LoadConfig(load_format="dummy"), kernel_config=configs[variant])
        worker = Worker(config)
        worker.initialize_cache(blocks, max_b)
        runner, vocab = worker.model_runner, config.model_config.arch.vocab_size
        for b in batches:
            run_point(runner, b, args.context, 2, vocab, 0)              # warm-up, JIT
            steps = run_point(runner, b, args.context, args.steps, vocab, 1)
            row = {"variant": variant, "batch": b,
                   "graph_ms": graph_replay_ms(runner, b),
                   "execute_model_ms": statistics.median(steps) * 1e3}
            result["rows"].append(row)
            print(f"{variant:>14s} b{b:<3d} graph {row['graph_ms']:.3f} ms, execute_model "
                  f"{row['execute_model_ms']:.3f} ms", flush=True)
        del worker, runner
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
