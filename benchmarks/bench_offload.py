"""The prefix cache's offload tier on a W2-shaped workload: TTFT of a prefix hit served from the
device, from host memory and from disk, against the recompute, in one engine.

    python benchmarks/bench_offload.py MODEL_DIR --prefix 114000 --suffix 6000 \
        --device-tokens 130000 --host-gib 30 [--disk DIR] --out results.json

W2 (shared/bench/workloads.md) is a 114K-token shared prefix plus a 6K unique suffix. In order,
each a single request with one output token (so its latency is its TTFT, in-process):
  cold    - prefix + suffix 1: the whole prompt computed (the recompute);
  device  - prefix + suffix 2: the prefix hit in the device cache;
  host    - after filler prompts that evict the prefix from the device (--device-tokens of KV
            cache, set small so that this takes seconds): the prefix loaded from host memory;
  disk    - with --disk only: after more filler, sized to also push the prefix out of host
            memory: read back from the disk level, then loaded.
Sizing: every evicted block and KDA checkpoint spills, so host memory must hold the prefix's
entries plus what the first filler evicts after it (about --device-tokens of KV and one KDA
state per checkpoint interval); the disk level must hold the second filler's spill (the device
plus 1.2x the host level) or its LRU drops the prefix too.
Each case records its TTFT, the hit tokens the engine counted per level, and the bytes the tier
moved; `host_load_effective_gib_s` is the host bytes loaded over the TTFT the host hit added to the device
hit's (the transfer's share of the latency).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from kdaserve import SamplingParams  # noqa: E402
from kdaserve.bench.report import git_commit, gpu_name  # noqa: E402
from kdaserve.engine.llm_engine import LLMEngine  # noqa: E402

ONE = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)


def run_one(engine: LLMEngine, req_id: str, prompt: list[int]) -> float:
    """Seconds from add_request to the request's end (its first and only token)."""
    t0 = time.perf_counter()
    engine.add_request(req_id, prompt, ONE)
    while engine.has_unfinished_requests():
        engine.step()
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--prefix", type=int, default=114000)
    ap.add_argument("--suffix", type=int, default=6000)
    ap.add_argument("--filler", type=int, default=8000, help="Tokens of one filler prompt.")
    ap.add_argument("--device-tokens", type=int, default=300000,
                    help="KV cache of the device (blocks = this / block size).")
    ap.add_argument("--host-gib", type=float, default=40.0, help="--kv-offload-size.")
    ap.add_argument("--disk", default=None,
                    help="kv_offload_disk_path (emptied first); without it, no disk level and "
                         "no disk case.")
    ap.add_argument("--disk-gib", type=float, default=200.0)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--load-format", default="dummy")
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.disk and os.path.isdir(args.disk) and os.listdir(args.disk):
        import shutil

        shutil.rmtree(args.disk)
    prompt_len = args.prefix + args.suffix
    engine = LLMEngine.from_engine_args(
        model=args.model, load_format=args.load_format, device=args.device,
        max_model_len=prompt_len + 16, block_size=args.block_size,
        num_gpu_blocks=args.device_tokens // args.block_size,
        max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=4,
        kv_offload_size=args.host_gib, kv_offload_disk_path=args.disk,
        kv_offload_disk_size=args.disk_gib)
    vocab = engine.vocab_size
    rng = random.Random(args.seed)

    def toks(n: int) -> list[int]:
        return [rng.randrange(10, vocab - 10) for _ in range(n)]

    prefix = toks(args.prefix)
    scheduler = engine.scheduler
    off = scheduler.offload
    counter = [0]

    def fill(num_tokens: int) -> float:
        t0 = time.perf_counter()
        for _ in range(-(-num_tokens // args.filler)):
            counter[0] += 1
            run_one(engine, f"fill-{counter[0]}", toks(args.filler))
        return time.perf_counter() - t0

    def case(name: str) -> dict:
        before = engine.get_stats()
        ttft = run_one(engine, name, prefix + toks(args.suffix))
        after = engine.get_stats()

        def delta(field: str) -> int:
            return getattr(after, field) - getattr(before, field)

        return {"case": name, "ttft_ms": round(ttft * 1e3, 2),
                "hit_tokens": delta("prefix_cache_hits"),
                "host_hit_tokens": delta("offload_host_hit_tokens"),
                "disk_hit_tokens": delta("offload_disk_hit_tokens"),
                "bytes_loaded": delta("offload_bytes_loaded"),
                "bytes_read": delta("offload_bytes_read")}

    run_one(engine, "warm", toks(min(args.filler, prompt_len)))   # first-use costs
    cases = [case("cold"), case("device")]
    fill_s = fill(args.device_tokens)
    cases.append(case("host"))
    # What a filler token stores once evicted: its KV, and a KDA state per checkpoint interval.
    host_bytes = sum(off.num_host_slots[k] * off.entry_bytes[k] for k in off.num_host_slots)
    per_token = (off.entry_bytes["kv"] / scheduler.block_size
                 + off.entry_bytes["state"] / scheduler.prefix_cache.interval)
    fill2_s = 0.0
    if args.disk:
        fill2_s = fill(args.device_tokens + int(1.2 * host_bytes / per_token))
        cases.append(case("disk"))
    by = {c["case"]: c for c in cases}
    extra_s = (by["host"]["ttft_ms"] - by["device"]["ttft_ms"]) / 1e3
    result = {
        "benchmark": "bench_offload", "command": " ".join(sys.argv), "gpu": gpu_name(),
        "commit": git_commit(), "prefix": args.prefix, "suffix": args.suffix,
        "device_kv_tokens": scheduler.kv_cache_manager.num_gpu_blocks * scheduler.block_size,
        "host_slots": off.num_host_slots, "entry_bytes": off.entry_bytes,
        "fill_seconds": [round(fill_s, 2), round(fill2_s, 2)], "cases": cases,
        "host_load_effective_gib_s": (round(by["host"]["bytes_loaded"] / extra_s / 2**30, 2)
                            if extra_s > 0 else None),
        "stats": {k: v for k, v in vars(engine.get_stats()).items() if "offload" in k}}
    engine.engine_core.shutdown()
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
