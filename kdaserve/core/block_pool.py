"""MLA latent-KV block pool: ref counts, free queue, and (optional) the prefix-cache hash map.

Block ids are 0..num_blocks-1. A block is *free* when its ref count is 0. With prefix caching on,
a full block carries the chained hash of the tokens it holds; when it is freed it stays in the
hash map ("free but cached") until it is reused for something else, and the free queue is an LRU
order: uncached blocks are handed out first, then cached ones oldest-freed first.
"""

from __future__ import annotations

import hashlib
import pickle
from collections import OrderedDict
from collections.abc import Iterable, Sequence

BlockHash = bytes
"""sha256 digest of (parent hash, block token ids, extra keys)."""

NONE_HASH: BlockHash = hashlib.sha256(b"kdaserve-prefix-root").digest()


def hash_block_tokens(parent_hash: BlockHash | None, token_ids: Sequence[int],
                      extra_keys: tuple | None = None) -> BlockHash:
    """Hash of one full block, chained on the previous block's hash (None for the first)."""
    payload = (parent_hash or NONE_HASH, tuple(token_ids), extra_keys)
    return hashlib.sha256(pickle.dumps(payload, protocol=5)).digest()


def hash_request_blocks(token_ids: Sequence[int], block_size: int, hashes: list[BlockHash],
                        num_tokens: int | None = None) -> list[BlockHash]:
    """Extend `hashes` (the chain of the first blocks) in place to cover every full block of
    token_ids[:num_tokens] (all of them when None); returns it."""
    num_tokens = len(token_ids) if num_tokens is None else min(num_tokens, len(token_ids))
    for i in range(len(hashes), num_tokens // block_size):
        parent = hashes[-1] if hashes else None
        hashes.append(hash_block_tokens(parent, token_ids[i * block_size:(i + 1) * block_size]))
    return hashes


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool = False) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self._ref_cnt = [0] * num_blocks
        self._block_hash: list[BlockHash | None] = [None] * num_blocks
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
                if self._block_hash[block_id] is None:
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
                if self._block_hash[block_id] is None:
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

    def get_cached_block(self, block_hash: BlockHash) -> int | None:
        return self._cached.get(block_hash) if self.enable_caching else None

    def reset_prefix_cache(self) -> int:
        """Forget every cached hash (in-use blocks included). Returns how many were dropped."""
        dropped = len(self._cached)
        for block_id in self._cached.values():
            self._block_hash[block_id] = None
        self._cached.clear()
        return dropped

    # ---- internals ----
    def _evict(self, block_id: int) -> None:
        block_hash = self._block_hash[block_id]
        if block_hash is not None:
            del self._cached[block_hash]
            self._block_hash[block_id] = None

    def _check_id(self, block_id: int) -> int:
        if not isinstance(block_id, int) or not 0 <= block_id < self.num_blocks:
            raise ValueError(f"KV block id must be in [0, {self.num_blocks}), got {block_id!r}")
        return block_id
