"""Offline engine on a tiny model (CPU, fp32): batching, chunking and preemption never change
greedy output; parity with transformers' generate; seeds; n > 1; bad input."""

from __future__ import annotations

import random

import pytest
import torch

from kdaserve import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def prompts(n: int, seed: int = 0, lo: int = 3, hi: int = 90) -> list[dict]:
    rng = random.Random(seed)
    return [{"prompt_token_ids": [rng.randrange(3, 128) for _ in range(rng.randint(lo, hi))]}
            for _ in range(n)]


def token_ids(outputs):
    return [o.outputs[0].token_ids for o in outputs]


def test_batch_of_8_equals_alone(make_llm):
    llm = make_llm()
    ps = prompts(8)
    batched = token_ids(llm.generate(ps, GREEDY, use_tqdm=False))
    alone = [token_ids(llm.generate([p], GREEDY, use_tqdm=False))[0] for p in ps]
    assert batched == alone


def test_preemption_keeps_output(make_llm):
    ps = prompts(8, seed=1, lo=40, hi=80)
    ref = token_ids(make_llm().generate(ps, GREEDY, use_tqdm=False))
    small = make_llm(num_gpu_blocks=33, max_model_len=512)
    out = token_ids(small.generate(ps, GREEDY, use_tqdm=False))
    assert small.llm_engine.scheduler.get_stats().num_preemptions > 0
    assert out == ref


def test_every_prompt_chunked(make_llm):
    ps = prompts(6, seed=2, lo=20, hi=90)
    ref = token_ids(make_llm().generate(ps, GREEDY, use_tqdm=False))
    out = token_ids(make_llm(max_num_batched_tokens=13).generate(ps, GREEDY, use_tqdm=False))
    assert out == ref


def test_greedy_matches_hf_generate(make_llm, hf_model):
    ps = prompts(3, seed=3, lo=5, hi=70)
    sp = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    outs = make_llm().generate(ps, sp, use_tqdm=False)
    for p, o in zip(ps, outs):
        ids = p["prompt_token_ids"]
        with torch.no_grad():
            g = hf_model.generate(torch.tensor([ids]), max_new_tokens=32, do_sample=False,
                                  eos_token_id=None, pad_token_id=0)
        assert o.outputs[0].token_ids == g[0, len(ids):].tolist()


def test_seeded_sampling_reproducible_in_any_batch(make_llm):
    llm = make_llm()
    ps = prompts(5, seed=4)
    seeded = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=16,
                            ignore_eos=True)
    alone = token_ids(llm.generate([ps[0]], seeded, use_tqdm=False))[0]
    others = SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True)
    mixed = llm.generate(ps, [seeded] + [others] * 4, use_tqdm=False)
    assert mixed[0].outputs[0].token_ids == alone
    other_seed = SamplingParams(temperature=1.0, top_p=0.9, seed=99, max_tokens=16,
                                ignore_eos=True)
    assert token_ids(llm.generate([ps[0]], other_seed, use_tqdm=False))[0] != alone


def test_n3_shares_prompt_blocks(make_llm):
    llm = make_llm(block_size=16)
    engine = llm.llm_engine
    kv = engine.scheduler.kv_cache_manager
    prompt = list(range(3, 3 + 40))      # 40 tokens: fork after 39 -> 2 full blocks + 7 rows
    engine.add_request("r", prompt, SamplingParams(n=3, temperature=1.0, seed=7,
                                                   max_tokens=4, ignore_eos=True))
    engine.step()                        # prefill 39 tokens
    engine.step()                        # fork, then each child computes token 40 and samples
    children = [r for r in engine.scheduler.requests.values() if r.parent_req_id == "r"]
    assert len(children) == 3
    blocks = [kv.get_block_ids(c.req_id) for c in children]
    assert blocks[0][:2] == blocks[1][:2] == blocks[2][:2]          # full blocks shared
    assert len({b[2] for b in blocks}) == 3                          # partial block copied
    assert kv.num_gpu_blocks - kv.num_free_blocks == 2 + 3
    outs = []
    while engine.has_unfinished_requests():
        outs += [o for o in engine.step() if o.finished]
    (out,) = outs
    assert [len(c.token_ids) for c in out.outputs] == [4, 4, 4]
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1


@pytest.mark.parametrize("field,value", [
    ("temperature", -0.5), ("top_p", 0.0), ("top_p", 1.5), ("top_k", -2), ("max_tokens", 0),
    ("n", 0), ("logprobs", 1000)])
def test_bad_sampling_params_name_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_bad_input_does_not_disturb_requests_in_flight(make_llm):
    llm = make_llm()
    engine = llm.llm_engine
    ps = prompts(2, seed=5)
    ref = token_ids(llm.generate(ps, GREEDY, use_tqdm=False))
    engine.add_request("a", ps[0]["prompt_token_ids"], GREEDY)
    engine.step()
    with pytest.raises(ValueError, match=r"600.*512|512.*600"):
        engine.add_request("b", [5] * 600, GREEDY)
    with pytest.raises(ValueError, match="logprobs"):
        engine.add_request("c", [5, 6], SamplingParams(logprobs=21, max_logprobs=40))
    engine.add_request("d", ps[1]["prompt_token_ids"], GREEDY)
    done = {}
    while engine.has_unfinished_requests():
        done.update({o.request_id: o for o in engine.step() if o.finished})
    assert [done["a"].outputs[0].token_ids, done["d"].outputs[0].token_ids] == ref


def test_abort_at_any_point_frees_everything(make_llm):
    llm = make_llm(max_num_batched_tokens=16)
    engine = llm.llm_engine
    ps = prompts(4, seed=6, lo=30, hi=60)
    for step_at in range(0, 8):
        for i, p in enumerate(ps):
            engine.add_request(f"x{step_at}-{i}", p["prompt_token_ids"],
                               SamplingParams(n=1 + i % 2, max_tokens=20, ignore_eos=True))
        for _ in range(step_at):
            engine.step()
        engine.abort_request([f"x{step_at}-{i}" for i in range(len(ps))])
        engine.step()     # reports the finished ids to the worker
        assert not engine.has_unfinished_requests()


def test_stop_strings_and_logprobs(make_llm):
    llm = make_llm()
    p = prompts(1, seed=7)[0]
    full = llm.generate([p], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True,
                                            logprobs=3), use_tqdm=False)[0].outputs[0]
    assert len(full.logprobs) == len(full.token_ids)
    for tok, lp in zip(full.token_ids, full.logprobs):
        assert tok in lp and lp[tok].rank == 1      # greedy: the sampled token ranks first
        assert len(lp) <= 4
    text = full.text
    if len(text) >= 4:
        stop = text[2:4]
        out = llm.generate([p], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True,
                                               stop=[stop]), use_tqdm=False)[0].outputs[0]
        assert out.finish_reason == "stop" and out.stop_reason == stop
        assert out.text == text[:text.index(stop)]


def test_step_floor_ratio_gauge(make_llm):
    llm = make_llm()
    engine = llm.llm_engine
    assert engine.get_stats().step_floor_ratio is None
    llm.generate(prompts(2, seed=8), GREEDY, use_tqdm=False)
    ratio = engine.get_stats().step_floor_ratio
    floor = engine.step_floor
    assert ratio is not None and ratio > 0
    # the floor grows with batch and context: every term is accounted
    assert floor.seconds(4, 400) > floor.seconds(1, 100) > floor.seconds(1, 0) > 0
