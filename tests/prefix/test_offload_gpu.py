"""The offload tier on CUDA: pinned host slots, copies issued on the stream with the step, file
jobs that wait for the step's CUDA event. A prefix evicted from the device is served from host
memory, then from disk after a restart, with the tokens of the same hit on the device (the
tiny model in bf16, CUDA graphs on: a hit and a recompute may round differently, a hit from
the tier and one on the device may not)."""

from __future__ import annotations

import pytest
import torch

from tests.prefix.test_offload import HOST, SMALL, _prompts, run_each

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def test_host_then_disk_hits_on_cuda(make_llm, tmp_path):
    first, others = _prompts(4)
    first = first[:256]   # its end on a checkpoint boundary: the device and the tier hit 256
    again = first + [5, 6, 7]
    gpu = dict(SMALL, dtype="bfloat16", device="cuda")
    ref = run_each(make_llm(**{**gpu, "num_gpu_blocks": 256, "num_kda_checkpoint_slots": 64}),
                   [first] + others + [again])
    assert ref[-1][1] == 256             # nothing evicted: the hit is on the device
    disk = dict(kv_offload_size=HOST, kv_offload_disk_path=str(tmp_path))
    llm = make_llm(**gpu, **disk)
    assert llm.llm_engine.model_runner.offload.host["kv"][0].is_pinned()
    got = run_each(llm, [first] + others + [again])
    assert [t for t, _ in got] == [t for t, _ in ref] and got[-1][1] == 256
    core = llm.llm_engine.engine_core
    core.shutdown()
    assert llm.llm_engine.get_stats().num_offload_disk_entries > 0

    restarted = make_llm(**gpu, **disk)
    assert run_each(restarted, [again]) == [(ref[-1][0], 256)]
    assert restarted.llm_engine.get_stats().offload_disk_hit_tokens == 256
    restarted.llm_engine.engine_core.shutdown()
