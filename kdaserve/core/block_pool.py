"""MLA latent-KV block pool: ref counts, free queue, and (optional) the prefix-cache hash map.

Block ids are 0..num_blocks-1. A block is *free* when its ref count is 0. With prefix caching on,
a full block carries the chained hash of the tokens it holds; when it is freed it stays in the
hash map ("free but cached") until it is reused for something else, and the free queue is an LRU
order: uncached blocks are handed out first, then cached ones oldest-freed first.

A block may also carry *partial keys*: the key of a KDA checkpoint that sits inside the block
(position not on a block multiple) names the block whose first tokens hold that checkpoint's KV
(see checkpoint_pool.py). Partial keys make a block "cached" like a full hash does (kept in LRU
order when freed). When a cached block is handed out again, every hash it carried is dropped and
reported to `on_evict`, so checkpoints that depend on it die with it.
"""

from __future__ import annotations

import hashlib
import pickle
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence

BlockHash = bytes
"""sha256 digest of (parent hash, block token ids, extra keys)."""

NONE_HASH: BlockHash = hashlib.sha256(b"kdaserve-prefix-root").digest()


def hash_block_tokens(parent_hash: BlockHash | None, token_ids: Sequence[int],
                      extra_keys: tuple | None = None) -> BlockHash:
    """Hash of one full block, chained on the previous block's hash (None for the first)."""
    payload = (parent_hash or NONE_HASH, tuple(token_ids), extra_keys)
    return hashlib.sha256(pickle.dumps(payload, protocol=5)).digest()


def hash_request_blocks(token_ids: Sequence[int], block_size: int, hashes: list[BlockHash],
                        num_tokens: int | None = None,
                        first_extra_keys: tuple | None = None) -> list[BlockHash]:
    """Extend `hashes` (the chain of the first blocks) in place to cover every full block of
    token_ids[:num_tokens] (all of them when None); returns it. `first_extra_keys` (e.g. a cache
    salt) enter the first block's hash, so they separate whole chains."""
    num_tokens = len(token_ids) if num_tokens is None else min(num_tokens, len(token_ids))
    for i in range(len(hashes), num_tokens // block_size):
        parent = hashes[-1] if hashes else None
        extra = first_extra_keys if i == 0 else None
        hashes.append(hash_block_tokens(parent, token_ids[i * block_size:(i + 1) * block_size],
                                        extra))
    return hashes


def hash_partial_block(parent_hash: BlockHash | None, token_ids: Sequence[int],
                       extra_keys: tuple | None = None) -> BlockHash:
    """Key of a position inside a block: chained on the last full block's hash, over the first
    tokens of the next block. Never equal to a full block's hash (a distinct extra key)."""
    return hash_block_tokens(parent_hash, token_ids, ("partial", extra_keys))


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool = False,
                 on_evict: Callable[[list[BlockHash]], None] | None = None,
                 on_reuse: Callable[[int, BlockHash | None, list[BlockHash]], None] | None = None
                 ) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.on_evict = on_evict
        """Called with the hashes (full and partial) a block loses when it is handed out again
        or the cache is reset."""
        self.on_reuse = on_reuse
        """Called with (block id, its full hash or None, its partial keys) just before a cached
        block is handed out again, while its hashes still name it (the offload tier stores
        its KV then)."""
        self._ref_cnt = [0] * num_blocks
        self._block_hash: list[BlockHash | None] = [None] * num_blocks
        self._partial_keys: dict[int, list[BlockHash]] = {}
        """block id -> partial keys registered on it."""
        # Front = next block handed out. Values unused (OrderedDict as an O(1) linked list).
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self._cached: dict[BlockHash, int] = {}

    # ---- accounting ----
    @property
    def num_free_blocks(self) -> int:
        """Blocks with ref count 0, cached or not (a cached one is evicted when handed out)."""
        return len(self._free)

    @property
    def usage(self) -> float:
        """Fraction of blocks in use (ref count > 0)."""
        return 1.0 - len(self._free) / self.num_blocks

    def ref_count(self, block_id: int) -> int:
        return self._ref_cnt[self._check_id(block_id)]

    def block_hash(self, block_id: int) -> BlockHash | None:
        return self._block_hash[self._check_id(block_id)]

    # ---- allocate / share / free ----
    def allocate(self, num_blocks: int) -> list[int]:
        """Take `num_blocks` free blocks (ref count 1 each). Raises if not enough are free."""
        if num_blocks < 0:
            raise ValueError(f"num_blocks must be >= 0, got {num_blocks}")
        if num_blocks > len(self._free):
            raise RuntimeError(
                f"cannot allocate {num_blocks} KV blocks: only {len(self._free)} free")
        block_ids = []
        for _ in range(num_blocks):
            block_id, _ = self._free.popitem(last=False)
            self._evict(block_id)
            self._ref_cnt[block_id] = 1
            block_ids.append(block_id)
        return block_ids

    def share(self, block_ids: Iterable[int]) -> None:
        """Add one reference to each block (n > 1 forks, prefix-cache hits). A free cached block
        leaves the free queue and keeps its hash."""
        for block_id in block_ids:
            self._check_id(block_id)
            if self._ref_cnt[block_id] == 0:
                if not self.is_cached(block_id):
                    raise RuntimeError(f"block {block_id} is free and uncached: cannot share it")
                del self._free[block_id]
            self._ref_cnt[block_id] += 1

    def free(self, block_ids: Iterable[int]) -> None:
        """Drop one reference from each block, in the given order. Blocks reaching 0 join the
        free queue: uncached ones at the front, cached ones at the back (evicted last)."""
        for block_id in block_ids:
            self._check_id(block_id)
            if self._ref_cnt[block_id] <= 0:
                raise RuntimeError(f"double free of KV block {block_id}")
            self._ref_cnt[block_id] -= 1
            if self._ref_cnt[block_id] == 0:
                self._free[block_id] = None
                if not self.is_cached(block_id):
                    self._free.move_to_end(block_id, last=False)

    # ---- prefix cache ----
    def cache_block(self, block_id: int, block_hash: BlockHash) -> bool:
        """Register a full, in-use block under its hash. Returns False when caching is off, the
        block already has a hash, or another block already holds this hash (first one wins)."""
        self._check_id(block_id)
        if not self.enable_caching or self._block_hash[block_id] is not None:
            return False
        if self._ref_cnt[block_id] == 0:
            raise RuntimeError(f"cannot cache free KV block {block_id}")
        if block_hash in self._cached:
            return False
        self._cached[block_hash] = block_id
        self._block_hash[block_id] = block_hash
        return True

    def cache_partial(self, block_id: int, key: BlockHash) -> bool:
        """Register a partial key (a checkpoint inside this block) on an in-use block. Returns
        False when caching is off or the key is already registered."""
        self._check_id(block_id)
        if not self.enable_caching or key in self._cached:
            return False
        if self._ref_cnt[block_id] == 0:
            raise RuntimeError(f"cannot cache free KV block {block_id}")
        self._cached[key] = block_id
        self._partial_keys.setdefault(block_id, []).append(key)
        return True

    def uncache_partial(self, key: BlockHash) -> None:
        """Forget a partial key (its checkpoint is gone). A free block left with no hash moves to
        the front of the free queue."""
        block_id = self._cached.get(key)
        if block_id is None or key not in self._partial_keys.get(block_id, ()):
            return
        del self._cached[key]
        keys = self._partial_keys[block_id]
        keys.remove(key)
        if not keys:
            del self._partial_keys[block_id]
        if self._ref_cnt[block_id] == 0 and not self.is_cached(block_id):
            self._free.move_to_end(block_id, last=False)

    def is_cached(self, block_id: int) -> bool:
        return self._block_hash[block_id] is not None or block_id in self._partial_keys

    def get_cached_block(self, block_hash: BlockHash) -> int | None:
        return self._cached.get(block_hash) if self.enable_caching else None

    def reset_prefix_cache(self) -> int:
        """Forget every cached hash (in-use blocks included). Returns how many were dropped."""
        dropped = list(self._cached)
        for block_id in self._cached.values():
            self._block_hash[block_id] = None
        self._cached.clear()
        self._partial_keys.clear()
        if dropped and self.on_evict is not None:
            self.on_evict(dropped)
        return len(dropped)

    # ---- internals ----
    def _evict(self, block_id: int) -> None:
        block_hash = self._block_hash[block_id]
        if self.on_reuse is not None and (block_hash is not None
                                          or block_id in self._partial_keys):
            self.on_reuse(block_id, block_hash, list(self._partial_keys[block_id])
                          if block_id in self._partial_keys else [])
        lost = self._partial_keys.pop(block_id, [])
        if block_hash is not None:
            lost.append(block_hash)
            self._block_hash[block_id] = None
        for key in lost:
            del self._cached[key]
        if lost and self.on_evict is not None:
            self.on_evict(lost)

    def _check_id(self, block_id: int) -> int:
        if not isinstance(block_id, int) or not 0 <= block_id < self.num_blocks:
            raise ValueError(f"KV block id must be in [0, {self.num_blocks}), got {block_id!r}")
        return block_id
