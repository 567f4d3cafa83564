"""compile_workers (kernels/compile_ahead.py in the worker's start-up): the warm-up steps that
follow the deferred pass load every kdaserve kernel variant from the disk cache the workers
filled (Triton's compilation listener reports each as a cache hit), and the engine's greedy
output equals an engine's without the pool. GPU only, on an empty Triton cache."""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.mark.parametrize("spec", [None, "dspark"])
def test_warmup_after_the_pool_compiles_nothing(tmp_path, monkeypatch, spec):
    """spec: a DSpark drafter too (the verification forwards are in the deferred pass)."""
    pytest.importorskip("triton")
    from triton import knobs

    from tests.engine.conftest import target_and_spec

    import kdaserve.worker.worker as worker_mod
    from kdaserve import LLM, SamplingParams

    model, spec_kw = target_and_spec(tmp_path, spec)
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton"))
    calls, events = [], []
    real_warmup = worker_mod.warmup_steps

    def listener(*, src, cache_hit, **_):
        fn = getattr(src, "fn", None)
        module = getattr(getattr(fn, "fn", None), "__module__", "")
        if module.startswith("kdaserve."):
            events.append((fn.fn.__name__, cache_hit))

    def spy(runner, sc):
        calls.append(len(calls))
        if len(calls) == 1:                  # the deferred pass
            return real_warmup(runner, sc)
        saved = knobs.compilation.listener
        knobs.compilation.listener = listener
        try:
            return real_warmup(runner, sc)
        finally:
            knobs.compilation.listener = saved

    monkeypatch.setattr(worker_mod, "warmup_steps", spy)
    kw = dict(max_model_len=1024, max_num_seqs=8, num_gpu_blocks=512,
              max_num_batched_tokens=256, dtype="bfloat16")
    prompts = [{"prompt_token_ids": [5 + i, 17, 99, 3 + 2 * i] * (3 + i)} for i in range(4)]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    llm = LLM(model, compile_workers=2, **kw, **spec_kw)
    assert len(calls) == 2
    assert events, "the warm-up met no kdaserve kernel variant"
    missed = sorted({name for name, hit in events if not hit})
    assert not missed, f"compiled in-process after the pool: {missed}"
    ahead = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    del llm
    monkeypatch.setattr(worker_mod, "warmup_steps", real_warmup)
    plain = [o.outputs[0].token_ids for o in LLM(model, **kw).generate(prompts, params)]
    assert ahead == plain          # greedy: with a drafter too, the target's own tokens
