"""The offload tier under tensor parallelism (CPU, gloo, two rank processes): each rank spills
its own KDA state shard and its copy of the latent KV, writes its own files, and an entry
enters the disk index only once both ranks wrote it; a prefix evicted from the device is
served from host memory at TP=2 (and TP=2 with DCP=2) with TP=1's output, and from disk
after a restart."""

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
             num_kda_checkpoint_slots=8, max_model_len=512, max_num_batched_tokens=512)
"""A small device cache (evicted within a few prompts); enough checkpoint slots that every
checkpoint of a 260-token prompt is exported in its one chunk."""


@pytest.mark.parametrize("dcp", [1, 2])
def test_tp2_offload_host_then_disk_equals_tp1(tiny_dir, tmp_path, dcp):
    """dcp=2: each rank's blocks hold its share of the latent KV (block ids cover 2 x 16
    tokens), and each rank spills and reads back its own share."""
    rng = random.Random(0)
    prompts = {}
    for name in ("host", "disk"):
        first = [rng.randrange(3, 128) for _ in range(260)]
        others = [[rng.randrange(3, 128) for _ in range(200)] for _ in range(8)]
        prompts[name] = (first, others, first + [5, 6, 7])
    ref_llm = LLM(tiny_dir, enable_prefix_caching=False, **SMALL)
    ref = {name: run_each(ref_llm, [again])[0][0] for name, (_, _, again) in prompts.items()}
    ref_llm.llm_engine.engine_core.shutdown()

    disk = dict(kv_offload_size=0.01, kv_offload_disk_path=str(tmp_path))
    tp = dict(tensor_parallel_size=2, decode_context_parallel_size=dcp)
    llm = LLM(tiny_dir, **tp, **SMALL, **disk)
    try:
        first, others, again = prompts["host"]
        got = run_each(llm, [first] + others + [again])
        assert got[-1] == (ref["host"], 260)    # the first prompt's end, inside a block
        assert llm.llm_engine.get_stats().offload_host_hit_tokens == 260
        first, others, _ = prompts["disk"]
        run_each(llm, [first] + others)         # evicted to host and disk, not hit here
        assert_pools_free(llm.llm_engine)
    finally:
        llm.llm_engine.engine_core.shutdown()     # drains the file jobs of both ranks
    entries = llm.llm_engine.get_stats().num_offload_disk_entries
    assert entries > 0
    for rank in (0, 1):
        assert len(glob.glob(os.path.join(str(tmp_path), "*", f"rank{rank}", "*.bin"))) \
            == entries

    restarted = LLM(tiny_dir, **tp, **SMALL, **disk)
    try:
        assert run_each(restarted, [prompts["disk"][2]]) == [(ref["disk"], 260)]
        assert restarted.llm_engine.get_stats().offload_disk_hit_tokens == 260
    finally:
        restarted.llm_engine.engine_core.shutdown()
