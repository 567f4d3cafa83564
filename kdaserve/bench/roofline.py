"""Decode step time vs its byte floor (W4 `decode-roofline`), in-process.

For each (batch, context): batch requests whose first `context` tokens count as already computed
(their latent KV and KDA states hold whatever the pools hold: timing does not depend on the
values) decode `--steps` tokens through the model runner, CUDA graphs on unless --enforce-eager.
The floor of a step = (every non-expert weight + the expert weights the batch's routed tokens
touch + the MLA latent KV of every request + every KDA state read and written) / the copy
bandwidth measured in the same run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

from kdaserve.bench.report import git_commit
from kdaserve.engine.floor import measure_copy_bandwidth, sync, weight_bytes


def add_cli_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", help="HF-style model folder (config.json; weights unless dummy)")
    p.add_argument("--batches", default="1,2,4,8,16,32,64")
    p.add_argument("--contexts", default="1024,8192")
    p.add_argument("--steps", type=int, default=20, help="timed decode steps per point")
    p.add_argument("--load-format", default="dummy", choices=["auto", "safetensors", "dummy"])
    p.add_argument("--dummy-routing", default="vllm", choices=["vllm", "spread"])
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument("--decode-gemv", action="store_true",
                   help="KernelConfig.decode_gemv: Triton GEMV for decode batches <= 4")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--bandwidth", type=float, default=None,
                   help="copy bandwidth in bytes/s (default: measured in this run)")
    p.add_argument("--out", default=None, help="write the table as JSON here")


def byte_floor(model, args, batch: int, context: int, experts_touched: int,
               bandwidth: float, state_bytes_per_slot: int) -> dict:
    dense, per_expert, moe_layers = weight_bytes(model)
    kv_elt = next(p for n, p in model.named_parameters() if "kv_a_proj" in n).element_size() \
        if args.mla_layer_ids else 2
    experts = per_expert * experts_touched * moe_layers
    kv = batch * context * args.kv_cache_dim * kv_elt * len(args.mla_layer_ids)
    state = 2 * batch * state_bytes_per_slot
    total = dense + experts + kv + state
    return {"dense_bytes": dense, "expert_bytes": experts, "kv_bytes": kv, "state_bytes": state,
            "total_bytes": total, "floor_ms": total / bandwidth * 1e3,
            "experts_touched_per_layer": experts_touched}


def experts_touched(model, token_ids) -> int:
    """Distinct experts the batch's tokens pick in the first MoE layer (embedding + norm as
    input: with dummy weights routing barely depends on depth).

    Needs no collective, so it runs on one tensor-parallel rank's model alone (the engine's
    rank 0 under TP): a vocabulary-parallel embedding's forward all-reduces, so with more than
    one rank each id is folded into the rank's own rows (id mod rows: still a vocabulary
    token) and looked up there; the norm and the router are replicated."""
    import torch
    import torch.nn.functional as F

    layer = next((l for l in model.model.layers if hasattr(l.mlp, "gate")), None)
    if layer is None:
        return 0
    embed = model.model.embed_tokens
    tp = getattr(embed, "tp", None)
    if tp is not None and tp.size > 1:
        x = F.embedding(token_ids % embed.weight.shape[0], embed.weight)
    else:
        x = embed(token_ids)
    _, ids = layer.mlp.gate(layer.post_attention_layernorm(x))
    return int(torch.unique(ids).numel())


def run_point(runner, batch: int, context: int, steps: int, vocab: int, seed: int) -> list[float]:
    """Decode `steps` tokens for `batch` requests of `context` computed tokens; step times (s)."""
    import random

    from kdaserve.core.sched_output import CachedRequestData, NewRequestData, SchedulerOutput
    from kdaserve.sampling_params import SamplingParams

    rng = random.Random(seed)
    bs = runner.block_size
    blocks_per_req = -(-(context + steps + 1) // bs)
    if batch * blocks_per_req > runner.num_blocks or batch > runner.num_slots:
        raise ValueError(f"batch {batch} x context {context} needs {batch * blocks_per_req} "
                         f"blocks and {batch} slots; the pools hold {runner.num_blocks} and "
                         f"{runner.num_slots}")
    sp = SamplingParams(temperature=0.0, max_tokens=steps + 1, ignore_eos=True)
    ids = [f"r{batch}-{context}-{i}" for i in range(batch)]
    new = [NewRequestData(req_id=rid, prompt_token_ids=[rng.randrange(vocab)
                                                        for _ in range(context + 1)],
                          output_token_ids=[], sampling_params=sp,
                          block_ids=list(range(i * blocks_per_req, (i + 1) * blocks_per_req)),
                          state_slot=i, num_computed_tokens=context)
           for i, rid in enumerate(ids)]
    so = SchedulerOutput(scheduled_new_reqs=new, num_scheduled_tokens={r: 1 for r in ids},
                         total_num_scheduled_tokens=batch)
    times = []
    for step in range(steps + 1):
        sync(runner.device)
        t = time.perf_counter()
        runner.execute_model(so)
        sync(runner.device)
        times.append(time.perf_counter() - t)
        computed = context + step + 1
        so = SchedulerOutput(
            scheduled_cached_reqs=CachedRequestData(req_ids=list(ids),
                                                    new_block_ids=[[] for _ in ids],
                                                    num_computed_tokens=[computed] * batch),
            num_scheduled_tokens={r: 1 for r in ids}, total_num_scheduled_tokens=batch)
    runner.execute_model(SchedulerOutput(finished_req_ids=set(ids)))
    return times[1:]      # the first step includes one-off work (new-request setup)


def main(cli_args: argparse.Namespace) -> int:
    import torch

    from kdaserve.config import (CacheConfig, EngineConfig, KernelConfig, LoadConfig,
                                 ModelConfig, SchedulerConfig)
    from kdaserve.attention.caches import state_bytes_per_slot
    from kdaserve.worker.worker import Worker

    batches = [int(b) for b in cli_args.batches.split(",")]
    contexts = [int(c) for c in cli_args.contexts.split(",")]
    max_len = max(contexts) + cli_args.steps + 2
    mc = ModelConfig(model=cli_args.model, max_model_len=max_len)
    bs = cli_args.block_size
    blocks = max(batches) * -(-max_len // bs) + 1
    config = EngineConfig(
        model_config=mc,
        cache_config=CacheConfig(block_size=bs, num_gpu_blocks=blocks,
                                 num_state_slots=max(batches), enable_prefix_caching=False),
        scheduler_config=SchedulerConfig(max_num_seqs=max(batches),
                                         max_num_batched_tokens=max(8192, max(batches)),
                                         max_model_len=max_len),
        load_config=LoadConfig(load_format=cli_args.load_format,
                               dummy_routing=cli_args.dummy_routing),
        enforce_eager=cli_args.enforce_eager,
        kernel_config=KernelConfig(decode_gemv=cli_args.decode_gemv))
    worker = Worker(config)
    worker.initialize_cache(blocks, max(batches))
    runner = worker.model_runner
    bw = cli_args.bandwidth or measure_copy_bandwidth(runner.device)
    args = mc.arch
    slot_bytes = state_bytes_per_slot(args, runner.dtype)
    run_point(runner, 1, min(contexts), 3, args.vocab_size, 0)     # warm-up: JIT, allocator
    rows = []
    for context in contexts:
        for batch in batches:
            times = run_point(runner, batch, context, cli_args.steps, args.vocab_size, batch)
            probe = torch.randint(0, args.vocab_size, (batch,), device=runner.device)
            with torch.inference_mode():
                touched = experts_touched(runner.model, probe)
            floor = byte_floor(runner.model, args, batch, context, touched, bw, slot_bytes)
            step_ms = statistics.median(times) * 1e3
            rows.append({"batch": batch, "context": context, "step_ms": step_ms,
                         "ratio": step_ms / floor["floor_ms"], **floor})
            print(f"context {context:>6}  batch {batch:>3}  step {step_ms:8.3f} ms  floor "
                  f"{floor['floor_ms']:7.3f} ms  ratio {step_ms / floor['floor_ms']:5.2f}  "
                  f"experts/layer {touched}", flush=True)
    result = {"command": " ".join(sys.argv), "device": str(runner.device),
              "gpu": torch.cuda.get_device_name() if runner.device.type == "cuda" else "none",
              "bandwidth_Bps": bw, "cuda_graphs": runner.decode_graphs is not None,
              "dummy_routing": cli_args.dummy_routing,
              "kernel_config": {"decode_gemv": cli_args.decode_gemv}, "rows": rows,
              "commit": git_commit() or "unknown"}
    if cli_args.out:
        with open(cli_args.out, "w") as f:
            json.dump(result, f, indent=1)
    return 0
