"""The scheduling rule: chunking, budgets, max_num_seqs, FCFS, preemption, abort."""

from __future__ import annotations

import pytest

from kdaserve.config import CacheConfig, SchedulerConfig
from kdaserve.core.scheduler import Scheduler
from kdaserve.request import RequestStatus
from sched_driver import make_request, reference_tokens, run_until_done, step


def test_chunked_prefill_then_decode(make_scheduler):
    sched, runner = make_scheduler(max_num_batched_tokens=32, max_model_len=128)
    req = make_request("a", 100, max_tokens=3)
    sched.add_request(req)
    chunks = []
    while sched.has_unfinished_requests():
        so, _ = step(sched, runner)
        chunks.append(so.num_scheduled_tokens["a"])
    assert chunks == [32, 32, 32, 4, 1, 1]
    assert req.output_token_ids == reference_tokens(req.prompt_token_ids, 3)
    assert req.finish_reason == "length"


def test_long_prefill_threshold_and_budget_split(make_scheduler):
    sched, runner = make_scheduler(max_num_batched_tokens=20, long_prefill_token_threshold=8)
    for rid in "abc":
        sched.add_request(make_request(rid, 30, max_tokens=1))
    so, _ = step(sched, runner)
    assert so.num_scheduled_tokens == {"a": 8, "b": 8, "c": 4}
    assert so.total_num_scheduled_tokens == 20
    run_until_done(sched, runner)


def test_running_first_then_waiting_fcfs(make_scheduler):
    sched, runner = make_scheduler(max_num_batched_tokens=16)
    sched.add_request(make_request("a", 10, max_tokens=5))
    step(sched, runner)  # a: whole prompt, samples its first token
    sched.add_request(make_request("b", 30, max_tokens=1))
    sched.add_request(make_request("c", 3, max_tokens=1))
    so, _ = step(sched, runner)
    # a's decode first, then b takes the rest; c (FCFS, behind b) waits.
    assert so.num_scheduled_tokens == {"a": 1, "b": 15}
    assert [r.req_id for r in so.scheduled_new_reqs] == ["b"]
    assert so.scheduled_cached_reqs.req_ids == ["a"]
    assert [r.req_id for r in sched.waiting] == ["c"]
    run_until_done(sched, runner)


def test_max_num_seqs_and_state_slots_cap_running(make_scheduler):
    sched, runner = make_scheduler(max_num_seqs=2, num_state_slots=16)
    for i in range(5):
        sched.add_request(make_request(f"r{i}", 5, max_tokens=3))
    admitted = []
    while sched.has_unfinished_requests():
        so, _ = step(sched, runner)
        assert len(sched.running) <= 2
        admitted += [r.req_id for r in so.scheduled_new_reqs]
    assert admitted == [f"r{i}" for i in range(5)]  # FCFS admission

    sched2, runner2 = make_scheduler(max_num_seqs=8, num_state_slots=2)
    for i in range(4):
        sched2.add_request(make_request(f"s{i}", 5, max_tokens=3))
    while sched2.has_unfinished_requests():
        step(sched2, runner2)
        assert len(sched2.running) <= 2
        assert sched2.kv_cache_manager.num_free_slots == 2 - len(sched2.running)


def test_head_of_line_waits_for_blocks(make_scheduler):
    # 8 blocks of 4 tokens. "big" needs 7, "a" holds 2: big cannot be admitted, and the small
    # request behind it must not jump the queue.
    sched, runner = make_scheduler(num_gpu_blocks=8, max_model_len=32,
                                   max_num_batched_tokens=64)
    sched.add_request(make_request("a", 5, max_tokens=4))
    step(sched, runner)
    sched.add_request(make_request("big", 26, max_tokens=1))
    sched.add_request(make_request("small", 2, max_tokens=1))
    so, _ = step(sched, runner)
    assert set(so.num_scheduled_tokens) == {"a"}
    assert [r.req_id for r in sched.waiting] == ["big", "small"]
    run_until_done(sched, runner)


def test_no_chunking_when_disabled(make_scheduler):
    sched, runner = make_scheduler(max_num_batched_tokens=40, max_model_len=40,
                                   num_gpu_blocks=32, enable_chunked_prefill=False)
    sched.add_request(make_request("a", 30, max_tokens=2))
    sched.add_request(make_request("b", 36, max_tokens=1))
    so, _ = step(sched, runner)
    assert so.num_scheduled_tokens == {"a": 30}  # b would only fit as a chunk
    so, _ = step(sched, runner)
    assert so.num_scheduled_tokens == {"a": 1, "b": 36}
    run_until_done(sched, runner)


def test_many_requests_under_memory_pressure_match_reference(make_scheduler):
    sched, runner = make_scheduler(num_gpu_blocks=24, max_num_seqs=6,
                                   max_num_batched_tokens=24, max_model_len=64)
    reqs = [make_request(f"r{i}", 3 + (11 * i) % 25, max_tokens=6 + i % 9, start=i)
            for i in range(14)]
    for r in reqs:
        sched.add_request(r)
    result = run_until_done(sched, runner)
    assert sched.num_preemptions > 0  # the pool is small enough to force recompute
    for r in reqs:
        assert result.tokens[r.req_id] == reference_tokens(r.prompt_token_ids,
                                                           r.max_tokens), r.req_id
        assert result.finish[r.req_id] == "length"


def test_preemption_newest_victim_front_requeue_no_admission(make_scheduler):
    # 6 blocks of 4 tokens. a and b use 3 blocks each; when a needs a 4th, b (newest) goes.
    sched, runner = make_scheduler(num_gpu_blocks=6, max_model_len=24, num_state_slots=4)
    a = make_request("a", 11, max_tokens=6)
    b = make_request("b", 12, max_tokens=6, start=3)
    sched.add_request(a)
    sched.add_request(b)
    step(sched, runner)  # a: 11 + 1 sampled; b: 12 + 1 sampled
    sched.add_request(make_request("c", 1, max_tokens=1))
    assert sched.kv_cache_manager.num_free_blocks == 0
    b_slot = b.state_slot
    so, _ = step(sched, runner)
    assert so.preempted_req_ids == {"b"}
    assert set(so.num_scheduled_tokens) == {"a"}  # c was not admitted though b's space is free
    assert [r.req_id for r in sched.waiting] == ["b", "c"]
    assert b.status == RequestStatus.PREEMPTED and b.num_computed_tokens == 0
    assert b.num_preemptions == 1 and b.state_slot is None
    assert sched.kv_cache_manager.get_block_ids("b") == []
    assert sched.kv_cache_manager.state_pool.is_free(b_slot)
    assert sched.get_stats().num_preemptions == 1
    result = run_until_done(sched, runner)
    assert b.output_token_ids == reference_tokens(b.prompt_token_ids, 6)
    assert a.output_token_ids == reference_tokens(a.prompt_token_ids, 6)
    # Resumed b arrived as a new request carrying its first output token.
    resumed = [n for so in runner.steps for n in so.scheduled_new_reqs if n.req_id == "b"]
    assert len(resumed) == 2 and len(resumed[1].output_token_ids) >= 1
    assert resumed[1].sample_seed_offset == len(resumed[1].output_token_ids)
    assert result.finish["c"] == "length"


def test_request_preempts_itself_when_it_is_newest(make_scheduler):
    sched, runner = make_scheduler(num_gpu_blocks=6, max_model_len=24, num_state_slots=4)
    a = make_request("a", 10, max_tokens=8)
    b = make_request("b", 12, max_tokens=8, start=5)
    sched.add_request(a)
    sched.add_request(b)
    step(sched, runner)  # a: 10 tokens in 3 blocks (room left); b: 12 tokens, 3 full blocks
    so, _ = step(sched, runner)  # b needs a 4th block, nothing newer to evict: b goes
    assert so.preempted_req_ids == {"b"} and set(so.num_scheduled_tokens) == {"a"}
    assert [r.req_id for r in sched.waiting] == ["b"]
    run_until_done(sched, runner)
    assert a.output_token_ids == reference_tokens(a.prompt_token_ids, 8)
    assert b.output_token_ids == reference_tokens(b.prompt_token_ids, 8)


def test_no_admission_in_a_preemption_step(make_scheduler):
    sched, runner = make_scheduler(num_gpu_blocks=6, max_model_len=24, max_num_batched_tokens=8)
    a = make_request("a", 12, max_tokens=10)
    b = make_request("b", 12, max_tokens=10, start=3)
    sched.add_request(a)
    sched.add_request(b)
    for _ in range(10):
        so, _ = step(sched, runner)
        if so.preempted_req_ids:
            break
    assert so.preempted_req_ids == {"b"} and so.scheduled_new_reqs == []
    # b (chunked to the 7 tokens left) would fit now: only the rule kept it out.
    assert sched.kv_cache_manager.num_free_blocks >= 2 and so.total_num_scheduled_tokens == 1
    so, _ = step(sched, runner)
    assert [n.req_id for n in so.scheduled_new_reqs] == ["b"]
    run_until_done(sched, runner)
    assert b.output_token_ids == reference_tokens(b.prompt_token_ids, 10)


def _holdings(sched):
    kv = sched.kv_cache_manager
    return kv.num_free_blocks, kv.num_free_slots


@pytest.mark.parametrize("stage", ["waiting", "mid_prefill", "decode", "preempted",
                                   "between_schedule_and_update"])
def test_abort_frees_everything_at_every_stage(make_scheduler, stage):
    sched, runner = make_scheduler(num_gpu_blocks=6, max_model_len=24,
                                   max_num_batched_tokens=8)
    victim = make_request("v", 11, max_tokens=10, start=4)
    keeper = make_request("k", 10, max_tokens=10)
    if stage == "preempted":
        sched.add_request(keeper)
        sched.add_request(victim)
        while victim.status != RequestStatus.PREEMPTED:
            step(sched, runner)
    elif stage == "waiting":
        sched.add_request(victim)
    else:
        sched.add_request(victim)
        step(sched, runner)  # 8 of 11 prompt tokens
        if stage == "decode":
            step(sched, runner)
            assert victim.num_output_tokens == 1
        else:
            assert victim.num_computed_tokens == 8 and not victim.output_token_ids
    if stage == "between_schedule_and_update":
        so = sched.schedule()
        ro = runner.execute(so)
        sched.finish_requests("v", RequestStatus.FINISHED_ABORTED)
        assert sched.update_from_output(so, ro) == []
    else:
        sched.finish_requests(["v"], RequestStatus.FINISHED_ABORTED)
    assert victim.status == RequestStatus.FINISHED_ABORTED and victim.finish_reason == "abort"
    assert not sched.kv_cache_manager.holds_resources("v") and victim.state_slot is None
    assert "v" not in sched.requests and victim not in sched.waiting
    if stage != "preempted":
        assert _holdings(sched) == (6, 16)
    so, _ = step(sched, runner)
    assert "v" in so.finished_req_ids and "v" not in so.num_scheduled_tokens
    sched.finish_requests("v", RequestStatus.FINISHED_ABORTED)  # twice: ignored
    run_until_done(sched, runner)


def test_stop_string_finish_from_outside(make_scheduler):
    sched, runner = make_scheduler()
    req = make_request("a", 5, max_tokens=10)
    sched.add_request(req)
    step(sched, runner)
    step(sched, runner)
    sched.finish_requests("a", RequestStatus.FINISHED_STOPPED)
    assert req.finish_reason == "stop" and not sched.has_unfinished_requests()
    assert sched.has_finished_requests()
    so = sched.schedule()
    assert so.finished_req_ids == {"a"} and so.is_empty and not sched.has_finished_requests()
    with pytest.raises(ValueError, match="FINISHED_"):
        sched.finish_requests("a", RequestStatus.RUNNING)


def test_add_request_errors(make_scheduler):
    sched, _ = make_scheduler(max_model_len=32, max_num_seqs=4)
    sched.add_request(make_request("a", 5))
    with pytest.raises(ValueError, match="'a' is already in use"):
        sched.add_request(make_request("a", 5))
    with pytest.raises(ValueError, match="exceeds max_model_len=32"):
        sched.add_request(make_request("long", 33))
    with pytest.raises(ValueError, match="n=5 exceeds max_num_seqs=4"):
        sched.add_request(make_request("many", 5, n=5))
    with pytest.raises(ValueError, match="prompt_token_ids must not be empty"):
        make_request("empty", 0)
    sched.finish_requests("a", RequestStatus.FINISHED_ABORTED)


def test_config_errors():
    with pytest.raises(ValueError, match="cannot hold one sequence of max_model_len=100"):
        Scheduler(SchedulerConfig(max_model_len=100), CacheConfig(block_size=16),
                  num_gpu_blocks=6, num_state_slots=4)
    with pytest.raises(ValueError, match="without chunked prefill"):
        Scheduler(SchedulerConfig(max_model_len=100, max_num_batched_tokens=64,
                                  enable_chunked_prefill=False),
                  CacheConfig(block_size=16), num_gpu_blocks=16, num_state_slots=4)


def test_stats(make_scheduler):
    sched, runner = make_scheduler(num_gpu_blocks=20, num_state_slots=5, max_model_len=32)
    sched.add_request(make_request("a", 9, max_tokens=3))
    sched.add_request(make_request("b", 9, max_tokens=3))
    s = sched.get_stats()
    assert (s.num_running_reqs, s.num_waiting_reqs, s.num_free_blocks) == (0, 2, 20)
    step(sched, runner)
    s = sched.get_stats()
    assert (s.num_running_reqs, s.num_waiting_reqs) == (2, 0)
    assert s.num_free_blocks == 20 - 6 and s.num_free_state_slots == 3
    assert s.kv_cache_usage == pytest.approx(6 / 20)
    assert sched.get_num_unfinished_requests() == 2
    run_until_done(sched, runner)
