"""Host-side time of one engine step: the model's forward and lm_head are stubbed (zeros), so
what is left is scheduling, batch building, sampling bookkeeping, output processing and
detokenization, the work the GPU waits for between graph replays.

    python benchmarks/host_overhead.py MODEL_DIR --requests 16 --steps 200

Run it on the CPU with a tiny model (e.g. `kdaserve make-model /tmp/tiny --preset tiny`): the
sampler then computes on the CPU, and its time is reported apart.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from kdaserve import SamplingParams  # noqa: E402
from kdaserve.engine.llm_engine import LLMEngine  # noqa: E402


class StubModel(torch.nn.Module):
    def __init__(self, hidden: int, vocab: int) -> None:
        super().__init__()
        self.hidden, self.vocab = hidden, vocab

    def forward(self, ids: torch.Tensor, ctx, **kwargs) -> torch.Tensor:
        return torch.zeros(ids.shape[0], self.hidden)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return torch.zeros(hidden.shape[0], self.vocab)


def timed(obj, name: str, totals: dict, key: str) -> None:
    """Wrap obj.name so its wall time adds up in totals[key]."""
    fn = getattr(obj, name)

    def wrapper(*args, **kwargs):
        t = time.perf_counter()
        out = fn(*args, **kwargs)
        totals[key] += time.perf_counter() - t
        return out
    setattr(obj, name, wrapper)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=2000)
    ap.add_argument("--steps", type=int, default=200)
    args = ap.parse_args()
    torch.set_num_threads(1)
    engine = LLMEngine.from_engine_args(
        model=args.model, device="cpu", max_model_len=args.prompt_len + args.steps + 64,
        max_num_seqs=args.requests, num_gpu_blocks=args.requests * (
            (args.prompt_len + args.steps + 64) // 16 + 1),
        max_num_batched_tokens=max(8192, args.requests * args.prompt_len),
        enable_prefix_caching=False)
    runner = engine.model_runner
    runner.model = StubModel(runner.args.hidden_size, runner.args.vocab_size)
    totals = {"schedule": 0.0, "launch": 0.0, "collect": 0.0, "sampler (CPU compute)": 0.0}
    timed(engine.scheduler, "schedule", totals, "schedule")
    timed(runner, "launch", totals, "launch")
    timed(runner, "collect", totals, "collect")
    timed(runner.sampler, "forward", totals, "sampler (CPU compute)")
    sp = SamplingParams(temperature=0.0, max_tokens=args.steps + 10, ignore_eos=True)
    for i in range(args.requests):
        engine.add_request(f"r{i}", [100 + (i + j) % 500 for j in range(args.prompt_len)], sp)
    for _ in range(5):          # prefill and first decodes
        engine.step()
    for k in totals:
        totals[k] = 0.0
    t0 = time.perf_counter()
    for _ in range(args.steps):
        engine.step()
    per_step = (time.perf_counter() - t0) / args.steps
    parts = ", ".join(f"{k} {v / args.steps * 1e3:.3f} ms" for k, v in totals.items())
    print(f"{args.requests} requests: {per_step * 1e3:.3f} ms per step ({parts}; the rest is "
          "output processing and detokenization)")


if __name__ == "__main__":
    main()
