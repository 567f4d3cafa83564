"""The scheduler under async scheduling with device drafts (`async_spec`): a request that
samples gets K placeholder drafts at once, the step in flight counts at its worst case (1 +
its drafts), num_computed_tokens runs ahead by the drafts it rejects and is rolled back when
its output arrives; drafts are capped so that max_tokens is never passed; a request passed
over keeps its placeholders; an abort with steps in flight frees everything."""

from __future__ import annotations

from kdaserve.core.sched_output import DRAFT_PLACEHOLDER as PH
from kdaserve.core.sched_output import ModelRunnerOutput
from kdaserve.request import RequestStatus
from sched_driver import make_request

K = 3


def _out(tokens: list[int]) -> ModelRunnerOutput:
    return ModelRunnerOutput(["a"], [tokens], [None])


def _make(make_scheduler, max_tokens):
    sched, _ = make_scheduler(spec_tokens=K, spec_method="draft_model")
    sched.async_spec = True
    r = make_request("a", 6, max_tokens=max_tokens)
    sched.add_request(r)
    return sched, r


def test_placeholders_worst_case_and_rollback(make_scheduler):
    sched, r = _make(make_scheduler, 20)
    so1 = sched.schedule()                                  # the prompt; samples t1
    assert so1.num_scheduled_tokens == {"a": 6} and "a" in so1.sampling_req_ids
    assert r.spec_token_ids == [PH] * K and r.num_output_placeholders == 1
    so2 = sched.schedule()                                  # step 1 in flight
    assert so2.num_scheduled_tokens == {"a": 1 + K}
    assert so2.scheduled_spec_decode_tokens == {"a": [PH] * K}
    assert r.num_computed_tokens == 6 + 1 + K and r.num_output_placeholders == 2 + K
    sched.update_from_output(so1, _out([11]))
    assert r.output_token_ids == [11] and r.num_output_placeholders == 1 + K
    so3 = sched.schedule()                                  # step 2 in flight: all accepted?
    assert so3.num_scheduled_tokens == {"a": 1 + K}
    assert r.num_computed_tokens == 6 + 2 * (1 + K)
    sched.update_from_output(so2, _out([12, 13]))           # 1 of K drafts accepted
    # step 3's window really starts at position 8 (t13): K - 1 = 2 positions early
    assert r.num_tokens == 9 and r.num_computed_tokens == 8 + 1 + K
    assert r.num_output_placeholders == 1 + K
    sched.update_from_output(so3, _out([14, 15, 16, 17]))   # all accepted
    assert r.num_computed_tokens == r.num_tokens - 1 and r.num_output_placeholders == 0
    # processed before the next schedule: real drafts replace the placeholders
    sched.update_draft_token_ids({"a": [1, 2, 3]})
    so4 = sched.schedule()
    assert so4.scheduled_spec_decode_tokens == {"a": [1, 2, 3]}
    sched.finish_requests("a", RequestStatus.FINISHED_ABORTED)


def test_drafts_capped_by_max_tokens_in_flight(make_scheduler):
    sched, r = _make(make_scheduler, 4)
    so1 = sched.schedule()
    so2 = sched.schedule()      # at most 4 outputs: 1 in flight, so a window of 3 (2 drafts)
    assert so2.num_scheduled_tokens == {"a": 3} and so2.scheduled_spec_decode_tokens == {
        "a": [PH] * 2}
    assert not sched.schedule().num_scheduled_tokens       # 1 + 3 on their way: nothing more
    sched.update_from_output(so1, _out([11]))
    assert not sched.schedule().num_scheduled_tokens
    sched.update_from_output(so2, _out([12]))               # no draft accepted
    assert r.num_output_placeholders == 0 and r.spec_token_ids == [PH] * K   # passed over
    so5 = sched.schedule()      # 2 outputs left: [t12] + 1 draft (the kept placeholders)
    assert so5.num_scheduled_tokens == {"a": 2}
    assert so5.scheduled_spec_decode_tokens == {"a": [PH]}
    assert r.num_computed_tokens == 7 + 2
    outs = sched.update_from_output(so5, _out([13, 14]))
    assert outs[0].finish_reason == "length" and r.output_token_ids == [11, 12, 13, 14]


def test_abort_with_steps_in_flight(make_scheduler):
    sched, r = _make(make_scheduler, 20)
    so1 = sched.schedule()
    so2 = sched.schedule()
    sched.finish_requests("a", RequestStatus.FINISHED_ABORTED)   # both steps in flight
    assert sched.kv_cache_manager.num_free_blocks == sched.kv_cache_manager.num_gpu_blocks
    assert sched.update_from_output(so1, _out([11])) == []
    assert sched.update_from_output(so2, _out([12, 13])) == []
    so3 = sched.schedule()
    assert "a" in so3.finished_req_ids and not so3.num_scheduled_tokens
