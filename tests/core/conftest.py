from __future__ import annotations

import pytest

from kdaserve.config import CacheConfig, SchedulerConfig, SpeculativeConfig
from kdaserve.core.scheduler import Scheduler
from sched_driver import FakeRunner, assert_all_free


@pytest.fixture
def make_scheduler():
    """Build Schedulers (plus a FakeRunner each); at teardown every one must have all its
    blocks and slots back (tests abort what they leave unfinished)."""
    made: list[Scheduler] = []

    def make(*, block_size=4, num_gpu_blocks=64, num_state_slots=16, max_num_seqs=8,
             max_num_batched_tokens=64, max_model_len=128, long_prefill_token_threshold=0,
             enable_chunked_prefill=True, enable_prefix_caching=False, spec_tokens=0,
             spec_method="ngram", adaptive_spec_budget=None, **cache_kwargs):
        sc = SchedulerConfig(max_num_seqs=max_num_seqs,
                             max_num_batched_tokens=max_num_batched_tokens,
                             max_model_len=max_model_len,
                             long_prefill_token_threshold=long_prefill_token_threshold,
                             enable_chunked_prefill=enable_chunked_prefill)
        if adaptive_spec_budget is not None:
            sc.adaptive_spec_budget = adaptive_spec_budget
        cc = CacheConfig(block_size=block_size, enable_prefix_caching=enable_prefix_caching,
                         **cache_kwargs)
        spec = (SpeculativeConfig(method=spec_method, num_speculative_tokens=spec_tokens,
                                  model="draft" if spec_method == "draft_model" else None)
                if spec_tokens else None)
        sched = Scheduler(sc, cc, num_gpu_blocks=num_gpu_blocks, num_state_slots=num_state_slots,
                          speculative_config=spec, max_model_len=max_model_len)
        made.append(sched)
        return sched, FakeRunner(block_size)

    yield make
    for sched in made:
        assert_all_free(sched)
