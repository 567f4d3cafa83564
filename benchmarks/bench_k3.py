"""Kimi K3 on one GPU (issue 22's figures), in-process, dummy weights made on the device.

    kdaserve make-model /tmp/k3mini --preset kimi-k3-mini
    python benchmarks/bench_k3.py /tmp/k3mini --out benchmarks/results/k3_h200.json
    python benchmarks/bench_k3.py --preset kimi-k3-tiny --device cpu --context 256 --steps 4 \
        --kl-prompts 2 --kl-len 16 --out /tmp/k3.json            # CPU smoke test

Stages (--stages, comma list; each writes its own key into --out, which is updated in place so
stages may run in separate calls):

decode: batch-1 decode steps at --context tokens of context (the requests' KV and KDA states
  count as computed, as `kdaserve bench roofline` does: decode timing does not depend on their
  values), CUDA graphs, for MXFP4 routed experts and for bf16 experts of the same config (both
  through the latent_moe fused_tail backend), and MXFP4 with the unfused tail. Median of
  --steps steps, timed twice (the spread says what a difference must exceed); the step floor
  of engine/floor.py (StepFloor at the measured copy bandwidth) for each; mxfp4 / bf16 ratio.
profile: one MXFP4 model per tail (fused_tail on, off), eager decode steps under
  torch.profiler: the device kernels per step by name and their count, and which kernels only
  one of the two runs has (eager: every kernel is one launch; a graph replays the same list).
  Then one step under a TorchDispatchMode with hooks on each latent MoE's `experts` and
  `routed_expert_norm`, which run only on the unfused path: the bytes written and re-read of
  the finalized latent between the experts' per-entry outputs and the up projection (the
  top-k weighted sum's torch ops, the latent norm's input and output, the up projection's read
  of it). The fused tail makes no such tensor, so its count is 0 by construction of the
  hooks; the kernel list shows what replaces it (one latent_moe_tail_kernel per MoE layer).
kl: mean next-token KL(bf16 || MXFP4) over --kl-prompts random-token prompts x --kl-len
  positions: a model with bf16 experts, and its twin whose experts are those weights quantised
  to MXFP4 (kernels/mxfp4/format.py quantize_mxfp4, what loading bf16 experts with
  --quantization mxfp4 does), every other tensor shared.
  Weights: the loader's dummy fill (U(+-1e-3)) makes every layer's output ~1e-3 of its input
  and near-uniform logits, where any quantisation error is invisible. Instead: every matrix
  (linear weights, the experts, the conv filters, the router) ~ N(0, 1 / fan_in) (LeCun
  normal: each layer keeps its input's scale, as trained layers roughly do; the projections
  writing a layer's output, RESIDUAL_OUTPUTS, also / sqrt(2 * layers)), the embedding
  ~ N(0, 1), every norm weight 1, the router's correction bias 0 (tokens pick different
  experts), the KDA decay / dt parameters as the dummy fill leaves them. The logits then have
  std ~1; trained LMs' are several units, and KL grows with the logit scale (~ its square
  for small errors), so the figure is taken with the logits of both models scaled by one
  factor to std --kl-logit-std (default 3.0) and also given for std 1, 2, 3, 4 (kl_by_logit_std),
  with the bf16 model's mean entropy and the top-1 agreement at each; logit_rel_err is
  ||logits_mxfp4 - logits_bf16|| / ||logits_bf16||. Random weights have no trained model's
  robustness (a routing choice flips on a small input change and the error grows with depth),
  so read the figure as an upper-side proxy, not the checkpoint's KL.

JSON conventions as benchmarks/results/engine_h200.json (command, commit, gpu, torch).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import json
import math
import os
import random
import statistics
import sys
import tempfile
import time
from collections import Counter

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from kdaserve.attention.builder import build_metadata  # noqa: E402
from kdaserve.attention.caches import allocate_caches, state_bytes_per_slot  # noqa: E402
from kdaserve.attention.forward_context import ForwardContext, StepPlan  # noqa: E402
from kdaserve.bench.report import git_commit  # noqa: E402
from kdaserve.bench.roofline import run_point  # noqa: E402
from kdaserve.config import (CacheConfig, EngineConfig, KernelConfig, LoadConfig,  # noqa: E402
                             ModelConfig, SchedulerConfig)
from kdaserve.engine.floor import StepFloor, measure_copy_bandwidth, sync  # noqa: E402
from kdaserve.kernels.mxfp4.format import quantize_mxfp4  # noqa: E402
from kdaserve.layers.backends import select_backends  # noqa: E402
from kdaserve.layers.latent_moe import LatentMoE  # noqa: E402
from kdaserve.models.loader import _loadable_tensors, init_dummy_weights  # noqa: E402
from kdaserve.models.registry import build_model, resolve_architecture  # noqa: E402

STAGES = ("decode", "profile", "kl")
BLOCK = 16
LOGIT_STDS = (1.0, 2.0, 3.0, 4.0)
RESIDUAL_OUTPUTS = ("o_proj.weight", "mlp.down_proj.weight", "shared_experts.down_proj.weight",
                    "routed_expert_up_proj.weight")
"""The projections that write a layer's output into the stream: GPT-2 / Megatron's scaled
init (std / sqrt(2 * layers)), so each layer adds an update small next to the stream. (The
make-model presets' own random weights are N(0, 0.02) throughout: the K3 presets measured here
are config-only, and tests pin prompts found on those weights.)"""


# ----------------------------------------------------------------------------------------------
# Engine pieces
# ----------------------------------------------------------------------------------------------

def model_config(model_dir: str, experts: str, max_len: int) -> ModelConfig:
    """experts: mxfp4, or bf16 (the model dtype: the folder's quantization_config dropped)."""
    mc = ModelConfig(model=model_dir, max_model_len=max_len)
    if experts == "bf16":
        mc.arch = dataclasses.replace(mc.arch, expert_quantization=None)
    elif mc.arch.expert_quantization != "mxfp4":
        mc.arch = dataclasses.replace(mc.arch, expert_quantization="mxfp4")
    mc.arch.validate()
    return mc


def make_worker(a: argparse.Namespace, experts: str, fused_tail: bool, eager: bool,
                pdl: bool = True):
    """A Worker on a.device: the model built there (meta, then storage on the device) and
    filled with dummy weights there; caches for 4 requests of a.context tokens; graphs
    captured unless eager. pdl: KernelConfig.pdl (programmatic dependent launch)."""
    from kdaserve.worker.worker import Worker

    max_len = a.context + a.steps + 64
    blocks = 4 * -(-max_len // BLOCK) + 1
    config = EngineConfig(
        model_config=model_config(a.model, experts, max_len),
        cache_config=CacheConfig(block_size=BLOCK, num_gpu_blocks=blocks, num_state_slots=4,
                                 enable_prefix_caching=False),
        scheduler_config=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=512,
                                         max_model_len=max_len),
        load_config=LoadConfig(load_format="dummy", dummy_routing=a.dummy_routing),
        enforce_eager=eager, device=a.device,
        kernel_config=dataclasses.replace(KernelConfig(), latent_moe_fused_tail=fused_tail,
                                          pdl=pdl))
    t0 = time.perf_counter()
    worker = Worker(config)
    worker.initialize_cache(blocks, 4)
    print(f"[{experts}, fused_tail={fused_tail}{'' if pdl else ', pdl off'}] worker ready in "
          f"{time.perf_counter() - t0:.1f} s", flush=True)
    return worker


def release(*objs) -> None:
    del objs
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# ----------------------------------------------------------------------------------------------
# decode
# ----------------------------------------------------------------------------------------------

DECODE_RUNS = [("mxfp4", True, True), ("bf16", True, True), ("mxfp4", False, True),
               ("mxfp4", True, False), ("mxfp4", False, False), ("mxfp4-bits", True, True)]
"""(experts, fused tail, pdl) of the decode stage, named mxfp4-fused, bf16-fused,
mxfp4-unfused, mxfp4-fused-nopdl, mxfp4-unfused-nopdl, mxfp4-bits-fused in --decode-runs.
mxfp4-bits: MXFP4 experts with Mxfp4MoEConfig.lut_decode off (the bit decode the table lookup
replaced; the baseline of that change, at the same tiles)."""


@contextlib.contextmanager
def bit_decode(on: bool):
    """While on: every moe_partials call without an explicit config decodes MXFP4 with the
    bit arithmetic (its default config made with lut_decode=False; the tuned tiles are still
    applied on top). The kernels are captured into the CUDA graphs inside this block."""
    from kdaserve.kernels.moe import mxfp4_moe

    orig = mxfp4_moe.default_config
    if on:
        mxfp4_moe.default_config = lambda *a: dataclasses.replace(orig(*a), lut_decode=False)
    try:
        yield
    finally:
        mxfp4_moe.default_config = orig


def stage_decode(a: argparse.Namespace, bw: float) -> dict:
    # the last two: without PDL (the fused tail lost to the unfused one in graphs by more than
    # its kernels' device time: is it how its launches overlap?)
    runs = [r for r in DECODE_RUNS if f"{r[0]}-{'fused' if r[1] else 'unfused'}"
            f"{'' if r[2] else '-nopdl'}" in a.decode_runs.split(",")]
    out = {"command": " ".join(sys.argv), "batch": 1, "context": a.context, "steps": a.steps,
           "cuda_graphs": a.device == "cuda", "copy_bandwidth_TBps": bw / 1e12, "runs": []}
    for experts, fused, pdl in runs:
        with bit_decode(experts == "mxfp4-bits"):
            worker = make_worker(a, experts.split("-")[0], fused, eager=False, pdl=pdl)
            runner, args = worker.model_runner, worker.args
            vocab = args.vocab_size
            run_point(runner, 1, a.context, 3, vocab, 0)             # warm-up
            medians = [statistics.median(run_point(runner, 1, a.context, a.steps, vocab, r + 1))
                       * 1e3 for r in range(2)]
        floor = StepFloor.for_model(runner.model, args, runner.dtype.itemsize,
                                    state_bytes_per_slot(args, runner.dtype), bw)
        floor_ms = floor.seconds(1, a.context) * 1e3
        row = {"experts": experts, "latent_moe_fused_tail": fused, "pdl": pdl,
               "step_ms": min(medians), "step_ms_runs": medians,
               "floor_ms": floor_ms, "ratio_to_floor": min(medians) / floor_ms,
               "dense_bytes": floor.dense_bytes,
               "expert_bytes_per_expert_layer": floor.per_expert_bytes,
               "moe_layers": floor.moe_layers}
        print(f"decode b=1 ctx={a.context} {experts:5s} fused_tail={fused!s:5s} pdl={pdl!s:5s}: "
              f"{row['step_ms']:.3f} ms/step (runs {', '.join(f'{m:.3f}' for m in medians)}), "
              f"floor {floor_ms:.3f} ms, ratio {row['ratio_to_floor']:.2f}", flush=True)
        out["runs"].append(row)
        release(worker, runner)
    by = {(r["experts"], r["latent_moe_fused_tail"]): r["step_ms"] for r in out["runs"]
          if r["pdl"]}
    if ("bf16", True) in by and ("mxfp4", True) in by:
        out["speedup_mxfp4_vs_bf16"] = by[("bf16", True)] / by[("mxfp4", True)]
        out["pass_speedup_ge_1_55"] = out["speedup_mxfp4_vs_bf16"] >= 1.55
        print(f"bf16 / mxfp4 step time: {out['speedup_mxfp4_vs_bf16']:.2f}x (needs >= 1.55)",
              flush=True)
    if ("mxfp4-bits", True) in by and ("mxfp4", True) in by:
        out["speedup_lut_vs_bit_decode"] = by[("mxfp4-bits", True)] / by[("mxfp4", True)]
        print(f"bit decode / table decode step time: {out['speedup_lut_vs_bit_decode']:.3f}x",
              flush=True)
    if ("mxfp4", False) in by and ("mxfp4", True) in by:
        out["speedup_fused_vs_unfused_tail"] = by[("mxfp4", False)] / by[("mxfp4", True)]
        print(f"unfused / fused tail: {out['speedup_fused_vs_unfused_tail']:.3f}x", flush=True)
    return out


# ----------------------------------------------------------------------------------------------
# profile
# ----------------------------------------------------------------------------------------------

TOP_KERNELS = 18
"""Kernels printed per profiled variant, by device time (the JSON keeps them all)."""


def kernels_per_step(runner, vocab: int, a: argparse.Namespace,
                     steps: int) -> tuple[dict, float, dict]:
    """Eager decode steps under torch.profiler: ({kernel name: launches per step}, device
    time per step in ms, {kernel name: device us per step}). On the CPU (smoke test) the
    events are the aten ops."""
    from torch.profiler import ProfilerActivity, profile

    cuda = runner.device.type == "cuda"
    saved, runner.graphs = runner.graphs, None
    run_point(runner, 1, a.context, 2, vocab, 0)
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=acts) as prof:
        run_point(runner, 1, a.context, steps + 1, vocab, 1)
        sync(runner.device)
    runner.graphs = saved
    # run_point(steps + 1) runs steps + 2 forwards: the request's setup step (also a one-token
    # decode), then steps + 1 timed ones; the profile holds them all
    n = steps + 2
    counts, us = Counter(), Counter()
    for e in prof.events():
        is_kernel = (e.device_type == torch.autograd.DeviceType.CUDA if cuda
                     else e.name.startswith("aten::") and e.cpu_parent is None)
        if is_kernel:
            counts[e.name] += 1
            us[e.name] += e.time_range.elapsed_us()
    return ({k: v / n for k, v in sorted(counts.items())}, sum(us.values()) / n / 1e3,
            {k: v / n for k, v in us.most_common()})


def latent_round_trip_bytes(runner, vocab: int, a: argparse.Namespace) -> dict:
    """One eager decode step; see the module docstring (profile)."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten

    tally = {"bytes_written": 0, "bytes_read": 0, "module_calls": 0}
    state = {"inside": False}

    def nbytes(t):
        return t.numel() * t.element_size()

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if not state["inside"] or func.is_view:
                return out
            ins = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
            if not ins:                     # factory ops (empty): allocation, no traffic
                return out
            tally["bytes_read"] += sum(nbytes(t) for t in ins)
            tally["bytes_written"] += sum(nbytes(t) for t in tree_flatten(out)[0]
                                          if isinstance(t, torch.Tensor))
            return out

    def enter(_m, _inp):
        state["inside"] = True

    def leave_experts(_m, _inp, _out):
        state["inside"] = False
        tally["module_calls"] += 1

    def leave_norm(_m, inp, out):       # a Triton kernel: its input and output, then the up
        state["inside"] = False         # projection re-reads the output
        tally["bytes_read"] += nbytes(inp[0]) + nbytes(out)
        tally["bytes_written"] += nbytes(out)

    handles = []
    for m in runner.model.modules():
        if isinstance(m, LatentMoE):
            handles += [m.experts.register_forward_pre_hook(enter),
                        m.experts.register_forward_hook(leave_experts)]
            if m.routed_expert_norm is not None:
                handles += [m.routed_expert_norm.register_forward_pre_hook(enter),
                            m.routed_expert_norm.register_forward_hook(leave_norm)]
    saved, runner.graphs = runner.graphs, None
    try:
        with Count():
            run_point(runner, 1, a.context, 1, vocab, 2)
    finally:
        runner.graphs = saved
        for h in handles:
            h.remove()
    # run_point ran 2 steps (the first is the request's setup step, also a decode)
    return {k: v // 2 for k, v in tally.items()} | {
        "total_bytes_per_step": (tally["bytes_read"] + tally["bytes_written"]) // 2}


def stage_profile(a: argparse.Namespace) -> dict:
    out = {"command": " ".join(sys.argv), "batch": 1, "context": a.context,
           "profiled_steps": a.profile_steps, "mode": "eager (one launch per kernel)"}
    per = {}
    # the bf16-expert step too: where the time goes besides the expert GEMMs (the MXFP4 / bf16
    # ratio is bounded by everything the two steps share)
    for experts, fused in (("mxfp4", True), ("mxfp4", False), ("bf16", True)):
        worker = make_worker(a, experts, fused, eager=True)
        runner = worker.model_runner
        vocab = worker.args.vocab_size
        kernels, dev_ms, kernel_us = kernels_per_step(runner, vocab, a, a.profile_steps)
        trip = latent_round_trip_bytes(runner, vocab, a)
        key = ("fused_tail" if fused else "unfused_tail") + ("_bf16" if experts == "bf16" else "")
        per[key] = kernels
        out[key] = {"launches_per_step": sum(kernels.values()),
                    "device_ms_per_step": dev_ms, "latent_round_trip": trip,
                    "kernels_per_step": kernels, "device_us_per_step": kernel_us}
        for name, t in list(kernel_us.items())[:TOP_KERNELS]:
            print(f"  {t:8.1f} us/step  {kernels[name]:6.2f} launches  {name[:110]}")
        print(f"profile {key}: {sum(kernels.values()):.0f} launches/step, {dev_ms:.3f} ms "
              f"device time/step, latent round trip {trip['total_bytes_per_step']} B/step "
              f"({trip['module_calls']} unfused-tail module calls/step)", flush=True)
        release(worker, runner)
    f, u = per["fused_tail"], per["unfused_tail"]
    out["only_fused_tail"] = {k: v for k, v in f.items() if k not in u}
    out["only_unfused_tail"] = {k: v for k, v in u.items() if k not in f}
    out["count_changed"] = {k: [f[k], u[k]] for k in f.keys() & u.keys() if f[k] != u[k]}
    out["launches_saved_per_step"] = (out["unfused_tail"]["launches_per_step"]
                                      - out["fused_tail"]["launches_per_step"])
    out["latent_bytes_saved_per_step"] = (
        out["unfused_tail"]["latent_round_trip"]["total_bytes_per_step"]
        - out["fused_tail"]["latent_round_trip"]["total_bytes_per_step"])
    print(f"fused tail saves {out['launches_saved_per_step']:.0f} launches and "
          f"{out['latent_bytes_saved_per_step']} latent bytes per step; only with it: "
          f"{out['only_fused_tail']}; only without it: {out['only_unfused_tail']}", flush=True)
    return out


# ----------------------------------------------------------------------------------------------
# kl
# ----------------------------------------------------------------------------------------------

def realistic_init(model: torch.nn.Module, seed: int) -> None:
    """See the module docstring (kl): LeCun-normal matrices, N(0, 1) embedding, unit norms,
    zero routing bias; everything else as the dummy fill leaves it."""
    init_dummy_weights(model, seed, "spread")
    num_layers = len(model.model.layers)
    gen = torch.Generator(device=next(model.parameters()).device).manual_seed(seed + 1)
    with torch.no_grad():
        for name, t in _loadable_tensors(model).items():
            d = t.data
            if not d.is_floating_point():
                continue
            if name.endswith("norm.weight"):
                d.fill_(1.0)
            elif name.endswith("e_score_correction_bias"):
                d.zero_()
            elif name.endswith("embed_tokens.weight"):
                d.normal_(0.0, 1.0, generator=gen)
            elif d.dim() >= 2:
                std = 1.0 / math.sqrt(d.shape[-1])
                if name.endswith(RESIDUAL_OUTPUTS):
                    std /= math.sqrt(2 * num_layers)
                d.normal_(0.0, std, generator=gen)


def mxfp4_twin(dense: torch.nn.Module, args, dtype, device, backends, cls) -> torch.nn.Module:
    """The same model with MXFP4 experts: every tensor copied, the experts quantised (one
    expert at a time: no full-size fp32 temporary)."""
    twin = build_model(dataclasses.replace(args, expert_quantization="mxfp4"), dtype, device,
                       cls, backends)
    src = _loadable_tensors(dense)
    with torch.no_grad():
        for name, t in _loadable_tensors(twin).items():
            if name.endswith("_scale"):
                continue
            if name.endswith("_packed"):
                w, scale = src[name.removesuffix("_packed")].data, \
                    _loadable_tensors(twin)[name.removesuffix("_packed") + "_scale"].data
                for e in range(w.shape[0]):
                    p, s = quantize_mxfp4(w[e])
                    t.data[e].copy_(p)
                    scale[e].copy_(s)
            else:
                t.data.copy_(src[name].data)
    post = getattr(twin, "process_weights_after_loading", None)
    if callable(post):
        post()
    return twin


@torch.no_grad()
def prefill_logits(model, args, prompts: list[list[int]], dtype, device) -> torch.Tensor:
    """Logits [sum(len), V] (fp32) of fresh prefills of `prompts` in one flattened batch."""
    per = -(-max(len(p) for p in prompts) // BLOCK)
    caches = allocate_caches(args, num_blocks=per * len(prompts), block_size=BLOCK,
                             num_slots=len(prompts) + 1, dtype=dtype, device=device)
    md = build_metadata([len(p) for p in prompts], [0] * len(prompts),
                        [list(range(i * per, (i + 1) * per)) for i in range(len(prompts))],
                        [i + 1 for i in range(len(prompts))], BLOCK, device)
    ids = torch.tensor([t for p in prompts for t in p], device=device)
    h = model(ids, ForwardContext(md, caches, StepPlan.eager(md)))
    return model.compute_logits(h).float()


def stage_kl(a: argparse.Namespace) -> dict:
    device = torch.device(a.device)
    mc = model_config(a.model, "bf16", a.kl_len + 16)
    args = mc.arch
    dtype = mc.torch_dtype(device.type)
    backends = select_backends(KernelConfig(), device)
    cls = resolve_architecture(mc.hf_config)
    t0 = time.perf_counter()
    dense = build_model(args, dtype, device, cls, backends)
    realistic_init(dense, a.seed)
    post = getattr(dense, "process_weights_after_loading", None)
    if callable(post):
        post()
    twin = mxfp4_twin(dense, args, dtype, device, backends, cls)
    print(f"kl: bf16 model and its MXFP4 twin ready in {time.perf_counter() - t0:.1f} s",
          flush=True)
    rng = random.Random(a.seed)
    sums = {s: {"kl": 0.0, "entropy": 0.0, "top1": 0.0} for s in LOGIT_STDS + (a.kl_logit_std,)}
    positions, raw_std, err2, ref2 = 0, [], 0.0, 0.0
    for start in range(0, a.kl_prompts, a.kl_batch):
        prompts = [[rng.randrange(args.vocab_size) for _ in range(a.kl_len)]
                   for _ in range(min(a.kl_batch, a.kl_prompts - start))]
        p = prefill_logits(dense, args, prompts, dtype, device)          # [T, V]
        q = prefill_logits(twin, args, prompts, dtype, device)
        std = p.std(dim=-1, keepdim=True)                                 # [T, 1]
        raw_std.append(std.mean().item())
        err2 += (p - q).square().sum().item()
        ref2 += p.square().sum().item()
        for target, acc in sums.items():
            lp = torch.log_softmax(p * (target / std), -1)
            lq = torch.log_softmax(q * (target / std), -1)
            acc["kl"] += (lp.exp() * (lp - lq)).sum().item()
            acc["entropy"] += -(lp.exp() * lp).sum().item()
            acc["top1"] += (lp.argmax(-1) == lq.argmax(-1)).sum().item()
        positions += p.shape[0]
    table = {f"{s:g}": {k: v / positions for k, v in acc.items()} for s, acc in sums.items()}
    main = table[f"{a.kl_logit_std:g}"]
    out = {"command": " ".join(sys.argv), "prompts": a.kl_prompts, "positions": a.kl_len,
           "tokens": positions, "weights": "LeCun-normal matrices, N(0,1) embedding, unit "
           "norms (bench_k3.py docstring)", "raw_logit_std": statistics.mean(raw_std),
           "logit_rel_err": math.sqrt(err2 / ref2),
           "logit_std": a.kl_logit_std, "mean_kl": main["kl"],
           "mean_entropy_bf16": main["entropy"], "top1_agreement": main["top1"],
           "kl_by_logit_std": table, "pass_kl_le_0_02": main["kl"] <= 0.02}
    print(f"kl: mean KL(bf16 || mxfp4) {main['kl']:.5f} at logit std {a.kl_logit_std:g} "
          f"(entropy {main['entropy']:.2f} nats, top-1 agreement {main['top1']:.3f}; raw "
          f"logit std {out['raw_logit_std']:.2f}, logit rel err {out['logit_rel_err']:.3f}); "
          f"by logit std: "
          + ", ".join(f"{k}: {v['kl']:.5f}" for k, v in table.items()), flush=True)
    release(dense, twin)
    return out


# ----------------------------------------------------------------------------------------------

def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", nargs="?", default=None,
                    help="K3 model folder (kdaserve make-model --preset kimi-k3-mini)")
    ap.add_argument("--preset", default=None,
                    help="make this preset's folder in a temp dir instead of MODEL")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--stages", default=",".join(STAGES))
    ap.add_argument("--context", type=int, default=8000)
    ap.add_argument("--steps", type=int, default=64, help="timed decode steps per run")
    ap.add_argument("--decode-runs", default=",".join(
        f"{e}-{'fused' if f else 'unfused'}{'' if p else '-nopdl'}" for e, f, p in DECODE_RUNS),
        help="the decode stage's runs (DECODE_RUNS names), comma-separated")
    ap.add_argument("--profile-steps", type=int, default=3)
    ap.add_argument("--dummy-routing", default="vllm", choices=["vllm", "spread"])
    ap.add_argument("--kl-prompts", type=int, default=64)
    ap.add_argument("--kl-len", type=int, default=128)
    ap.add_argument("--kl-batch", type=int, default=8, help="prompts per forward pass")
    ap.add_argument("--kl-logit-std", type=float, default=3.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="JSON to create or update (one key per stage)")
    a = ap.parse_args()
    stages = [s for s in a.stages.split(",") if s]
    if set(stages) - set(STAGES):
        ap.error(f"--stages takes {', '.join(STAGES)}")
    if (a.model is None) == (a.preset is None):
        ap.error("give MODEL or --preset")
    if a.preset:
        from kdaserve.models.make_model import make_model

        a.model = make_model(tempfile.mkdtemp(prefix="bench_k3_"), preset=a.preset)
    device = torch.device(a.device)
    result = {}
    if a.out and os.path.isfile(a.out):
        with open(a.out) as f:
            result = json.load(f)
    result.update({"commit": git_commit(), "torch": torch.__version__,
                   "gpu": torch.cuda.get_device_name() if device.type == "cuda" else "none",
                   "device": a.device, "model": a.model, "preset": a.preset})
    bw = measure_copy_bandwidth(device) if "decode" in stages else None
    for stage in stages:
        t0 = time.perf_counter()
        result[stage] = (stage_decode(a, bw) if stage == "decode" else
                         stage_profile(a) if stage == "profile" else stage_kl(a))
        result[stage]["wall_s"] = time.perf_counter() - t0
        result[stage]["commit"] = result["commit"]
        if a.out:
            with open(a.out, "w") as f:
                json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
