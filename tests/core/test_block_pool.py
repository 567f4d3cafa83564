"""Block pool, state-slot pool and KV cache manager accounting."""

from __future__ import annotations

import pytest

from kdaserve.core.block_pool import BlockPool, hash_block_tokens, hash_request_blocks
from kdaserve.core.kv_cache_manager import KVCacheManager
from kdaserve.core.state_pool import StateSlotPool
from sched_driver import make_request


def test_allocate_free_ref_counts():
    pool = BlockPool(8)
    a = pool.allocate(3)
    assert a == [0, 1, 2] and pool.num_free_blocks == 5
    assert pool.usage == pytest.approx(3 / 8)
    pool.share(a[:2])
    assert [pool.ref_count(b) for b in a] == [2, 2, 1]
    pool.free(a)
    assert [pool.ref_count(b) for b in a] == [1, 1, 0] and pool.num_free_blocks == 6
    pool.free(a[:2])
    assert pool.num_free_blocks == 8 and pool.usage == 0.0


def test_pool_errors_name_the_bad_value():
    pool = BlockPool(4)
    with pytest.raises(RuntimeError, match="only 4 free"):
        pool.allocate(5)
    with pytest.raises(RuntimeError, match="double free of KV block 1"):
        pool.free([1])
    with pytest.raises(ValueError, match="got 9"):
        pool.ref_count(9)
    with pytest.raises(RuntimeError, match="free and uncached"):
        pool.share([0])
    with pytest.raises(ValueError, match="num_blocks"):
        BlockPool(0)


def test_hash_chain():
    h0 = hash_block_tokens(None, [1, 2, 3, 4])
    assert h0 == hash_block_tokens(None, (1, 2, 3, 4))
    h1 = hash_block_tokens(h0, [5, 6, 7, 8])
    assert h1 != hash_block_tokens(None, [5, 6, 7, 8])  # same tokens, other prefix
    chain = hash_request_blocks(list(range(1, 11)), 4, [])
    assert chain == [h0, h1]  # the partial third block is not hashed
    chain2 = hash_request_blocks(list(range(1, 13)), 4, chain[:1])
    assert len(chain2) == 3 and chain2[:2] == [h0, h1]


def test_lru_free_queue_and_eviction():
    pool = BlockPool(4, enable_caching=True)
    blocks = pool.allocate(4)
    h = [hash_block_tokens(None, [i]) for i in range(3)]
    for b, bh in zip(blocks[:3], h):
        assert pool.cache_block(b, bh)
    assert not pool.cache_block(blocks[3], h[0])  # first holder of a hash wins
    pool.free([blocks[1], blocks[0], blocks[2], blocks[3]])
    assert pool.num_free_blocks == 4  # free-but-cached blocks count as free
    # Uncached block 3 goes out first, then cached ones in the order they were freed.
    assert pool.allocate(1) == [blocks[3]]
    assert pool.allocate(1) == [blocks[1]]
    assert pool.get_cached_block(h[1]) is None and pool.block_hash(blocks[1]) is None  # evicted
    assert pool.get_cached_block(h[0]) == blocks[0]
    pool.share([blocks[0]])  # a prefix hit revives a free cached block
    assert pool.ref_count(blocks[0]) == 1 and pool.num_free_blocks == 1
    assert pool.allocate(1) == [blocks[2]]
    pool.free([blocks[0], blocks[1], blocks[2], blocks[3]])
    assert pool.reset_prefix_cache() == 1 and pool.get_cached_block(h[0]) is None


def test_caching_off_never_caches():
    pool = BlockPool(2, enable_caching=False)
    (b,) = pool.allocate(1)
    assert not pool.cache_block(b, hash_block_tokens(None, [1]))
    pool.free([b])


def test_state_slot_pool():
    pool = StateSlotPool(3)
    assert [pool.allocate() for _ in range(3)] == [0, 1, 2]
    with pytest.raises(RuntimeError, match="no free KDA state slot"):
        pool.allocate()
    pool.free(1)
    assert pool.is_free(1) and pool.num_free_slots == 1
    with pytest.raises(RuntimeError, match="double free of KDA state slot 1"):
        pool.free(1)
    with pytest.raises(ValueError, match="got 7"):
        pool.free(7)
    assert pool.allocate() == 1
    for s in range(3):
        pool.free(s)
    assert pool.num_free_slots == 3


def test_manager_allocate_slots_exact_accounting():
    kv = KVCacheManager(block_size=4, num_gpu_blocks=6, num_state_slots=2, max_model_len=24)
    req = make_request("a", 10)
    assert kv.allocate_slots(req, 10) == [0, 1, 2]
    req.num_computed_tokens = 10
    assert kv.allocate_slots(req, 2) == []  # position 10, 11 fit in block 2
    assert kv.allocate_slots(req, 3, num_lookahead_tokens=4) == [3, 4]  # 17 tokens -> 5 blocks
    assert kv.allocate_slots(req, 3, num_lookahead_tokens=100) == [5]  # capped at max_model_len
    other = make_request("b", 4)
    assert kv.allocate_slots(other, 4) is None  # nothing free: no partial allocation
    assert kv.num_free_blocks == 0 and kv.get_block_ids("b") == []
    assert kv.allocate_state_slot(req) == 0 and req.state_slot == 0
    assert kv.allocate_state_slot(other, num_reserved=1) is None  # needs 2, 1 free
    assert kv.num_free_slots == 1 and other.state_slot is None
    kv.free(req)
    kv.free(other)
    assert kv.num_free_blocks == 6 and kv.num_free_slots == 2 and req.state_slot is None


def test_manager_fork_shares_full_blocks():
    kv = KVCacheManager(block_size=4, num_gpu_blocks=10, num_state_slots=4)
    parent = make_request("p", 11, n=3)
    kv.allocate_slots(parent, 10, num_lookahead_tokens=4)  # 14 tokens -> 4 blocks
    kv.allocate_state_slot(parent, num_reserved=2)
    parent.num_computed_tokens = 10
    blocks = kv.get_block_ids("p")
    children = [parent.make_child(i) for i in range(3)]
    res = kv.fork(parent, children)
    full, partial, lookahead = blocks[:2], blocks[2], blocks[3]
    assert [kv.block_pool.ref_count(b) for b in full] == [3, 3]
    assert kv.block_pool.ref_count(lookahead) == 0  # never written: back to the pool
    assert kv.get_block_ids("p-2") == full + [partial]
    copies = [dst for _, dst in res.block_copies]
    assert [src for src, _ in res.block_copies] == [partial, partial]
    assert kv.get_block_ids("p-0") == full + [copies[0]]
    assert kv.get_block_ids("p-1") == full + [copies[1]]
    assert children[2].state_slot == 0  # the last child inherits the parent's slot
    assert [(c.src_slot, c.dst_slot) for c in res.state_copies] == [
        (0, children[0].state_slot), (0, children[1].state_slot)]
    assert kv.num_free_blocks == 10 - 5 and kv.num_free_slots == 1
    assert not kv.holds_resources("p")
    for c in children:
        kv.free(c)
    assert kv.num_free_blocks == 10 and kv.num_free_slots == 4


def test_manager_caches_full_blocks_and_finds_prefix():
    kv = KVCacheManager(block_size=4, num_gpu_blocks=8, num_state_slots=2,
                        enable_prefix_caching=True)
    a = make_request("a", 10)
    kv.allocate_slots(a, 6)  # blocks for 6 tokens; only block 0 is full
    assert kv.block_pool.block_hash(kv.get_block_ids("a")[0]) is not None
    assert kv.block_pool.block_hash(kv.get_block_ids("a")[1]) is None
    a.num_computed_tokens = 6
    kv.allocate_slots(a, 4)  # now 10 tokens: blocks 0, 1 full
    a_blocks = kv.get_block_ids("a")
    kv.free(a)
    b = make_request("b", 10)  # same prompt
    assert kv.find_cached_kv_prefix(b) == a_blocks[:2]
    kv.block_pool.allocate(8)  # evicts everything
    assert kv.find_cached_kv_prefix(b) == []
    kv.block_pool.free(range(8))
