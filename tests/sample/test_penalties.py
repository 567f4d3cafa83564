"""Presence / frequency / repetition penalties and logit_bias: the batched transform against a
per-row loop written from vLLM's definitions, validation, and the engine (plain and speculative)
honouring them."""

from __future__ import annotations

import pytest
import torch

from kdaserve import SamplingParams
from kdaserve.sample.penalties import LogitsProcessing
from tests.engine.conftest import hf_model, make_llm, tiny_model_dir  # noqa: F401


def reference(logits, params, prompts, outputs, rows):
    """One row at a time: bias, repetition over prompt + output, frequency, presence."""
    out = logits.clone()
    for p, prompt, output, r in zip(params, prompts, outputs, rows):
        row = out[r]
        for t, v in (p.logit_bias or {}).items():
            row[t] += v
        for t in set(prompt) | set(output):
            if p.repetition_penalty != 1.0:
                row[t] = row[t] / p.repetition_penalty if row[t] > 0 else \
                    row[t] * p.repetition_penalty
        for t in set(output):
            row[t] -= p.frequency_penalty * output.count(t) + p.presence_penalty
    return out


def test_batched_transform_matches_the_row_loop():
    g = torch.Generator().manual_seed(0)
    V = 40
    logits = torch.randn(5, V, generator=g) * 3
    params = [SamplingParams(presence_penalty=0.7, frequency_penalty=0.3),
              SamplingParams(),                                        # untouched row
              SamplingParams(repetition_penalty=1.8, logit_bias={3: 5.0, 39: -100.0}),
              SamplingParams(repetition_penalty=0.6, presence_penalty=-1.0,
                             frequency_penalty=2.0, logit_bias={0: 1.5})]
    prompts = [[1, 2, 3], [4, 5], [3, 7, 7, 9], [10, 11]]
    outputs = [[2, 2, 8, 8, 8], [5, 6], [9, 12, 12], []]
    rows = [0, 1, 3, 4]
    proc = LogitsProcessing.build(rows, params, prompts, outputs, V, "cpu")
    got = proc.apply(logits)
    want = reference(logits, params, prompts, outputs, rows)
    assert torch.allclose(got, want, atol=1e-6)
    assert torch.equal(got[1], logits[1]) and torch.equal(got[2], logits[2])
    assert not torch.equal(got[0], logits[0]) and not torch.equal(got[4], logits[4])
    assert LogitsProcessing.build([0], [SamplingParams()], [[1]], [[2]], V, "cpu") is None
    with pytest.raises(ValueError, match="outside the vocabulary"):
        LogitsProcessing.build([0], [SamplingParams(logit_bias={V: 1.0})], [[1]], [[]], V, "cpu")


def test_cached_rows_grow_with_the_output_and_match_a_full_build():
    """The worker's PenaltyCache copies only each step's new output tokens; the result equals a
    LogitsProcessing built from the whole prompt and output, step after step."""
    import types

    from kdaserve.sample.penalties import PenaltyCache, logits_processing

    g = torch.Generator().manual_seed(1)
    V = 30
    params = [SamplingParams(repetition_penalty=1.5, frequency_penalty=0.4),
              SamplingParams(), SamplingParams(presence_penalty=0.9, logit_bias={4: 2.0})]
    states = [types.SimpleNamespace(req_id=f"r{i}", sampling_params=p, token_ids=[1, 2, 2 + i],
                                    num_prompt_tokens=3) for i, p in enumerate(params)]
    cache = PenaltyCache(V, "cpu")
    for step in range(4):
        logits = torch.randn(3, V, generator=g)
        proc = logits_processing(range(3), states, cache)
        keep = [0, 2]
        full = LogitsProcessing.build(keep, [params[i] for i in keep],
                                      [states[i].token_ids[:3] for i in keep],
                                      [states[i].token_ids[3:] for i in keep], V, "cpu")
        assert torch.equal(proc.apply(logits), full.apply(logits)), step
        for s in states:                                   # the step's sampled tokens
            s.token_ids += [int(t) for t in torch.randint(0, V, (1 + step % 2,), generator=g)]
    assert cache._counts["r0"][1] == len(states[0].token_ids) - 3 - 2   # last step not read
    cache.free("r0")
    assert "r0" not in cache._counts and "r0" not in cache._prompt
    with pytest.raises(ValueError, match="outside the vocabulary"):
        logits_processing([0], [types.SimpleNamespace(
            req_id="x", sampling_params=SamplingParams(logit_bias={V: 1.0}), token_ids=[1],
            num_prompt_tokens=1)], cache)


@pytest.mark.parametrize("kwargs,field", [
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"frequency_penalty": -2.1}, "frequency_penalty"),
    ({"repetition_penalty": 0.0}, "repetition_penalty"),
    ({"logit_bias": {-1: 1.0}}, "logit_bias"),
    ({"logit_bias": {5: 100.5}}, "logit_bias"),
])
def test_bad_values_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


PROMPTS = [[5, 6, 7, 8] * 3, [40, 41, 42, 43, 44], [9, 9, 9, 10]]


def _generate(llm, params):
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def test_engine_logit_bias_and_penalties(make_llm):
    llm = make_llm()
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    plain = _generate(llm, [greedy] * 3)
    # +100 on one token: every step picks it, greedy or sampled
    forced = SamplingParams(temperature=1.0, seed=3, max_tokens=12, ignore_eos=True,
                            logit_bias={77: 100.0})
    got = _generate(llm, [greedy, forced, greedy])
    assert got[1] == [77] * 12
    assert got[0] == plain[0] and got[2] == plain[2]      # the other rows are untouched
    # a strong frequency/presence penalty: no token repeats within 12 greedy steps, and the
    # output differs from the plain one (the tiny model repeats itself when greedy)
    spread = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True,
                            frequency_penalty=2.0, presence_penalty=2.0,
                            repetition_penalty=1.5)
    got = _generate(llm, [spread] * 3)
    assert any(len(set(p)) < len(p) for p in plain)
    for toks in got:
        assert len(set(toks)) == len(toks), toks
    # ban the plain first token: the first token changes
    ban = [SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True,
                          logit_bias={plain[i][0]: -100.0}) for i in range(3)]
    got = _generate(llm, ban)
    assert all(got[i][0] != plain[i][0] for i in range(3))
    with pytest.raises(ValueError, match="logit_bias token id"):
        llm.llm_engine.add_request("bad", [1, 2], SamplingParams(logit_bias={10**6: 1.0}))


def test_speculative_engine_does_not_draft_penalised_requests(make_llm):
    """With ngram speculation on, a penalised request runs undrafted next to drafted ones and
    gives the same tokens as without speculation."""
    params = [SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True,
                             frequency_penalty=1.0, logit_bias={7: 2.0}),
              SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)]
    plain = _generate(make_llm(), params)
    llm = make_llm(speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    got = _generate(llm, params)
    assert got == plain
    assert llm.llm_engine.spec_decoding_stats.num_draft_tokens > 0
