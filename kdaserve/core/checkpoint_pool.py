"""KDA state checkpoints for hybrid prefix caching: a pool of slots and the key -> slot index.

A prefix-cache hit on a hybrid model needs two things at the hit position p: the MLA KV of
positions [0, p) (shared blocks, block_pool.py) and every KDA layer's state after exactly p tokens
(fp32 recurrent [H, K, V] + conv window). A *checkpoint* is that KDA state, held in a checkpoint
slot: extra rows of the same cache tensors as the request state slots (the worker allocates
`num_state_slots + num_checkpoint_slots` rows; checkpoint slot ids follow the request slot ids,
so a restore or an export is a plain state-row copy).

Keys. A checkpoint is keyed by the chained block hashes of the tokens before it:
- p on a block multiple (p = j * block_size): the hash of block j - 1 (its *anchor*).
- p inside block j (p = j * block_size + r, 0 < r < block_size): a partial key
  `hash_partial_block(hash of block j - 1, tokens[j*bs : p])`; the anchor is block j - 1's hash
  (NONE_HASH for j = 0). The partial block's KV is not copied anywhere at export: the exporting
  request's own block j holds positions [j*bs, p) and never rewrites them (it only writes
  positions >= p), so the partial key is registered on that physical block in the block pool.
  The block then counts as cached: freed blocks stay in LRU order, and a hit copies its first r
  tokens into the hitting request's own new block (copy-on-write, SchedulerOutput.block_copies).

Lifetime. A checkpoint is *pending* from the step that schedules its export until the step's
forward is done (the scheduler commits it in update_from_output); only *ready* checkpoints can be
hit. Ready checkpoints are evicted LRU when an export needs a slot and none is free, and are
dropped when a block they depend on is handed out again (the block pool reports the lost hashes:
a checkpoint dies with its anchor block or, for a partial one, with its tail block). Checkpoints
restored from in the current step are locked (never evicted before the copy ran).
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from kdaserve.core.block_pool import BlockHash


@dataclass
class Checkpoint:
    key: BlockHash
    anchor: BlockHash
    """Hash of the last full block before the position (NONE_HASH when there is none)."""
    offset: int
    """position % block_size: 0 on a block multiple (then key == anchor)."""
    num_tokens: int
    """The position: the state after this many tokens."""
    slot: int


class CheckpointPool:
    def __init__(self, num_slots: int, first_slot: int,
                 on_lru_evict: Callable[[Checkpoint], None] | None = None) -> None:
        if num_slots < 0:
            raise ValueError(f"num_kda_checkpoint_slots must be >= 0, got {num_slots}")
        if first_slot < 0:
            raise ValueError(f"first checkpoint slot id must be >= 0, got {first_slot}")
        self.num_slots = num_slots
        self.first_slot = first_slot
        self.on_lru_evict = on_lru_evict
        """Called with a checkpoint evicted to make room (to unregister its partial key)."""
        self._free: list[int] = list(range(first_slot, first_slot + num_slots))  # min-heap
        self._ready: OrderedDict[BlockHash, Checkpoint] = OrderedDict()  # front = LRU
        self._pending: dict[BlockHash, Checkpoint] = {}
        self._dead: set[BlockHash] = set()
        """Pending checkpoints whose blocks were lost before they were committed."""
        self._by_anchor: dict[BlockHash, set[BlockHash]] = {}
        """anchor -> keys of ready checkpoints on it (partial offsets are read from them)."""
        self._locked: set[BlockHash] = set()
        self.num_exports = 0
        """Checkpoints committed since the pool was created."""

    # ---- accounting ----
    @property
    def num_free_slots(self) -> int:
        return len(self._free)

    @property
    def num_ready(self) -> int:
        return len(self._ready)

    def owns_slot(self, slot: int) -> bool:
        return self.first_slot <= slot < self.first_slot + self.num_slots

    # ---- lookup ----
    def get(self, key: BlockHash) -> Checkpoint | None:
        """A ready checkpoint (pending ones cannot be hit yet)."""
        return self._ready.get(key)

    def known(self, key: BlockHash) -> bool:
        """Ready or pending: no need to export it again."""
        return key in self._ready or (key in self._pending and key not in self._dead)

    def partial_offsets(self, anchor: BlockHash) -> list[int]:
        """Distinct in-block offsets (> 0) of ready checkpoints on this anchor, largest first."""
        offsets = {self._ready[k].offset for k in self._by_anchor.get(anchor, ())}
        offsets.discard(0)
        return sorted(offsets, reverse=True)

    def touch(self, key: BlockHash) -> None:
        if key in self._ready:
            self._ready.move_to_end(key)

    def lock(self, key: BlockHash) -> None:
        """Keep a ready checkpoint until unlock_all (it is a copy source this step)."""
        if key not in self._ready:
            raise RuntimeError("cannot lock a checkpoint that is not ready")
        self._locked.add(key)
        self.touch(key)

    def unlock_all(self) -> None:
        self._locked.clear()

    # ---- export ----
    def reserve(self, key: BlockHash, anchor: BlockHash, offset: int,
                num_tokens: int) -> Checkpoint | None:
        """A slot for a new checkpoint (pending until commit). Evicts the least recently used
        unlocked ready checkpoint when no slot is free; None when nothing can be evicted."""
        if self.known(key):
            raise RuntimeError(f"checkpoint at {num_tokens} tokens is already ready or pending")
        if not self._free and not self._evict_lru():
            return None
        self._dead.discard(key)
        ckpt = Checkpoint(key, anchor, offset, num_tokens, heapq.heappop(self._free))
        self._pending[key] = ckpt
        return ckpt

    def commit(self, key: BlockHash) -> Checkpoint | None:
        """Pending -> ready (most recently used). A checkpoint that lost its blocks meanwhile is
        freed instead; returns None then."""
        ckpt = self._pending.pop(key)
        if key in self._dead:
            self._dead.discard(key)
            heapq.heappush(self._free, ckpt.slot)
            return None
        self._ready[key] = ckpt
        self._by_anchor.setdefault(ckpt.anchor, set()).add(key)
        self.num_exports += 1
        return ckpt

    # ---- eviction ----
    def drop_hashes(self, hashes: Iterable[BlockHash]) -> list[Checkpoint]:
        """Blocks lost these hashes: drop every checkpoint keyed or anchored on one of them.
        Returns the dropped ready checkpoints (their slots are free again)."""
        dropped = []
        for h in hashes:
            if h in self._pending:
                self._dead.add(h)
            keys = set(self._by_anchor.get(h, ()))
            if h in self._ready:
                keys.add(h)
            dropped += [self._remove(key) for key in keys]
            for ckpt in self._pending.values():
                if ckpt.anchor == h:
                    self._dead.add(ckpt.key)
        return dropped

    def evict_all(self) -> list[Checkpoint]:
        """Drop every ready checkpoint and doom the pending ones (prefix-cache reset)."""
        self._dead.update(self._pending)
        return [self._remove(key) for key in list(self._ready)]

    def _evict_lru(self) -> Checkpoint | None:
        for key in self._ready:
            if key not in self._locked:
                ckpt = self._remove(key)
                if self.on_lru_evict is not None:
                    self.on_lru_evict(ckpt)
                return ckpt
        return None

    def _remove(self, key: BlockHash) -> Checkpoint:
        ckpt = self._ready.pop(key)
        keys = self._by_anchor.get(ckpt.anchor)
        if keys is not None:
            keys.discard(key)
            if not keys:
                del self._by_anchor[ckpt.anchor]
        self._locked.discard(key)
        heapq.heappush(self._free, ckpt.slot)
        return ckpt
