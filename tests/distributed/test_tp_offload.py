"""The offload tier under tensor parallelism (CPU, gloo, two rank processes): each rank spills
its own KDA state shard and its copy of the latent KV, writes its own files, and an entry
enters the disk index only once both ranks wrote it; a prefix evicted from the device is
served from host memory at TP=2 with TP=1's output, and from disk after a restart."""

from __future__ import annotations

import glob
import os
import random

import pytest

from kdaserve import LLM
from tests.engine.conftest import assert_pools_free
from tests.prefix.test_offload import run_each

pytestmark = pytest.mark.timeout(600)

SMALL = dict(block_size=16, num_gpu_blocks=40, kda_checkpoint_interval=64,
             num_kda_checkpoint_slots=4, max_model_len=512, max_num_batched_tokens=512)


def test_tp2_offload_host_then_disk_equals_tp1(tiny_dir, tmp_path):
    rng = random.Random(0)
    first = [rng.randrange(3, 128) for _ in range(260)]
    others = [[rng.randrange(3, 128) for _ in range(200)] for _ in range(6)]
    again = first + [5, 6, 7]
    ref_llm = LLM(tiny_dir, enable_prefix_caching=False, **SMALL)
    ref = [t for t, _ in run_each(ref_llm, [first] + others + [again])]
    ref_llm.llm_engine.engine_core.shutdown()

    disk = dict(kv_offload_size=0.01, kv_offload_disk_path=str(tmp_path))
    llm = LLM(tiny_dir, tensor_parallel_size=2, **SMALL, **disk)
    try:
        got = run_each(llm, [first] + others + [again])
        assert [t for t, _ in got] == ref and got[-1][1] == 256
        assert llm.llm_engine.get_stats().offload_host_hit_tokens == 256
        assert_pools_free(llm.llm_engine)
    finally:
        llm.llm_engine.engine_core.shutdown()     # drains the file jobs of both ranks
    entries = llm.llm_engine.get_stats().num_offload_disk_entries
    assert entries > 0
    for rank in (0, 1):
        assert len(glob.glob(os.path.join(str(tmp_path), "*", f"rank{rank}", "*.bin"))) \
            == entries

    restarted = LLM(tiny_dir, tensor_parallel_size=2, **SMALL, **disk)
    try:
        assert run_each(restarted, [again]) == [(ref[-1], 256)]
        assert restarted.llm_engine.get_stats().offload_disk_hit_tokens == 256
    finally:
        restarted.llm_engine.engine_core.shutdown()
