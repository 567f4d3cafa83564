# SPDX-License-Identifier: Apache-2.0
"""HF transformers baseline for the W1 model: prefill time (TTFT) and decode ms/step.

Builds `transformers.KimiLinearForCausalLM` from a config.json with random bf16 weights (every
matrix drawn from N(0, 0.02), seeded, initialised on the device, so routing is spread over the
experts), then for each batch size: one warm-up pass, a timed prefill of `--input-len` random
tokens per row (TTFT = prefill + first greedy token), and `--decode-steps` timed greedy decode
steps with the model's cache. Output tok/s = batch / decode step time (the reference's
definition). Writes JSON like the other benchmarks.

Which KDA / conv kernels ran is reported: transformers uses fla-core (and causal-conv1d) when
importable, else its plain-torch reference (slow but correct).

    python benchmarks/hf_baseline.py /tmp/k48 --out benchmarks/results/hf_baseline.json
    python benchmarks/hf_baseline.py /tmp/tiny --device cpu --dtype float32 \\
        --input-len 64 --decode-steps 4 --batch-sizes 1,2        # the CI-sized path
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import inspect
import json
import os
import shlex
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch

from kdaserve.bench.report import git_commit, gpu_name

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
INIT_STD = 0.02
# Keep transformers' own init for these (FLA-style gate parameters, norms are 1-D anyway).
KEEP_INIT = ("A_log", "dt_bias", "e_score_correction_bias")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("config", help="config.json, or a model folder holding one.")
    p.add_argument("--batch-sizes", default="1,4,16")
    p.add_argument("--input-len", type=int, default=8000)
    p.add_argument("--decode-steps", type=int, default=64,
                   help="Timed greedy decode steps per batch. Default: %(default)s.")
    p.add_argument("--device", default="cuda", help="cuda (default) or cpu.")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--attn-implementation", default="sdpa",
                   help="transformers attention backend for the MLA layers. Default: sdpa.")
    p.add_argument("--out", default=None, help="Result JSON path.")
    args = p.parse_args(argv)
    try:
        args.batch_sizes = [int(b) for b in args.batch_sizes.split(",") if b.strip()]
    except ValueError:
        p.error(f"--batch-sizes must be a comma list of integers, got {args.batch_sizes!r}")
    if not args.batch_sizes or min(args.batch_sizes) < 1:
        p.error(f"--batch-sizes must be positive, got {args.batch_sizes}")
    if args.input_len < 1 or args.decode_steps < 1:
        p.error("--input-len and --decode-steps must be >= 1")
    if os.path.isdir(args.config):
        args.config = os.path.join(args.config, "config.json")
    if not os.path.isfile(args.config):
        p.error(f"no config.json at {args.config!r}")
    return args


def build_model(config_path: str, device: torch.device, dtype: torch.dtype, seed: int,
                attn_implementation: str):
    """KimiLinearForCausalLM on `device` with every weight matrix drawn from N(0, 0.02)."""
    from transformers import KimiLinearConfig, KimiLinearForCausalLM

    with open(config_path) as f:
        cfg = KimiLinearConfig.from_dict(json.load(f))
    cfg._attn_implementation = attn_implementation
    with torch.device(device):
        model = KimiLinearForCausalLM._from_config(cfg, dtype=dtype)
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.ndim >= 2 and not name.endswith(KEEP_INIT):
                param.normal_(0.0, INIT_STD, generator=gen)
    return model.eval()


def kernel_paths() -> dict:
    """Which implementation transformers bound for each KDA / conv function."""
    from transformers.models.kimi_linear import modeling_kimi_linear as m

    out = {"fla_installed": importlib.util.find_spec("fla") is not None,
           "causal_conv1d_installed": importlib.util.find_spec("causal_conv1d") is not None}
    for fn in ("chunk_kimi_delta_attention", "recurrent_kimi_delta_attention",
               "causal_conv1d_fn", "causal_conv1d_update"):
        impl = _bound_implementation(getattr(m, fn))
        module = getattr(impl, "__module__", None) or "unknown"
        out[fn] = "torch (transformers reference)" if module.startswith("transformers") else module
    return out


def _bound_implementation(obj):
    """The implementation a transformers hub-kernel function dispatches to: the `implementation`
    its closure holds; newer releases (with the `kernels` package) wrap the function in a
    module whose forward closes over it as `func`, unwrapped here. None where neither holds."""
    for _ in range(4):
        if not inspect.isfunction(obj):
            forward = getattr(type(obj), "forward", None)
            if not inspect.isfunction(forward):
                return None
            obj = inspect.getclosurevars(forward).nonlocals.get("func")
            continue
        nonlocals = inspect.getclosurevars(obj).nonlocals
        if "implementation" in nonlocals:
            return nonlocals["implementation"]
        return obj
    return None


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.inference_mode()
def run_batch(model, batch: int, input_len: int, decode_steps: int, device: torch.device,
              seed: int) -> dict:
    """Timed prefill (TTFT) then `decode_steps` greedy steps; times in ms."""
    vocab = model.config.vocab_size
    gen = torch.Generator(device="cpu").manual_seed(seed + batch)
    ids = torch.randint(0, vocab, (batch, input_len), generator=gen).to(device)  # [B, L]

    sync(device)
    t0 = time.perf_counter()
    out = model(input_ids=ids, use_cache=True, logits_to_keep=1)
    next_ids = out.logits[:, -1].argmax(dim=-1, keepdim=True)  # [B, 1]
    sync(device)
    ttft_ms = (time.perf_counter() - t0) * 1000.0
    cache = out.cache if hasattr(out, "cache") else out.past_key_values

    step_ms, tokens = [], [next_ids]
    for _ in range(decode_steps):
        t = time.perf_counter()
        out = model(input_ids=next_ids, cache=cache, use_cache=True, logits_to_keep=1)
        next_ids = out.logits[:, -1].argmax(dim=-1, keepdim=True)
        sync(device)
        step_ms.append((time.perf_counter() - t) * 1000.0)
        cache = out.cache if hasattr(out, "cache") else out.past_key_values
        tokens.append(next_ids)
    step_ms.sort()
    mean_step = sum(step_ms) / len(step_ms)
    result = {
        "batch_size": batch, "input_len": input_len, "decode_steps": decode_steps,
        "ttft_ms": ttft_ms,
        "decode_ms_per_step": mean_step,
        "decode_ms_per_step_median": step_ms[len(step_ms) // 2],
        "decode_ms_per_step_min": step_ms[0],
        "output_tok_s": batch * 1000.0 / mean_step,
        "first_tokens": torch.cat(tokens, dim=1)[0, :8].tolist(),
    }
    if device.type == "cuda":
        result["max_memory_allocated_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
    return result


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("hf_baseline: error: --device cuda but no CUDA device (use --device cpu)",
              file=sys.stderr)
        return 2
    t_build = time.perf_counter()
    model = build_model(args.config, device, DTYPES[args.dtype], args.seed,
                        args.attn_implementation)
    build_s = time.perf_counter() - t_build
    n_params = sum(p.numel() for p in model.parameters())
    paths = kernel_paths()
    print(f"built {n_params / 1e9:.2f}B parameters in {build_s:.1f} s on {device}; "
          f"kernels: {paths}", file=sys.stderr)

    batches = []
    for b in args.batch_sizes:
        try:
            # Warm-up at the measured shape: kernel compilation / autotuning, allocator growth.
            run_batch(model, b, args.input_len, 2, device, args.seed + 1000)
            r = run_batch(model, b, args.input_len, args.decode_steps, device, args.seed)
        except torch.OutOfMemoryError as e:
            r = {"batch_size": b, "error": f"out of memory: {str(e)[:300]}"}
            torch.cuda.empty_cache()
        batches.append(r)
        if "error" in r:
            print(f"batch {b}: {r['error']}", file=sys.stderr)
        else:
            print(f"batch {b:3d}: TTFT {r['ttft_ms']:.1f} ms, decode "
                  f"{r['decode_ms_per_step']:.2f} ms/step, {r['output_tok_s']:.1f} tok/s",
                  file=sys.stderr)

    result = {
        "benchmark": "hf_baseline",
        "command": shlex.join([sys.executable, *sys.argv]),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "commit": git_commit(), "gpu": gpu_name(), "device": str(device),
        "torch": torch.__version__, "transformers": __import__("transformers").__version__,
        "config": os.path.abspath(args.config), "dtype": args.dtype,
        "weights": f"random N(0, {INIT_STD}) seed {args.seed}", "greedy": True,
        "num_parameters": n_params, "build_s": build_s, "kernels": paths,
        "attn_implementation": args.attn_implementation, "batches": batches,
    }
    print("| batch | TTFT | decode ms/step | output tok/s |\n|---|---|---|---|")
    for r in batches:
        if "error" not in r:
            print(f"| {r['batch_size']} | {r['ttft_ms']:.0f} ms | {r['decode_ms_per_step']:.1f} | "
                  f"{r['output_tok_s']:.1f} |")
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return 0 if all("error" not in r for r in batches) else 1


if __name__ == "__main__":
    sys.exit(main())
