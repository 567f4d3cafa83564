"""n > 1: one prompt prefill, then n children that share its KV blocks and copy its KDA state."""

from __future__ import annotations

import pytest

from kdaserve.request import RequestStatus
from sched_driver import make_request, reference_tokens, run_until_done, step


def _prefill_parent(sched, runner, prompt_len, n, **params):
    parent = make_request("p", prompt_len, max_tokens=5, n=n, **params)
    sched.add_request(parent)
    so, outs = step(sched, runner)
    assert so.num_scheduled_tokens == {"p": prompt_len - 1} and outs == []
    assert parent.num_computed_tokens == prompt_len - 1
    return parent


def test_fork_shares_blocks_and_copies_partial_block_and_state(make_scheduler):
    sched, runner = make_scheduler(block_size=4, num_gpu_blocks=20, num_state_slots=6,
                                   max_model_len=40)
    kv = sched.kv_cache_manager
    parent = _prefill_parent(sched, runner, 11, 3, seed=7)  # 10 tokens: 2 full + 1 partial
    parent_blocks = kv.get_block_ids("p")
    parent_slot = parent.state_slot
    assert kv.num_free_slots == 6 - 3  # slots for the children are held from admission

    so, outs = step(sched, runner)
    ids = ["p-0", "p-1", "p-2"]
    assert "p" in so.finished_req_ids and not kv.holds_resources("p")
    assert [n.req_id for n in so.scheduled_new_reqs] == ids
    assert all(n.num_computed_tokens == 10 for n in so.scheduled_new_reqs)
    assert so.num_scheduled_tokens == {c: 1 for c in ids}
    full, partial = parent_blocks[:2], parent_blocks[2]
    for b in full:
        assert kv.block_pool.ref_count(b) == 3
    tables = {n.req_id: n.block_ids for n in so.scheduled_new_reqs}
    assert tables["p-2"] == full + [partial]
    assert so.block_copies == [(partial, tables["p-0"][2]), (partial, tables["p-1"][2])]
    assert all(kv.block_pool.ref_count(t[2]) == 1 for t in tables.values())
    slots = {n.req_id: n.state_slot for n in so.scheduled_new_reqs}
    assert slots["p-2"] == parent_slot
    assert [(c.src_slot, c.dst_slot) for c in so.state_copies] == [
        (parent_slot, slots["p-0"]), (parent_slot, slots["p-1"])]
    assert kv.num_free_blocks == 20 - 5 and kv.num_free_slots == 3
    # Children use seed + i and each sampled its first token from the shared prefix.
    assert {o.req_id: (o.parent_req_id, o.sample_index) for o in outs} == {
        c: ("p", i) for i, c in enumerate(ids)}
    assert [sched.requests[c].sampling_params.seed for c in ids] == [7, 8, 9]

    result = run_until_done(sched, runner)
    for i, c in enumerate(ids):
        got = [o for o in outs if o.req_id == c][0].new_token_ids + result.tokens[c]
        assert got == reference_tokens(parent.prompt_token_ids, 5, seed=7 + i)


def test_fork_on_block_boundary_needs_no_copy(make_scheduler):
    sched, runner = make_scheduler(block_size=4, num_gpu_blocks=20, max_model_len=40)
    kv = sched.kv_cache_manager
    _prefill_parent(sched, runner, 9, 4)  # 8 tokens = 2 full blocks
    full = kv.get_block_ids("p")[:2]
    so, _ = step(sched, runner)
    assert so.block_copies == [] and len(so.state_copies) == 3
    assert [kv.block_pool.ref_count(b) for b in full] == [4, 4]
    # Each child allocated its own block for position 8.
    own = [n.block_ids[2] for n in so.scheduled_new_reqs]
    assert all(n.block_ids[:2] == full for n in so.scheduled_new_reqs)
    assert len(set(own)) == 4 and all(kv.block_pool.ref_count(b) == 1 for b in own)
    assert kv.num_free_blocks == 20 - 2 - 4
    result = run_until_done(sched, runner)
    assert len({tuple(t) for t in result.tokens.values()}) == 1  # unseeded: same fake model


def test_one_token_prompt_makes_independent_children(make_scheduler):
    sched, runner = make_scheduler()
    sched.add_request(make_request("p", 1, max_tokens=3, n=3, seed=0))
    so, _ = step(sched, runner)
    assert sorted(so.num_scheduled_tokens) == ["p-0", "p-1", "p-2"]
    assert so.block_copies == [] and so.state_copies == []
    assert all(n.num_computed_tokens == 0 for n in so.scheduled_new_reqs)
    result = run_until_done(sched, runner)
    assert sorted(result.finish) == ["p-0", "p-1", "p-2"]


def test_parent_counts_n_toward_max_num_seqs(make_scheduler):
    sched, runner = make_scheduler(max_num_seqs=3)
    sched.add_request(make_request("p", 7, max_tokens=3, n=3))
    sched.add_request(make_request("q", 3, max_tokens=1))
    so, _ = step(sched, runner)
    assert set(so.num_scheduled_tokens) == {"p"}
    while "q" in sched.requests and sched.requests["q"].status == RequestStatus.WAITING:
        step(sched, runner)
        assert len(sched.running) <= 3
    run_until_done(sched, runner)


def test_abort_parent_before_and_after_fork(make_scheduler):
    sched, runner = make_scheduler(block_size=4, num_gpu_blocks=20, num_state_slots=6,
                                   max_model_len=40)
    _prefill_parent(sched, runner, 11, 3)
    sched.finish_requests("p", RequestStatus.FINISHED_ABORTED)  # before the fork
    assert sched.kv_cache_manager.num_free_slots == 6
    assert sched.kv_cache_manager.num_free_blocks == 20
    assert "p" in sched.schedule().finished_req_ids

    sched2, runner2 = make_scheduler(block_size=4, num_gpu_blocks=20, num_state_slots=6,
                                   max_model_len=40)
    _prefill_parent(sched2, runner2, 11, 3)
    step(sched2, runner2)  # fork + first tokens
    sched2.finish_requests("p-1", RequestStatus.FINISHED_STOPPED)  # one sample's stop string
    assert "p-1" not in sched2.requests and len(sched2.running) == 2
    sched2.finish_requests("p", RequestStatus.FINISHED_ABORTED)  # the rest, by parent id
    assert not sched2.has_unfinished_requests()
    assert sched2.schedule().finished_req_ids == {"p-0", "p-1", "p-2"}


def test_fork_under_memory_pressure_preempts_and_recomputes(make_scheduler):
    # Tight pool: forks and children compete with other requests; everything must still match
    # the reference and give every block back.
    sched, runner = make_scheduler(block_size=4, num_gpu_blocks=14, num_state_slots=8,
                                   max_num_seqs=8, max_model_len=40,
                                   max_num_batched_tokens=16)
    reqs = [make_request("p", 10, max_tokens=9, n=3, seed=3),
            make_request("a", 13, max_tokens=8, start=2),
            make_request("q", 7, max_tokens=8, n=2, seed=11),
            make_request("b", 9, max_tokens=8, start=5)]
    for r in reqs:
        sched.add_request(r)
    result = run_until_done(sched, runner)
    assert sched.num_preemptions > 0
    for r in reqs:
        if r.sampling_params.n == 1:
            assert result.tokens[r.req_id] == reference_tokens(r.prompt_token_ids, 8)
        else:
            for i in range(r.sampling_params.n):
                assert result.tokens[f"{r.req_id}-{i}"] == reference_tokens(
                    r.prompt_token_ids, r.max_tokens, seed=r.sampling_params.seed + i)


def test_child_ids_are_reserved_until_the_samples_finish(make_scheduler):
    sched, runner = make_scheduler()
    sched.add_request(make_request("p", 6, n=2))
    with pytest.raises(ValueError, match="'p-1' is already in use"):
        sched.add_request(make_request("p-1", 3))  # before the fork
    run_until_done(sched, runner)
    sched.add_request(make_request("p-1", 3))  # free again
    sched.add_request(make_request("p", 3))
    run_until_done(sched, runner)
