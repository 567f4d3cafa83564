"""Hybrid prefix caching end to end on the tiny model (CPU, fp32): greedy output is the same with
the cache on (internal or split checkpoints) and off; a request sharing a prefix computes only
its suffix; internal checkpoints hold the same states as the split baseline; n > 1, abort and
preemption leave every pool free (the make_llm fixture checks)."""

from __future__ import annotations

import random

import torch

from kdaserve import SamplingParams
from kdaserve.request import Request

GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
CACHE = {"kda_checkpoint_interval": 64, "block_size": 16}


def _prompts(seed: int = 0):
    rng = random.Random(seed)
    base = [rng.randrange(3, 128) for _ in range(260)]

    def tail():
        return [rng.randrange(3, 128) for _ in range(rng.randint(1, 25))]

    first = [base[:L] + tail() for L in (129, 260)]
    second = [base[:L] + tail() for L in (37, 64, 100, 128, 200, 260)] + [list(base)]
    return first, second


def _record(llm) -> list:
    """Keep every SchedulerOutput the runner launches (the runner itself still runs)."""
    runner = llm.llm_engine.model_runner
    seen, launch = [], runner.launch
    runner.launch = lambda so: (seen.append(so), launch(so))[1]
    return seen


def _generate(llm, prompts, params=GREEDY):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs], [o.num_cached_tokens for o in outs]


def test_greedy_output_identical_with_cache_on_and_off(make_llm):
    first, second = _prompts()
    results = {}
    for name, kwargs in {"off": {"enable_prefix_caching": False},
                         "internal": {"kda_checkpoint_mode": "internal"},
                         "split": {"kda_checkpoint_mode": "split"}}.items():
        llm = make_llm(**CACHE, **kwargs)
        a, _ = _generate(llm, first)
        b, cached = _generate(llm, second)
        results[name] = (a + b, cached, llm.llm_engine.get_stats())
    assert results["internal"][0] == results["off"][0]
    assert results["split"][0] == results["off"][0]
    assert results["off"][2].prefix_cache_hits == 0 and not any(results["off"][1])
    # Internal: 37 shares less than a checkpoint; the rest hit 64, 128, 192 or 256.
    assert results["internal"][1] == [0, 64, 64, 128, 192, 256, 256]
    # Split: the first wave's chunks only ended at 128 and 256 (the last checkpoint each).
    assert results["split"][1][0] == 0 and 256 in results["split"][1]
    for name in ("internal", "split"):
        assert results[name][2].prefix_cache_hits == sum(results[name][1]) > 0


def test_second_request_computes_only_the_suffix(make_llm):
    llm = make_llm(**CACHE)
    seen = _record(llm)
    rng = random.Random(1)
    prompt = [rng.randrange(3, 128) for _ in range(200)]
    (out_a,), _ = _generate(llm, [prompt])
    assert [e.num_tokens for e in seen[0].kda_checkpoint_exports] == [64, 128, 192, 200]

    seen.clear()
    suffix = [rng.randrange(3, 128) for _ in range(30)]
    _, (cached,) = _generate(llm, [prompt[:150] + suffix])
    assert cached == 128
    assert list(seen[0].num_scheduled_tokens.values()) == [150 + 30 - 128]

    # Next chat turn: prompt + answer + new tokens hits where the first request finished.
    seen.clear()
    turn = prompt + out_a + [5, 6, 7]
    _, (cached,) = _generate(llm, [turn])
    assert cached == 200 + len(out_a) - 1
    assert list(seen[0].num_scheduled_tokens.values()) == [len(turn) - cached]
    assert len(seen[0].block_copies) == 1                    # hit inside a block: copy-on-write
    stats = llm.llm_engine.get_stats()
    assert stats.prefix_cache_hits == 128 + cached
    assert stats.prefix_cache_queries == 200 + 180 + len(turn)


def _checkpoint_rows(llm, prompt, positions):
    kv = llm.llm_engine.scheduler.kv_cache_manager
    caches = llm.llm_engine.model_runner.caches
    probe = Request("probe", prompt, SamplingParams())
    rows = {}
    for pos in positions:
        key, _ = kv.checkpoint_key(probe, pos)
        ckpt = kv.checkpoint_pool.get(key)
        assert ckpt is not None, pos
        rows[pos] = ([r[ckpt.slot].clone() for r in caches.kda_recurrent],
                     [c[ckpt.slot].clone() for c in caches.kda_conv])
    return rows


def test_internal_checkpoints_equal_split_baseline(make_llm):
    """Chunks of 100 tokens: internal exports sit at offsets 64, 28, 92, 56 of their chunks
    (on and off the 64-token grid); the split baseline ends a chunk at every checkpoint."""
    rng = random.Random(2)
    prompt = [rng.randrange(3, 128) for _ in range(300)]
    params = SamplingParams(temperature=0.0, max_tokens=1)
    rows, steps = {}, {}
    for mode in ("internal", "split"):
        llm = make_llm(**CACHE, kda_checkpoint_mode=mode, max_num_batched_tokens=100,
                       kda_checkpoint_turn_end=False)
        seen = _record(llm)
        _generate(llm, [prompt], params)
        steps[mode] = [sum(so.num_scheduled_tokens.values()) for so in seen if not so.is_empty]
        rows[mode] = _checkpoint_rows(llm, prompt, [64, 128, 192, 256])
    assert steps["internal"] == [100, 100, 100]
    assert steps["split"] == [64, 64, 64, 64, 44]
    for pos in (64, 128, 192, 256):
        for a, b in zip(rows["internal"][pos][0] + rows["internal"][pos][1],
                        rows["split"][pos][0] + rows["split"][pos][1], strict=True):
            assert torch.allclose(a, b, rtol=0, atol=1e-5), (pos, (a - b).abs().max())


def test_n_samples_abort_and_preemption_with_shared_prefix(make_llm):
    rng = random.Random(3)
    base = [rng.randrange(3, 128) for _ in range(160)]
    ref_llm = make_llm(**CACHE, enable_prefix_caching=False)
    prompts = [base[:L] + [rng.randrange(3, 128) for _ in range(10)] for L in (70, 120, 150)]
    long = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    ref, _ = _generate(ref_llm, prompts, long)

    llm = make_llm(**CACHE, num_gpu_blocks=12, max_model_len=192)
    _generate(llm, [base])                                   # checkpoints at 64, 128, 160
    engine = llm.llm_engine
    # n = 3 (seeded sampling) on a hit; and a request that holds shared blocks is aborted.
    engine.add_request("n3", base[:140], SamplingParams(n=3, temperature=1.0, seed=1,
                                                        max_tokens=4))
    engine.add_request("ab", base[:150] + [9] * 20, GREEDY)
    engine.step()
    assert engine.scheduler.requests["ab"].num_cached_tokens == 128
    engine.abort_request("ab")
    while engine.has_unfinished_requests():
        engine.step()
    # Shared prefixes under block pressure: preemption, recompute from a hit, same tokens.
    out, cached = _generate(llm, prompts, long)
    assert out == ref and any(cached)
    assert engine.scheduler.get_stats().num_preemptions > 0


def test_prefix_caching_off_exports_nothing(make_llm):
    llm = make_llm(**CACHE, enable_prefix_caching=False)
    prompt = list(range(3, 103))
    _generate(llm, [prompt, prompt])
    stats = llm.llm_engine.scheduler.get_stats()
    assert stats.num_total_kda_checkpoint_slots == 0 and stats.num_kda_checkpoint_exports == 0
    assert llm.llm_engine.model_runner.num_ckpt_slots == 0


def test_cache_salt_isolates_prefix_hits(make_llm):
    llm = make_llm(**CACHE)
    engine = llm.llm_engine
    rng = random.Random(3)
    prompt = [rng.randrange(3, 128) for _ in range(150)]

    def run(rid, salt):
        engine.add_request(rid, prompt, GREEDY, cache_salt=salt)
        outs = {}
        while engine.has_unfinished_requests():
            outs.update({o.request_id: o for o in engine.step() if o.finished})
        return outs[rid]

    first = run("a", "tenant-1")
    assert first.num_cached_tokens == 0
    other = run("b", "tenant-2")                 # same tokens, other salt: no hit
    assert other.num_cached_tokens == 0
    same = run("c", "tenant-1")
    assert same.num_cached_tokens == 128
    assert first.outputs[0].token_ids == other.outputs[0].token_ids == same.outputs[0].token_ids
    assert engine.reset_prefix_cache() > 0
    assert run("d", "tenant-1").num_cached_tokens == 0
