"""Hybrid prefix caching in the scheduler, driven by the FakeRunner: the runner reads every
context back through the block table and checks each request's KDA state slot holds exactly its
computed prefix, so a wrong hit, a missed restore copy, a stale checkpoint or a shared block
overwritten all fail."""

from __future__ import annotations

import random

import pytest
from sched_driver import RunResult, reference_tokens, step

from kdaserve.core.block_pool import NONE_HASH
from kdaserve.request import Request, RequestStatus
from kdaserve.sampling_params import SamplingParams

CACHE = {"enable_prefix_caching": True, "block_size": 4, "kda_checkpoint_interval": 8}


def req(rid: str, prompt: list[int], max_tokens: int = 4, **params) -> Request:
    return Request(rid, prompt, SamplingParams(max_tokens=max_tokens, **params))


def check_ref_counts(sched) -> None:
    """Every block's ref count = the requests holding it (+ this step's copy-source pins)."""
    kv = sched.kv_cache_manager
    holders = [0] * kv.num_gpu_blocks
    for blocks in kv._blocks.values():
        for b in blocks:
            holders[b] += 1
    for b in kv._step_pins:
        holders[b] += 1
    assert [kv.block_pool.ref_count(b) for b in range(kv.num_gpu_blocks)] == holders


def run_checked(sched, runner, result=None, max_steps=5000):
    """run_until_done, checking ref counts after every step."""
    result = result or RunResult()
    while sched.has_unfinished_requests():
        assert result.num_steps < max_steps
        step(sched, runner, result)
        check_ref_counts(sched)
        assert not sched.kv_cache_manager._step_pins
    return result


def finish(sched, runner, rid):
    while rid in sched.requests:
        step(sched, runner)


def test_second_request_computes_only_the_suffix(make_scheduler):
    sched, runner = make_scheduler(**CACHE)
    a = req("a", list(range(10, 40)))                        # 30 tokens
    sched.add_request(a)
    so, _ = step(sched, runner)
    # Internal mode: one chunk, exports at 8, 16, 24 (inside) and the prompt end 30.
    assert so.num_scheduled_tokens == {"a": 30}
    assert [e.num_tokens for e in so.kda_checkpoint_exports] == [8, 16, 24, 30]
    finish(sched, runner, "a")

    b = req("b", list(range(10, 36)) + [99, 98, 97])        # shares 26 tokens
    sched.add_request(b)
    so, _ = step(sched, runner)
    assert so.num_scheduled_tokens == {"b": 29 - 24}         # hit at the checkpoint 24
    (new,) = so.scheduled_new_reqs
    assert new.num_computed_tokens == 24 and b.num_cached_tokens == 24
    # a's finish export leads (its slot may be reused by b), then b's restore.
    ckpt_slots = sched.kv_cache_manager.checkpoint_pool
    assert so.state_copies[0].src_slot == 0 and ckpt_slots.owns_slot(so.state_copies[0].dst_slot)
    restore = so.state_copies[-1]
    assert ckpt_slots.owns_slot(restore.src_slot) and restore.dst_slot == new.state_slot
    assert not so.block_copies                                # on a block multiple: no copy
    finish(sched, runner, "b")
    stats = sched.get_stats()
    assert stats.prefix_cache_hits == 24 and stats.prefix_cache_queries == 30 + 29
    step(sched, runner)


def test_hit_inside_a_block_at_turn_ends(make_scheduler):
    """Prompt end (30) and finish position (33) are not block multiples: the hit shares the
    full blocks and copies the partial block's first tokens into the request's own block."""
    sched, runner = make_scheduler(**CACHE)
    a = req("a", list(range(10, 40)), max_tokens=4)
    sched.add_request(a)
    result = run_checked(sched, runner)
    out = result.tokens["a"]
    # Next chat turn: prompt + answer + new text -> hit at the finish position 33.
    turn2 = req("t2", a.prompt_token_ids + out + [5, 6])
    sched.add_request(turn2)
    so = sched.schedule()
    assert so.num_scheduled_tokens == {"t2": 36 - 33}
    assert len(so.block_copies) == 1
    src, dst = so.block_copies[0]
    kv = sched.kv_cache_manager
    assert kv.get_block_ids("t2")[33 // 4] == dst and src not in kv.get_block_ids("t2")
    assert kv.block_pool.ref_count(src) == 1                 # pinned as a copy source
    for o in sched.update_from_output(so, runner.execute(so)):
        result.tokens[o.req_id].extend(o.new_token_ids)
    assert kv.block_pool.ref_count(src) == 0                 # released after the step
    # Same prompt, other continuation -> hit at the prompt end 30.
    other = req("o", a.prompt_token_ids + [77, 78, 79])
    sched.add_request(other)
    so, _ = step(sched, runner, result)
    assert so.num_scheduled_tokens["o"] == 3 and other.num_cached_tokens == 30
    run_checked(sched, runner, result)
    assert result.tokens["t2"] == reference_tokens(turn2.prompt_token_ids, 4)
    assert result.tokens["o"] == reference_tokens(other.prompt_token_ids, 4)


def test_hit_leaves_one_token_and_exact_prompt_repeat(make_scheduler):
    sched, runner = make_scheduler(**CACHE)
    prompt = list(range(10, 42))                              # 32 tokens: ckpt at 32 = end
    sched.add_request(req("a", prompt))
    run_checked(sched, runner)
    sched.add_request(req("b", prompt))                       # same prompt: hit <= 31
    so, _ = step(sched, runner)
    assert so.num_scheduled_tokens == {"b": 32 - 24}
    run_checked(sched, runner)


def test_split_baseline_clips_the_chunk_at_the_last_boundary(make_scheduler):
    sched, runner = make_scheduler(**CACHE, kda_checkpoint_mode="split")
    sched.add_request(req("a", list(range(10, 40))))
    so, _ = step(sched, runner)
    assert so.num_scheduled_tokens == {"a": 24}               # two passes: 24 + 6
    assert [e.num_tokens for e in so.kda_checkpoint_exports] == [24]
    so, _ = step(sched, runner)
    assert so.num_scheduled_tokens == {"a": 6}
    assert [e.num_tokens for e in so.kda_checkpoint_exports] == [30]   # prompt end
    run_checked(sched, runner)


def _workload(seed: int, n: int, block_size: int = 4):
    rng = random.Random(seed)
    base = [rng.randrange(1, 90) for _ in range(60)]
    reqs = []
    for i in range(n):
        shared = rng.choice([0, 3, 8, 13, 16, 24, 31, 40, 60])
        tail = [rng.randrange(1, 90) for _ in range(rng.randint(1, 12))]
        reqs.append((f"r{i}", base[:shared] + tail, rng.randint(1, 6)))
    return reqs


@pytest.mark.parametrize("mode", ["internal", "split"])
@pytest.mark.parametrize("num_gpu_blocks,ckpt_slots", [(64, 64), (24, 3)])
def test_outputs_identical_with_cache_on_and_off(make_scheduler, mode, num_gpu_blocks,
                                                 ckpt_slots):
    """Waves of requests sharing prefixes of many lengths (on and off block and checkpoint
    multiples); small pools force preemption and eviction of blocks and checkpoints."""
    results = {}
    for on in (False, True):
        sched, runner = make_scheduler(
            block_size=4, num_gpu_blocks=num_gpu_blocks, max_model_len=96,
            max_num_batched_tokens=48, enable_prefix_caching=on, kda_checkpoint_interval=8,
            kda_checkpoint_mode=mode, num_kda_checkpoint_slots=ckpt_slots)
        work = _workload(7, 24)
        tokens = {}
        for wave in range(0, 24, 6):
            for rid, prompt, mt in work[wave:wave + 6]:
                sched.add_request(req(rid, prompt, max_tokens=mt))
            tokens.update(run_checked(sched, runner).tokens)
        for rid, prompt, mt in work:
            assert tokens[rid] == reference_tokens(prompt, mt), rid
        results[on] = (tokens, sched.get_stats())
    assert results[True][0] == results[False][0]
    assert results[True][1].prefix_cache_hits > 0
    assert results[False][1].prefix_cache_hits == 0


def test_same_step_checkpoints_are_not_hit(make_scheduler):
    """Two equal prompts admitted together: the checkpoint is pending during the step that
    exports it, so the second request computes on its own; a later one hits."""
    sched, runner = make_scheduler(**CACHE)
    prompt = list(range(10, 30))
    sched.add_request(req("a", prompt))
    sched.add_request(req("b", prompt))
    so, _ = step(sched, runner)
    assert so.num_scheduled_tokens == {"a": 20, "b": 20} and not so.state_copies
    keys = [e.num_tokens for e in so.kda_checkpoint_exports]
    assert keys == [8, 16, 20]                                # b's duplicates are skipped
    sched.add_request(req("c", prompt))
    so, _ = step(sched, runner)
    assert so.num_scheduled_tokens["c"] == 4                  # hit at 16
    run_checked(sched, runner)


def test_n_samples_abort_and_preemption_keep_ref_counts(make_scheduler):
    sched, runner = make_scheduler(**CACHE, num_gpu_blocks=40, max_model_len=64)
    prompt = list(range(10, 40))
    sched.add_request(req("a", prompt, max_tokens=2))
    run_checked(sched, runner)
    # n = 3 parent hits the prefix, forks, children share blocks.
    parent = req("p", prompt + [1, 2, 3], max_tokens=3, n=3, seed=5, temperature=1.0)
    sched.add_request(parent)
    step(sched, runner)
    check_ref_counts(sched)
    assert parent.num_cached_tokens == 30
    # A request sharing the prefix, aborted mid-prefill.
    sched.add_request(req("x", prompt + list(range(50, 80)), max_tokens=2))
    step(sched, runner)
    check_ref_counts(sched)
    sched.finish_requests("x", RequestStatus.FINISHED_ABORTED)
    check_ref_counts(sched)
    # Fill the pool so that running requests with shared blocks get preempted.
    for i in range(4):
        sched.add_request(req(f"f{i}", prompt[:20] + list(range(i, i + 30)), max_tokens=8))
    result = run_checked(sched, runner)
    assert sched.num_preemptions > 0
    for i in range(4):
        assert result.tokens[f"f{i}"] == reference_tokens(prompt[:20] + list(range(i, i + 30)),
                                                          8)


def test_eviction_never_frees_a_block_in_use(make_scheduler):
    sched, runner = make_scheduler(**CACHE, num_gpu_blocks=20, max_model_len=64,
                                   num_kda_checkpoint_slots=4)
    kv = sched.kv_cache_manager
    rng = random.Random(3)
    for wave in range(6):
        for i in range(3):
            prompt = [1 + (j * (wave % 3 + 1)) % 50 for j in range(rng.randint(10, 40))]
            sched.add_request(req(f"w{wave}-{i}", prompt, max_tokens=rng.randint(1, 5)))
        result = RunResult()
        while sched.has_unfinished_requests():
            held = {rid: list(blocks) for rid, blocks in kv._blocks.items()}
            step(sched, runner, result)
            check_ref_counts(sched)
            # A block held before the step by a request still running was not handed out again:
            # the FakeRunner also fails if a written position changes under its owner.
            for rid, blocks in held.items():
                if rid in kv._blocks:
                    assert kv._blocks[rid][:len(blocks)] == blocks, rid
        # Every ready checkpoint's chain is still cached (it died with its blocks otherwise).
        for key, ckpt in kv.checkpoint_pool._ready.items():
            assert ckpt.anchor == NONE_HASH or kv.block_pool.get_cached_block(ckpt.anchor) is not None
            if ckpt.offset:
                assert kv.block_pool.get_cached_block(key) is not None
        assert kv.checkpoint_pool.num_ready <= 4


def test_reset_prefix_cache_and_cache_salt(make_scheduler):
    sched, runner = make_scheduler(**CACHE)
    prompt = list(range(10, 40))
    sched.add_request(req("a", prompt))
    run_checked(sched, runner)
    salted = Request("s", prompt + [1], SamplingParams(max_tokens=2), cache_salt="tenant-2")
    sched.add_request(salted)
    step(sched, runner)
    assert salted.num_cached_tokens == 0                      # another tenant: no sharing
    run_checked(sched, runner)
    assert sched.reset_prefix_cache() > 0
    assert sched.kv_cache_manager.checkpoint_pool.num_ready == 0
    sched.add_request(req("b", prompt + [1]))
    step(sched, runner)
    assert sched.requests["b"].num_cached_tokens == 0
    run_checked(sched, runner)


def test_no_checkpoint_slots_means_no_hits(make_scheduler):
    sched, runner = make_scheduler(**CACHE, num_kda_checkpoint_slots=0)
    prompt = list(range(10, 40))
    sched.add_request(req("a", prompt))
    so, _ = step(sched, runner)
    assert not so.kda_checkpoint_exports
    run_checked(sched, runner)
    sched.add_request(req("b", prompt + [3]))
    so, _ = step(sched, runner)
    assert so.num_scheduled_tokens == {"b": 31}
    run_checked(sched, runner)

