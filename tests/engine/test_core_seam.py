"""The seam between the engine core (token level) and the front's OutputProcessor (text, stop
strings), on the tiny model (CPU, fp32): the core's outputs carry no text; a stop string matched
in the front finishes the request in the core at once and frees its blocks and slot; tokens the
core produced after the stop (its abort arriving late, as in the server) never reach the output
or the token counter."""

from __future__ import annotations

from dataclasses import fields

import pytest

from kdaserve import SamplingParams
from kdaserve.core.engine_output import EngineCoreOutput
from kdaserve.engine.core_client import CoreOutput, core_sampling_params
from kdaserve.request import RequestStatus
from tests.engine.test_llm_engine import prompts

PARAMS = dict(temperature=0.0, max_tokens=16, ignore_eos=True)


def _stop_string(llm, prompt) -> str:
    text = llm.generate([prompt], SamplingParams(**PARAMS), use_tqdm=False)[0].outputs[0].text
    assert len(text) >= 4
    return text[2:4]


def _run(engine, rid: str) -> object:
    done = None
    while engine.has_unfinished_requests():
        done = next((o for o in engine.step() if o.request_id == rid and o.finished), done)
    return done


def test_core_step_outputs_carry_no_text(make_llm):
    llm = make_llm()
    engine = llm.llm_engine
    core, seen = engine.engine_core, []
    step = core.step
    core.step = lambda: (lambda outs: (seen.extend(outs), outs)[1])(step())
    ps = prompts(2, seed=7)
    params = SamplingParams(**PARAMS, logprobs=1, stop=[_stop_string(llm, ps[0])])
    seen.clear()
    outs = llm.generate(ps, params, use_tqdm=False)
    assert seen and all(type(o) is EngineCoreOutput for o in seen)
    for o in seen:
        assert all(isinstance(t, int) for t in o.new_token_ids)
        assert not isinstance(o.stop_reason, str), "a stop string reached the core"
        assert len(o.new_logprobs) == len(o.new_token_ids)
    names = {f.name for f in fields(EngineCoreOutput)}
    assert not names & {"text", "output_text", "delta", "stop"}
    # the wire form has the same fields; the core process is sent no stop strings
    assert set(CoreOutput.__struct_fields__) == names
    assert not {"stop", "include_stop_str_in_output",
                "skip_special_tokens"} & set(core_sampling_params(params))
    # in process the abort comes before the next schedule: the core made no extra token
    for out in outs:
        comp = out.outputs[0]
        assert comp.token_ids == sum((o.new_token_ids for o in seen
                                      if o.req_id == out.request_id), [])


def test_stop_string_aborts_the_core_request_and_frees_it(make_llm):
    llm = make_llm()
    engine = llm.llm_engine
    core, kv = engine.engine_core, engine.scheduler.kv_cache_manager
    p = prompts(1, seed=7)[0]
    stop = _stop_string(llm, p)
    free = (kv.num_free_blocks, kv.num_free_slots)
    aborts, abort = [], core.abort_requests
    core.abort_requests = lambda ids, stopped=False: (aborts.append((list(ids), stopped)),
                                                      abort(ids, stopped=stopped))
    engine.add_request("s", p["prompt_token_ids"], SamplingParams(**PARAMS, stop=[stop]))
    request = engine.scheduler.requests["s"]
    out = None
    while out is None:
        out = next((o for o in engine.step() if o.finished), None)
    comp = out.outputs[0]
    assert comp.finish_reason == "stop" and comp.stop_reason == stop
    assert len(comp.token_ids) < PARAMS["max_tokens"]
    # finished in the core by the front's abort, as stopped, with everything freed at once
    assert aborts == [(["s"], True)]
    assert request.status == RequestStatus.FINISHED_STOPPED
    assert "s" not in engine.scheduler.requests
    assert (kv.num_free_blocks, kv.num_free_slots) == free
    _run(engine, "s")
    assert (kv.num_free_blocks, kv.num_free_slots) == free


@pytest.mark.parametrize("sampling", [
    {}, {"n": 2, "temperature": 1.0, "seed": 7}], ids=["greedy", "n2"])
def test_tokens_after_the_stop_are_dropped(make_llm, sampling):
    """n = 2: the stop string ends sample 0 only, so the request runs on and sample 0's late
    token reaches the front (it is dropped per sample, not only with its request)."""
    llm = make_llm()
    engine = llm.llm_engine
    assert engine.engine_config.scheduler_config.async_scheduling
    p = prompts(1, seed=7)[0]
    plain = SamplingParams(**{**PARAMS, **sampling})
    texts = [c.text for c in llm.generate([p], plain, use_tqdm=False)[0].outputs]
    stop = next(texts[0][i:i + 2] for i in range(2, len(texts[0]) - 1)
                if all(texts[0][i:i + 2] not in t for t in texts[1:]))
    params = SamplingParams(**{**PARAMS, **sampling}, stop=[stop])
    ref = llm.generate([p], params, use_tqdm=False)[0].outputs
    assert [c.finish_reason for c in ref] == ["stop"] + ["length"] * (len(ref) - 1)
    # The core learns of the stop one step late (the server's abort still in transit).
    core, late, emitted = engine.engine_core, [], []
    abort, step = core.abort_requests, core.step
    core.abort_requests = lambda ids, stopped=False: (late.append(list(ids)) if stopped
                                                      else abort(ids))

    def late_step():
        outs = step()
        emitted.extend(o for o in outs if (o.parent_req_id or o.req_id) == "s"
                       and o.sample_index == 0)
        while late:
            abort(late.pop(), stopped=True)
        return outs
    core.step = late_step
    before = engine.get_stats().num_generation_tokens
    engine.add_request("s", p["prompt_token_ids"], params)
    outs = _run(engine, "s").outputs
    assert sum(len(o.new_token_ids) for o in emitted) > len(outs[0].token_ids), \
        "the core produced nothing after the stop"
    summary = [(c.token_ids, c.text, c.finish_reason, c.stop_reason) for c in outs]
    assert summary == [(c.token_ids, c.text, c.finish_reason, c.stop_reason) for c in ref]
    assert engine.get_stats().num_generation_tokens - before == sum(len(c.token_ids)
                                                                  for c in ref)
