"""The worker's device memory: the KV budget (gpu_memory_utilization is one instance's share
of the device) and the allocator settings under which NIXL-registered caches are allocated."""

from __future__ import annotations

import pytest

from kdaserve.worker import worker
from kdaserve.worker.worker import cache_budget, ipc_capable_allocations

GiB = 2**30


def test_other_processes_memory_is_not_charged():
    # 140 GiB device; another instance holds 63 GiB; this one: 1 GiB context at start, 20 GiB
    # reserved by torch (weights 18 allocated, peak 19), 0.5 GiB of cuBLAS workspace since.
    total, used_at_start = 140 * GiB, 64 * GiB
    reserved, allocated, peak = 20 * GiB, 18 * GiB, 19 * GiB
    free = total - used_at_start - reserved - GiB // 2
    budget = cache_budget(total, free, reserved, used_at_start, peak, allocated, 0.45)
    assert budget == 0.45 * total - peak - GiB // 2
    # Alone on the device the same instance gets the same share.
    alone = cache_budget(total, free + 63 * GiB, reserved, GiB, peak, allocated, 0.45)
    assert alone == budget


def test_free_memory_bounds_the_budget():
    # The other process grew after this one started: only what is free can hold the pools.
    total, reserved, allocated, peak = 140 * GiB, 20 * GiB, 18 * GiB, 19 * GiB
    free = 10 * GiB
    budget = cache_budget(total, free, reserved, 100 * GiB, peak, allocated, 0.9)
    assert budget == free - (peak - allocated) - (256 << 20)


def test_registered_caches_are_allocated_without_expandable_segments(monkeypatch):
    calls = []
    monkeypatch.setattr(worker, "_allocator_setter", lambda: calls.append)
    with ipc_capable_allocations(True):
        calls.append("allocate")
    assert calls == ["expandable_segments:False", "allocate", "expandable_segments:True"]
    calls.clear()
    with pytest.raises(RuntimeError), ipc_capable_allocations(True):
        raise RuntimeError("out of memory")
    assert calls == ["expandable_segments:False", "expandable_segments:True"]
    calls.clear()
    with ipc_capable_allocations(False):   # segments not expandable: nothing to switch
        pass
    assert calls == []


def test_user_allocator_settings_are_read_not_overridden(monkeypatch):
    calls = []
    monkeypatch.setattr(worker, "_allocator_setter", lambda: calls.append)
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:512, expandable_segments:True")
    assert worker.use_expandable_segments() is True and calls == []
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:512")
    assert worker.use_expandable_segments() is False and calls == []
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF")
    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    assert worker.use_expandable_segments() is True and calls == ["expandable_segments:True"]
