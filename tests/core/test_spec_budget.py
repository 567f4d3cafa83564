"""Adaptive draft budget (vLLM #51725) vs the static rule, and spec-token scheduling/rollback."""

from __future__ import annotations

import pytest

from kdaserve.config import CacheConfig, SchedulerConfig, SpeculativeConfig
from kdaserve.core.scheduler import Scheduler
from kdaserve.request import RequestStatus
from sched_driver import make_request, reference_tokens, run_until_done, step


def _big_scheduler(make_scheduler, k, adaptive=True):
    return make_scheduler(block_size=16, num_gpu_blocks=4096, num_state_slots=1024,
                          max_num_seqs=1024, max_num_batched_tokens=8192, max_model_len=16384,
                          spec_tokens=k, adaptive_spec_budget=adaptive)


def _first_step_total(make_scheduler, k, num_reqs, prompt_len, adaptive=True):
    sched, runner = _big_scheduler(make_scheduler, k, adaptive)
    for i in range(num_reqs):
        sched.add_request(make_request(f"r{i}", prompt_len, max_tokens=1))
    so = sched.schedule()
    sched.finish_requests(list(sched.requests), RequestStatus.FINISHED_ABORTED)
    return so


# (num_requests, total target tokens) with max_num_batched_tokens=8192, max_num_seqs=1024.
# K=8 -> 7 draft slots per scheduled request; K=7 -> 6 (the blog's table).
BUDGET_TABLE = {
    8: [(1, 8185), (32, 7968), (128, 7296), (1024, 1024)],
    7: [(1, 8186), (32, 8000), (128, 7424), (1024, 2048)],
}


@pytest.mark.parametrize("k,num_reqs,total",
                         [(k, n, t) for k, rows in BUDGET_TABLE.items() for n, t in rows])
def test_adaptive_budget_table(make_scheduler, k, num_reqs, total):
    # Each request's prompt is its equal share (a single request: a long 10K prompt).
    prompt_len = 10_000 if num_reqs == 1 else total // num_reqs
    so = _first_step_total(make_scheduler, k, num_reqs, prompt_len)
    assert len(so.num_scheduled_tokens) == num_reqs
    assert so.total_num_scheduled_tokens == total
    assert so.total_num_scheduled_tokens + (k - 1) * num_reqs == 8192


def test_draft_slots_reserved_only_for_scheduled_requests(make_scheduler):
    # Two long prompts: the first takes everything it can; the second is not scheduled, so
    # no slots are held for it.
    so = _first_step_total(make_scheduler, 8, 2, 9000)
    assert so.num_scheduled_tokens == {"r0": 8185}


def test_static_budget_rule(make_scheduler):
    so = _first_step_total(make_scheduler, 8, 1, 10_000, adaptive=False)
    assert so.num_scheduled_tokens == {"r0": 8192 - 7 * 1024}
    so = _first_step_total(make_scheduler, 7, 1, 10_000, adaptive=False)
    assert so.num_scheduled_tokens == {"r0": 2048}
    sc = SchedulerConfig(max_num_seqs=1024, max_num_batched_tokens=8192, max_model_len=4096)
    sc.adaptive_spec_budget = False
    with pytest.raises(ValueError, match="static spec budget"):
        Scheduler(sc, CacheConfig(block_size=16), num_gpu_blocks=4096, num_state_slots=1024,
                  speculative_config=SpeculativeConfig(method="ngram", num_speculative_tokens=9))


def _oracle_drafter(k, wrong_at):
    """Drafts = the model's true continuation, with draft `wrong_at(req)` corrupted."""
    def drafter(sched):
        drafts = {}
        for r in sched.running:
            if r.num_computed_tokens != r.num_tokens - 1:
                continue  # still prefilling
            true = reference_tokens(r.all_token_ids, k)
            bad = wrong_at(r)
            if bad < k:
                true[bad] = 1  # never produced by the fake model
            drafts[r.req_id] = true
        return drafts
    return drafter


def test_spec_decode_is_lossless_and_rolls_back(make_scheduler):
    k = 3
    sched, runner = make_scheduler(spec_tokens=k, max_num_batched_tokens=32, num_gpu_blocks=64)
    reqs = [make_request(f"r{i}", 5 + 3 * i, max_tokens=12, start=i) for i in range(4)]
    for r in reqs:
        sched.add_request(r)
    result = run_until_done(sched, runner,
                            drafter=_oracle_drafter(k, lambda r: (r.num_tokens * 7) % (k + 2)))
    for r in reqs:
        assert result.tokens[r.req_id] == reference_tokens(r.prompt_token_ids, 12)
    spec_steps = [so for so in runner.steps if so.scheduled_spec_decode_tokens]
    assert spec_steps
    for so in spec_steps:
        for rid, drafts in so.scheduled_spec_decode_tokens.items():
            assert len(drafts) == k and so.num_scheduled_tokens[rid] == k + 1
    sizes = {len(o.new_token_ids) for o in result.outputs}
    assert 1 in sizes and k + 1 in sizes  # some all-rejected, some all-accepted steps


def test_spec_tokens_stop_at_max_tokens(make_scheduler):
    sched, runner = make_scheduler(spec_tokens=4)
    req = make_request("a", 6, max_tokens=3)
    sched.add_request(req)
    result = run_until_done(sched, runner, drafter=_oracle_drafter(4, lambda r: 99))
    assert result.tokens["a"] == reference_tokens(req.prompt_token_ids, 3)
    assert result.finish["a"] == "length"


def test_spec_charges_draft_slots_per_scheduled_request(make_scheduler):
    # K=3 -> 2 draft slots per request. Budget 20: a decode with 3 drafts costs 4 + 2 = 6.
    sched, runner = make_scheduler(spec_tokens=3, max_num_batched_tokens=20)
    sched.add_request(make_request("a", 5, max_tokens=10))
    step(sched, runner, drafter=_oracle_drafter(3, lambda r: 99))
    sched.add_request(make_request("b", 40, max_tokens=1))
    so, _ = step(sched, runner)
    assert so.num_scheduled_tokens == {"a": 4, "b": 20 - 6 - 2}
    sched.finish_requests(["a", "b"], RequestStatus.FINISHED_ABORTED)


def test_lookahead_slots_for_model_drafters(make_scheduler):
    for method, blocks in (("ngram", 3), ("draft_model", 4)):
        sched, runner = make_scheduler(spec_tokens=3, spec_method=method)
        sched.add_request(make_request("a", 10, max_tokens=2))
        so = sched.schedule()
        assert len(so.scheduled_new_reqs[0].block_ids) == blocks  # cdiv(10 [+ 3], 4)
        sched.finish_requests("a", RequestStatus.FINISHED_ABORTED)
