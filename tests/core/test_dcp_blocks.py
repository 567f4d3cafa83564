"""Block accounting under decode context parallelism: with n DCP ranks each scheduler block
holds block_size tokens on every rank, so it covers n * block_size tokens (twice the token
capacity of the same blocks at n = 2), and the prefix cache hashes those logical blocks."""

from __future__ import annotations

import pytest

from kdaserve.config import CacheConfig, SchedulerConfig
from kdaserve.core.scheduler import Scheduler
from kdaserve.request import Request, RequestStatus
from kdaserve.sampling_params import SamplingParams
from sched_driver import FakeRunner, assert_all_free, run_until_done, step


def _sched(dcp, num_blocks=16, max_model_len=64, prefix=False):
    sc = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=max_model_len)
    cc = CacheConfig(block_size=4, enable_prefix_caching=prefix)
    return Scheduler(sc, cc, num_gpu_blocks=num_blocks, num_state_slots=8,
                     max_model_len=max_model_len, decode_context_parallel_size=dcp)


def _req(rid, n, max_tokens=4):
    return Request(rid, list(range(1, n + 1)), SamplingParams(max_tokens=max_tokens,
                                                              ignore_eos=True))


@pytest.mark.parametrize("dcp", [1, 2, 4])
def test_blocks_cover_dcp_times_block_size_tokens(dcp):
    sched = _sched(dcp, num_blocks=64)
    assert sched.block_size == 4 * dcp
    req = _req("a", 37)
    sched.add_request(req)
    sched.schedule()
    blocks = sched.kv_cache_manager.get_block_ids("a")
    assert len(blocks) == -(-37 // (4 * dcp))
    sched.finish_requests("a", RequestStatus.FINISHED_ABORTED)
    assert_all_free(sched)


def test_capacity_doubles_with_dcp_2():
    """16 blocks of 4 tokens: max_model_len 128 does not fit without DCP, fits with DCP=2."""
    with pytest.raises(ValueError, match="cannot hold one sequence of max_model_len=128"):
        _sched(1, num_blocks=16, max_model_len=128)
    sched = _sched(2, num_blocks=16, max_model_len=128)
    free = sched.kv_cache_manager.num_free_blocks
    assert free * sched.block_size == 2 * 16 * 4


@pytest.mark.parametrize("dcp", [1, 2])
def test_run_to_completion_and_prefix_hit(dcp):
    """The real scheduler over logical blocks, driven by the fake runner (which checks every
    context read back through the block table); a second request sharing 26 prompt tokens hits
    the KDA checkpoint at 24 (a logical-block multiple for both sizes) and computes only its
    suffix. Everything is free at the end."""
    sc = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64)
    cc = CacheConfig(block_size=4, enable_prefix_caching=True, kda_checkpoint_interval=8)
    sched = Scheduler(sc, cc, num_gpu_blocks=32, num_state_slots=8, max_model_len=64,
                      decode_context_parallel_size=dcp)
    runner = FakeRunner(sched.block_size)
    sched.add_request(Request("a", list(range(10, 40)), SamplingParams(max_tokens=4)))
    run_until_done(sched, runner)
    sched.add_request(Request("b", list(range(10, 36)) + [99, 98, 97],
                              SamplingParams(max_tokens=4)))
    so, _ = step(sched, runner)
    assert so.num_scheduled_tokens == {"b": 29 - 24}
    run_until_done(sched, runner)
    assert sched.get_stats().prefix_cache_hits == 24
    step(sched, runner)
    assert_all_free(sched)
