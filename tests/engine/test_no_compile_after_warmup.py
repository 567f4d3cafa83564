"""A warmed-up engine compiles nothing while it serves (issue 19: no JIT, autotuning or
first-use compilation after start-up, for any composition the scheduler can produce).

GPU only: the engine on the tiny model in bf16 with CUDA graphs, async scheduling and chunked
prefill starts (warm-up, graph capture), then a seeded random run of requests arriving while
others decode: prompt lengths from 1 token to several chunks, greedy / temperature + top-p /
top-k / min-p / penalties / n = 2 / logprobs, stop on max_tokens. Triton's JIT hooks must see
no cache miss (a compile, or a load from the disk cache) during the run. The speculative
variant (issue 20) runs the same on a DSpark drafter with probabilistic drafts: verification
rows next to plain decodes (penalty requests are never drafted for) and prefill chunks, the
drafter's block graphs, the rejection sampler over 1 + K positions.
"""

from __future__ import annotations

import random

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def _params(rng: random.Random):
    from kdaserve import SamplingParams

    n_tok = rng.randint(1, 24)
    kind = rng.choice(["greedy", "top_p", "top_k", "min_p", "penalty", "n2", "logprobs"])
    base = dict(max_tokens=n_tok, ignore_eos=True, seed=rng.randrange(1 << 20))
    extra = {"greedy": dict(temperature=0.0),
             "top_p": dict(temperature=0.8, top_p=0.9),
             "top_k": dict(temperature=1.0, top_k=20),
             "min_p": dict(temperature=1.0, min_p=0.05),
             "penalty": dict(temperature=0.7, presence_penalty=0.5, repetition_penalty=1.1),
             "n2": dict(temperature=1.0, n=2),
             "logprobs": dict(temperature=0.0, logprobs=3)}[kind]
    return SamplingParams(**base, **extra)


@pytest.mark.parametrize("spec", [None, "dspark"])
def test_warm_engine_compiles_nothing(tmp_path, spec):
    pytest.importorskip("triton")
    from tests.engine.conftest import target_and_spec
    from kdaserve import LLM
    from kdaserve.kernels.jit_log import CompileLog

    target, kw = target_and_spec(tmp_path, spec, draft_sample_method="probabilistic")
    llm = LLM(target, max_model_len=1024, max_num_seqs=16, num_gpu_blocks=1024,
              max_num_batched_tokens=256, dtype="bfloat16", async_scheduling=True, **kw)
    engine = llm.llm_engine
    vocab = engine.vocab_size
    rng = random.Random(19)
    log = CompileLog()
    try:
        pending = [(f"r{i}", [rng.randrange(3, vocab) for _ in range(rng.choice(
            [1, 2, 7, 16, 31, 64, 100, 255, 256, 257, 600, 900]))], _params(rng))
            for i in range(48)]
        steps = 0
        events: list[dict] = []
        while pending or engine.has_unfinished_requests():
            for _ in range(rng.choice([0, 0, 1, 1, 2, 5]) if pending else 0):
                if pending:
                    engine.add_request(*pending.pop())
            if engine.has_unfinished_requests():
                sched = engine.scheduler
                shape = (sum(1 for r in sched.running if r.num_computed_tokens
                             >= r.num_prompt_tokens), len(sched.running), len(sched.waiting))
                engine.step()
                steps += 1
                for e in log.take():   # where each compile happened, for the diagnosis
                    events.append(dict(e, step=steps, decoding_running_waiting=shape))
    finally:
        log.close()
    assert steps > 50
    assert not events, f"{len(events)} kernels compiled after start-up: " + "; ".join(
        f"{e['kernel']} at step {e['step']} {e['decoding_running_waiting']} {e['attrs'][:300]} "
        f"constexprs {e['constexprs'][:300]} warps, stages {e['warps_stages']}"
        for e in events)
