"""Hybrid prefix caching on kimi-k3-tiny (AttnRes, latent MoE, MXFP4 experts, full-rank KDA gate
with its lower bound): greedy output is the same with the cache on (internal or split KDA
checkpoints) and off, and a request sharing a prefix computes only its suffix."""

from __future__ import annotations

import random

from kdaserve import SamplingParams
from tests.models.k3_tiny import k3_tiny_dir, make_k3_llm, one_torch_thread  # noqa: F401

GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
CACHE = {"kda_checkpoint_interval": 64, "block_size": 16}


def _prompts():
    rng = random.Random(0)
    base = [rng.randrange(3, 3000) for _ in range(200)]

    def tail():
        return [rng.randrange(3, 3000) for _ in range(rng.randint(1, 20))]

    return [base[:130] + tail()], [base[:L] + tail() for L in (40, 70, 140, 200)]


def _generate(llm, prompts):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs], [o.num_cached_tokens for o in outs]


def test_greedy_identical_with_cache_on_and_off(make_k3_llm):  # noqa: F811
    first, second = _prompts()
    results = {}
    for name, kwargs in {"off": {"enable_prefix_caching": False},
                         "internal": {"kda_checkpoint_mode": "internal"},
                         "split": {"kda_checkpoint_mode": "split"}}.items():
        llm = make_k3_llm(**CACHE, **kwargs)
        a, _ = _generate(llm, first)
        b, cached = _generate(llm, second)
        results[name] = (a + b, cached)
    assert results["internal"][0] == results["off"][0]
    assert results["split"][0] == results["off"][0]
    assert not any(results["off"][1])
    # 40 shares less than a checkpoint; 70 and 140 hit 64 and 128 (the first wave's 130 + tail)
    assert results["internal"][1][:3] == [0, 64, 128]
    assert max(results["split"][1]) > 0


def test_offloaded_prefix_served_from_host_memory(make_k3_llm):  # noqa: F811
    """The offload tier moves kimi-k3-tiny's caches too: a prefix the small device cache
    evicted comes back from host memory with the recompute's output."""
    rng = random.Random(5)
    first = [rng.randrange(3, 3000) for _ in range(150)]
    others = [[rng.randrange(3, 3000) for _ in range(120)] for _ in range(5)]
    prompts = [first] + others + [first + [7, 8]]
    small = dict(CACHE, num_gpu_blocks=24, num_kda_checkpoint_slots=8, max_model_len=256)
    ref = [_generate(make_k3_llm(enable_prefix_caching=False, **small), [p])[0][0]
           for p in prompts]
    llm = make_k3_llm(kv_offload_size=0.01, **small)
    got = [_generate(llm, [p]) for p in prompts]
    assert [g[0][0] for g in got] == ref
    assert got[-1][1] == [150]               # the first prompt's end, from host memory
    assert llm.llm_engine.get_stats().offload_host_hit_tokens == 150
