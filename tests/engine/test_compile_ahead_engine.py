"""compile_workers (kernels/compile_ahead.py in the worker's start-up): the warm-up steps that
follow the deferred pass load every kdaserve kernel variant from the disk cache the workers
filled (Triton's compilation listener reports each as a cache hit), and the engine's greedy
output equals an engine's without the pool. GPU only. The pooled engine starts in a fresh
process on an empty Triton cache: in this one, earlier tests' variants are compiled already."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

KW = dict(max_model_len=1024, max_num_seqs=8, num_gpu_blocks=512, max_num_batched_tokens=256,
          dtype="bfloat16")
PROMPTS = [{"prompt_token_ids": [5 + i, 17, 99, 3 + 2 * i] * (3 + i)} for i in range(4)]

POOLED = """
import json, sys
from triton import knobs
import kdaserve.worker.worker as worker_mod
from kdaserve import LLM, SamplingParams

model, kw, prompts = sys.argv[1], json.loads(sys.argv[2]), json.loads(sys.argv[3])
calls, events = [], []
real = worker_mod.warmup_steps

def listener(*, src, cache_hit, **_):
    fn = getattr(src, "fn", None)
    if getattr(getattr(fn, "fn", None), "__module__", "").startswith("kdaserve."):
        events.append([fn.fn.__name__, cache_hit])

def spy(runner, sc):
    calls.append(1)
    if len(calls) == 1:                     # the deferred pass
        return real(runner, sc)
    knobs.compilation.listener = listener
    try:
        return real(runner, sc)
    finally:
        knobs.compilation.listener = None

worker_mod.warmup_steps = spy
llm = LLM(model, compile_workers=2, **kw)
out = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
                   use_tqdm=False)
print(json.dumps({"calls": len(calls), "events": events,
                  "tokens": [list(o.outputs[0].token_ids) for o in out]}))
"""


@pytest.mark.parametrize("spec", [None, "dspark", "kimi-k3-tiny"])
def test_warmup_after_the_pool_compiles_nothing(tmp_path, spec):
    """spec: a DSpark drafter too (the verification forwards are in the deferred pass), or
    the K3 model (MXFP4 experts, AttnRes) without one."""
    pytest.importorskip("triton")
    from tests.engine.conftest import target_and_spec

    from kdaserve import LLM, SamplingParams
    from kdaserve.models.make_model import make_model

    if spec == "kimi-k3-tiny":
        model, spec_kw = make_model(str(tmp_path / "k3"), spec), {}
    else:
        model, spec_kw = target_and_spec(tmp_path, spec)
    env = dict(os.environ, TRITON_CACHE_DIR=str(tmp_path / "triton"))
    run = subprocess.run([sys.executable, "-c", POOLED, model, json.dumps(KW | spec_kw),
                          json.dumps(PROMPTS)], env=env, capture_output=True, text=True,
                         timeout=900)
    assert run.returncode == 0, run.stderr[-4000:]
    res = json.loads(run.stdout.strip().splitlines()[-1])
    assert res["calls"] == 2
    assert res["events"], "the warm-up met no kdaserve kernel variant"
    missed = sorted({name for name, hit in res["events"] if not hit})
    assert not missed, f"compiled in-process after the pool: {missed}"
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    # the same engine without the pool: with a drafter, bf16 verify forwards need not round
    # as decode forwards do, so the reference keeps the drafter
    same = [list(o.outputs[0].token_ids)
            for o in LLM(model, **KW, **spec_kw).generate(PROMPTS, params, use_tqdm=False)]
    assert res["tokens"] == same
