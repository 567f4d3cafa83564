"""Async scheduling (tiny model, CPU, fp32): step N+1 is scheduled and launched before step N's
sampled ids are collected, its decode inputs copied from N's sampled tensor on the device. The
outputs must equal one-step-at-a-time scheduling in every respect (tokens, logprobs, finish
reasons), through preemption with a token in flight, chunked prefill, n > 1, min_tokens,
max_tokens, stop strings and seeds; no step may compute a token past max_tokens; and every pool
ends free (make_llm checks)."""

from __future__ import annotations

import pytest

from kdaserve import SamplingParams
from tests.engine.test_llm_engine import prompts


def _params() -> list[SamplingParams]:
    return [
        SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
        SamplingParams(temperature=1.0, top_p=0.9, seed=7, max_tokens=10, ignore_eos=True,
                       logprobs=2),
        SamplingParams(temperature=0.0, max_tokens=9, min_tokens=5, ignore_eos=False),
        SamplingParams(temperature=0.8, top_k=20, seed=3, max_tokens=1, ignore_eos=True),
        SamplingParams(temperature=1.0, seed=11, n=2, max_tokens=7, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=14, ignore_eos=True, logprobs=1),
        SamplingParams(temperature=0.7, min_p=0.05, seed=5, max_tokens=11, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True),
    ]


def _summary(outputs) -> list:
    return [[(c.token_ids, c.finish_reason, c.stop_reason, c.text,
              [{t: round(lp.logprob, 5) for t, lp in d.items()} for d in c.logprobs or []])
             for c in o.outputs] for o in outputs]


def _record_runner(llm) -> list[str]:
    """'L' for each launch and 'C' for each collect of a step that sampled on the device."""
    runner, calls = llm.llm_engine.model_runner, []
    launch, collect = runner.launch, runner.collect

    def rec_launch(so):
        step = launch(so)
        if step.output is None:
            calls.append("L")
        return step

    def rec_collect(step):
        if step.output is None:
            calls.append("C")
        return collect(step)
    runner.launch, runner.collect = rec_launch, rec_collect
    return calls


@pytest.mark.parametrize("pool", [{}, {"max_num_batched_tokens": 24}])
def test_async_equals_sync(make_llm, pool):
    ps = prompts(8, seed=11, lo=20, hi=80)
    sync = make_llm(async_scheduling=False, **pool)
    ref = _summary(sync.generate(ps, _params(), use_tqdm=False))
    llm = make_llm(**pool)
    calls = _record_runner(llm)
    assert _summary(llm.generate(ps, _params(), use_tqdm=False)) == ref
    assert "LL" in "".join(calls), "no step was launched while another was in flight"


def test_preempted_with_a_token_in_flight(make_llm):
    """Three decoding requests outgrow a 16-block pool: the newest is preempted while its
    sampled token is in flight; the token is kept and its recompute includes it."""
    ps = prompts(3, seed=14, lo=60, hi=60)
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=40, ignore_eos=True)
              for i in range(3)]
    small = {"num_gpu_blocks": 16, "max_model_len": 256, "block_size": 16}
    ref = _summary(make_llm(async_scheduling=False, **small).generate(ps, params,
                                                                     use_tqdm=False))
    llm = make_llm(**small)
    sched = llm.llm_engine.scheduler
    in_flight = []
    preempt = sched._preempt
    sched._preempt = lambda r: (in_flight.append(r.num_output_placeholders), preempt(r))[1]
    assert _summary(llm.generate(ps, params, use_tqdm=False)) == ref
    assert any(in_flight), f"no request was preempted with a token in flight: {in_flight}"


def test_stop_strings_with_async(make_llm):
    llm = make_llm()
    p = prompts(1, seed=7)[0]
    text = llm.generate([p], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True),
                        use_tqdm=False)[0].outputs[0].text
    assert len(text) >= 4
    stop = text[2:4]
    out = llm.generate([p], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True,
                                           stop=[stop]), use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and out.text == text[:text.index(stop)]


def test_no_token_computed_past_max_tokens(make_llm):
    llm = make_llm()
    scheduled = []
    launch = llm.llm_engine.model_runner.launch
    llm.llm_engine.model_runner.launch = lambda so: (
        scheduled.append(so.total_num_scheduled_tokens), launch(so))[1]
    ps = prompts(3, seed=12, lo=10, hi=30)
    outs = llm.generate(ps, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True),
                        use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 8 for o in outs)
    # Each request computes its prompt and then 7 decode inputs: the 8th token is never fed.
    assert sum(scheduled) == sum(len(p["prompt_token_ids"]) + 7 for p in ps)


def test_penalties_run_one_step_at_a_time(make_llm):
    llm = make_llm()
    calls = _record_runner(llm)
    ps = prompts(2, seed=13)
    plain = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    pen = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True,
                         repetition_penalty=1.3)
    sync = make_llm(async_scheduling=False)
    ref = _summary(sync.generate(ps, [plain, pen], use_tqdm=False))
    assert _summary(llm.generate(ps, [plain, pen], use_tqdm=False)) == ref
    # While the penalised request runs, every collect precedes the next launch.
    assert "LL" not in "".join(calls[:-2])
