"""Checkpoint pool (LRU, locks, pending vs ready, drops with blocks) and the block pool's partial
keys and eviction reports."""

from __future__ import annotations

import pytest

from kdaserve.core.block_pool import BlockPool, hash_block_tokens, hash_partial_block
from kdaserve.core.checkpoint_pool import CheckpointPool


def _h(i: int) -> bytes:
    return hash_block_tokens(None, [i])


def test_reserve_commit_lru_and_locks():
    evicted = []
    pool = CheckpointPool(2, first_slot=10, on_lru_evict=evicted.append)
    a = pool.reserve(_h(1), _h(1), 0, 16)
    b = pool.reserve(_h(2), _h(2), 0, 32)
    assert {a.slot, b.slot} == {10, 11} and pool.num_free_slots == 0
    assert pool.get(_h(1)) is None and pool.known(_h(1))       # pending: known, not hit-able
    assert pool.reserve(_h(3), _h(3), 0, 48) is None           # nothing ready to evict
    pool.commit(_h(1))
    pool.commit(_h(2))
    assert pool.get(_h(1)).slot == a.slot and pool.num_exports == 2
    pool.touch(_h(1))                                           # _h(2) is now least recent
    pool.lock(_h(2))
    c = pool.reserve(_h(3), _h(3), 0, 48)                       # evicts _h(1): _h(2) locked
    assert c.slot == a.slot and [e.key for e in evicted] == [_h(1)]
    pool.unlock_all()
    d = pool.reserve(_h(4), _h(4), 0, 64)
    assert d.slot == b.slot                                     # LRU once unlocked
    with pytest.raises(RuntimeError, match="already ready or pending"):
        pool.reserve(_h(3), _h(3), 0, 48)


def test_drop_hashes_by_key_and_anchor_and_dead_pending():
    pool = CheckpointPool(4, first_slot=0)
    anchor, partial = _h(1), hash_partial_block(_h(1), [5, 6])
    pool.reserve(anchor, anchor, 0, 16)
    pool.reserve(partial, anchor, 2, 18)
    pool.commit(anchor)
    pool.commit(partial)
    assert pool.partial_offsets(anchor) == [2]
    pending = pool.reserve(_h(9), anchor, 3, 19)
    dropped = pool.drop_hashes([anchor])                        # the anchor block was reused
    assert {c.key for c in dropped} == {anchor, partial}
    assert pool.commit(pending.key) is None                     # died before its commit
    assert pool.num_free_slots == 4 and pool.num_ready == 0 and pool.partial_offsets(anchor) == []


def test_bad_sizes_name_the_value():
    with pytest.raises(ValueError, match="-1"):
        CheckpointPool(-1, first_slot=0)


def test_block_pool_partial_keys_follow_lru_and_report_eviction():
    lost = []
    pool = BlockPool(3, enable_caching=True, on_evict=lost.extend)
    a, b, c = pool.allocate(3)
    key = hash_partial_block(None, [1, 2])
    assert pool.cache_partial(b, key) and not pool.cache_partial(c, key)
    assert pool.get_cached_block(key) == b and pool.is_cached(b)
    pool.free([a, b, c])                    # b (cached) goes behind the uncached a and c
    assert set(pool.allocate(2)) == {a, c} and not lost
    assert pool.allocate(1) == [b] and lost == [key] and pool.get_cached_block(key) is None
    pool.free([a, b, c])
    (d,) = pool.allocate(1)
    pool.cache_partial(d, key)
    pool.free([d])
    pool.uncache_partial(key)               # its checkpoint died: d is plain free again
    assert not pool.is_cached(d) and pool.allocate(1) == [d]
    pool.free([d])
    with pytest.raises(RuntimeError, match="free KV block"):
        pool.cache_partial(d, key)
