"""Both cache kinds under one manager: MLA latent-KV blocks and KDA state slots, per request.

The manager is the only owner of "which request holds which block / slot". The scheduler asks it
to grow a request (`allocate_slots`), to give a request its state slot (`allocate_state_slot`),
to fork an n > 1 parent into its samples (`fork`) and to release everything (`free`).

Prefix caching (hybrid): `find_prefix_hit` finds the longest prefix whose KV blocks are cached
*and* that has a ready KDA checkpoint (checkpoint_pool.py), on the device or, with an offload
tier (offload.py), in host memory or on disk; `allocate_with_hit` shares the device blocks and
says which copies the worker must do (checkpoint slot -> request slot, and for a hit inside a
block, the checkpoint's tail block -> the request's new block) and which offloaded entries it
loads into the request's new blocks and state slot. With an offload tier, a cached block the
pool hands out again and a checkpoint the pool drops are stored there first. `reserve_checkpoint`
gets a slot for a state export at a position of a running request; `commit_checkpoints` makes
exports hit-able once the forward that writes them is done; `end_step` drops the step's pins.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

from kdaserve.core.block_pool import (
    NONE_HASH,
    BlockHash,
    BlockPool,
    hash_partial_block,
    hash_request_blocks,
)
from kdaserve.core.checkpoint_pool import Checkpoint, CheckpointPool
from kdaserve.core.offload import OffloadManager
from kdaserve.core.offload_index import CheckpointMeta
from kdaserve.core.sched_output import KDAStateCopy
from kdaserve.core.state_pool import StateSlotPool
from kdaserve.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass
class ForkResult:
    """What the worker must do before the children's first forward."""

    block_copies: list[tuple[int, int]]
    """(src_block, dst_block): each child but the last gets its own copy of the parent's
    partially filled last block (the last child inherits the original)."""
    state_copies: list[KDAStateCopy]
    """Parent slot -> each child's slot, for all children but the last (which inherits it)."""


@dataclass
class PrefixHit:
    """A usable prefix: KV of positions [0, num_tokens) and the KDA state after num_tokens."""

    num_tokens: int
    block_ids: list[int | None]
    """Cached full blocks covering [0, num_tokens // block_size * block_size): a device block to
    share, or None where the offload tier holds the block (the request's block_hashes entry)."""
    tail_block: int | None
    """For a hit inside a block on the device: the block whose first num_tokens % block_size
    tokens hold the KV (copied into the request's own block); None on a block multiple or when
    the offload tier holds that KV (tail_offloaded)."""
    checkpoint: Checkpoint | None
    """The device checkpoint, or None where the offload tier holds it."""
    key: BlockHash = b""
    """The checkpoint's key (the partial key for a hit inside a block)."""
    tail_offloaded: bool = False
    disk_items: list[tuple[str, BlockHash]] = field(default_factory=list)
    """Offloaded entries of the hit that are only on disk: read back first (promote)."""

    @property
    def offloaded(self) -> bool:
        return (self.checkpoint is None or self.tail_offloaded
                or any(b is None for b in self.block_ids))


@dataclass
class HitAllocation:
    new_block_ids: list[int]
    """Blocks appended after the shared ones (the first is the tail copy's destination)."""
    block_copy: tuple[int, int] | None
    """(tail_block, the request's block) for a hit inside a block."""
    state_copy_src: int | None
    """The checkpoint slot to copy into the request's state slot; None: the offload tier loads
    the state (load_state)."""


class KVCacheManager:
    def __init__(self, block_size: int, num_gpu_blocks: int, num_state_slots: int,
                 enable_prefix_caching: bool = False, max_model_len: int | None = None,
                 num_checkpoint_slots: int = 0, offload: OffloadManager | None = None) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.enable_prefix_caching = enable_prefix_caching
        self.offload = offload if enable_prefix_caching else None
        """The host / disk tier under the device prefix cache (None: none)."""
        self.block_pool = BlockPool(num_gpu_blocks, enable_caching=enable_prefix_caching,
                                    on_evict=self._on_blocks_evicted,
                                    on_reuse=self._on_block_reused if self.offload else None)
        self.state_pool = StateSlotPool(num_state_slots)
        # Checkpoint slot ids follow the request slot ids (same cache rows on the worker).
        self.checkpoint_pool = CheckpointPool(
            num_checkpoint_slots if enable_prefix_caching else 0, first_slot=num_state_slots,
            on_lru_evict=self._on_checkpoint_evicted)
        self._blocks: dict[str, list[int]] = {}
        self._slot: dict[str, int] = {}
        self._reserved_slots: dict[str, list[int]] = {}
        """Slots held for an n > 1 parent's future children (n - 1 of them)."""
        self._num_cached_blocks: dict[str, int] = {}
        self._step_pins: list[int] = []
        """Tail blocks that are copy sources this step (one reference each until end_step)."""

    # ---- accounting ----
    @property
    def num_gpu_blocks(self) -> int:
        return self.block_pool.num_blocks

    @property
    def num_state_slots(self) -> int:
        return self.state_pool.num_slots

    @property
    def num_free_blocks(self) -> int:
        return self.block_pool.num_free_blocks

    @property
    def num_free_slots(self) -> int:
        return self.state_pool.num_free_slots

    def get_block_ids(self, req_id: str) -> list[int]:
        """The request's MLA blocks in position order (a copy; [] if it holds none)."""
        return list(self._blocks.get(req_id, ()))

    def holds_resources(self, req_id: str) -> bool:
        return req_id in self._blocks or req_id in self._slot or req_id in self._reserved_slots

    # ---- KV blocks ----
    def _num_blocks(self, num_tokens: int, num_lookahead_tokens: int) -> int:
        """Blocks covering num_tokens plus the lookahead slots (those never past max_model_len)."""
        total = num_tokens + num_lookahead_tokens
        if self.max_model_len is not None:
            total = min(total, max(self.max_model_len, num_tokens))
        return cdiv(total, self.block_size)

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       num_lookahead_tokens: int = 0) -> list[int] | None:
        """Make room for positions [0, num_computed + num_new + lookahead) of the request.

        Returns the newly appended block ids ([] if it already had room), or None when there are
        not enough free blocks (nothing is allocated then). Lookahead slots are for a drafter
        that writes KV past the verified tokens; they never exceed max_model_len.
        """
        if num_new_tokens < 0 or num_lookahead_tokens < 0:
            raise ValueError(f"request {request.req_id!r}: num_new_tokens={num_new_tokens} and "
                             f"num_lookahead_tokens={num_lookahead_tokens} must be >= 0")
        num_tokens = request.num_computed_tokens + num_new_tokens
        have = len(self._blocks.get(request.req_id, ()))
        need = max(self._num_blocks(num_tokens, num_lookahead_tokens) - have, 0)
        if need > self.block_pool.num_free_blocks:
            return None
        new_blocks = self.block_pool.allocate(need) if need else []
        if new_blocks:
            self._blocks.setdefault(request.req_id, []).extend(new_blocks)
        if self.enable_prefix_caching:
            # Drafts may be rejected: only tokens that are known for sure get cached.
            num_known = min(num_tokens, request.num_tokens)
            if num_known // self.block_size > self._num_cached_blocks.get(request.req_id, 0):
                self._cache_full_blocks(request, num_known)
        return new_blocks

    def allocate_for_load(self, request: Request, num_tokens: int) -> list[int] | None:
        """Blocks for positions [0, num_tokens) of a request that holds none, whose KV a
        connector will write (a remote prefill's). They are not entered in the prefix cache
        until the request is scheduled after the load (allocate_slots does it then), so no
        other request can hit them before they hold their KV. None when too few are free."""
        if request.req_id in self._blocks:
            raise RuntimeError(f"request {request.req_id!r} already holds blocks")
        need = cdiv(num_tokens, self.block_size)
        if need > self.block_pool.num_free_blocks:
            return None
        blocks = self.block_pool.allocate(need)
        self._blocks[request.req_id] = list(blocks)
        return list(blocks)

    def _cache_full_blocks(self, request: Request, num_tokens: int) -> None:
        req_id = request.req_id
        hashes = self._hashes(request, num_tokens)
        blocks = self._blocks[req_id]
        start = self._num_cached_blocks.get(req_id, 0)
        end = min(num_tokens // self.block_size, len(blocks))
        for i in range(start, end):
            self.block_pool.cache_block(blocks[i], hashes[i])
        self._num_cached_blocks[req_id] = max(start, end)

    def _hashes(self, request: Request, num_tokens: int) -> list[BlockHash]:
        """Chained hashes of the full blocks of the request's first num_tokens tokens (kept on
        the request: its tokens are only ever appended)."""
        extra = (request.cache_salt,) if request.cache_salt is not None else None
        hashes = hash_request_blocks(request.all_token_ids, self.block_size,
                                     request.block_hashes, num_tokens, first_extra_keys=extra)
        return hashes[:num_tokens // self.block_size]

    def find_cached_kv_prefix(self, request: Request, max_tokens: int | None = None) -> list[int]:
        """Longest run of the request's leading full blocks in the prefix cache, within its first
        max_tokens tokens (default: all but the last). Takes no references."""
        if not self.enable_prefix_caching:
            return []
        max_tokens = request.num_tokens - 1 if max_tokens is None else max_tokens
        blocks = map(self.block_pool.get_cached_block, self._hashes(request, max_tokens))
        return list(itertools.takewhile(lambda b: b is not None, blocks))

    # ---- hybrid prefix hits ----
    def checkpoint_key(self, request: Request, num_tokens: int) -> tuple[BlockHash, BlockHash]:
        """(key, anchor) of a checkpoint after the request's first num_tokens tokens."""
        if not 0 < num_tokens <= request.num_tokens:
            raise ValueError(f"request {request.req_id!r}: checkpoint position {num_tokens} is "
                             f"outside (0, {request.num_tokens}]")
        j, r = divmod(num_tokens, self.block_size)
        hashes = self._hashes(request, num_tokens)
        anchor = hashes[j - 1] if j else NONE_HASH
        if r == 0:
            return anchor, anchor
        extra = (request.cache_salt,) if j == 0 and request.cache_salt is not None else None
        tokens = request.all_token_ids[j * self.block_size:num_tokens]
        return hash_partial_block(hashes[j - 1] if j else None, tokens, extra), anchor

    def find_prefix_hit(self, request: Request, max_tokens: int,
                        use_disk: bool = True) -> PrefixHit | None:
        """Longest prefix of at most max_tokens tokens with both its KV (cached blocks, plus the
        tail block for a position inside a block) and a ready KDA checkpoint, each on the device
        or in the offload tier (on disk only if use_disk). Takes nothing."""
        pool = self.checkpoint_pool
        if not self.enable_prefix_caching or pool.num_slots == 0 or max_tokens <= 0:
            return None
        off = self.offload
        hashes = self._hashes(request, max_tokens)
        blocks: list[int | None] = []
        for h in hashes:
            b = self.block_pool.get_cached_block(h)
            if b is None and self._tier_source("kv", h, use_disk) is None:
                break
            blocks.append(b)
        bs = self.block_size
        for j in range(len(blocks), -1, -1):
            anchor = hashes[j - 1] if j else NONE_HASH
            offsets = set(pool.partial_offsets(anchor))
            if off is not None:
                offsets |= off.partial_offsets(anchor)
            for r in sorted(offsets, reverse=True):
                if j * bs + r > max_tokens:
                    continue
                key, _ = self.checkpoint_key(request, j * bs + r)
                ckpt, tail = pool.get(key), self.block_pool.get_cached_block(key)
                if ((ckpt is not None or self._tier_source("state", key, use_disk))
                        and (tail is not None or self._tier_source("kv", key, use_disk))):
                    return self._hit(request, j * bs + r, blocks[:j], key, ckpt, tail)
            if j and (pool.get(anchor) is not None
                      or self._tier_source("state", anchor, use_disk)):
                return self._hit(request, j * bs, blocks[:j], anchor, pool.get(anchor), None)
        return None

    def _tier_source(self, kind: str, key: BlockHash, use_disk: bool) -> str | None:
        if self.offload is None:
            return None
        src = self.offload.source(kind, key)
        return None if src == "disk" and not use_disk else src

    def _hit(self, request: Request, num_tokens: int, blocks: list[int | None], key: BlockHash,
             ckpt: Checkpoint | None, tail: int | None) -> PrefixHit:
        hit = PrefixHit(num_tokens, blocks, tail, ckpt, key,
                        tail_offloaded=bool(num_tokens % self.block_size) and tail is None)
        if self.offload is not None and hit.offloaded:
            items = [("kv", request.block_hashes[j]) for j, b in enumerate(blocks) if b is None]
            if hit.tail_offloaded:
                items.append(("kv", key))
            if ckpt is None:
                items.append(("state", key))
            hit.disk_items = [it for it in items if self.offload.source(*it) == "disk"]
        return hit

    def allocate_with_hit(self, request: Request, hit: PrefixHit, num_new_tokens: int,
                          num_lookahead_tokens: int = 0) -> HitAllocation | None:
        """Give a request that holds no blocks the hit's blocks plus room for num_new_tokens
        (and lookahead) after it. None (nothing taken) when the free blocks do not suffice.
        The checkpoint and the tail block stay put until end_step (they are copy sources).
        Blocks the offload tier holds get new device blocks (entered in the prefix cache at
        once: the loads run before the forward) and loads; a hit with disk_items cannot be
        allocated (promote them first)."""
        req_id = request.req_id
        if req_id in self._blocks:
            raise RuntimeError(f"request {req_id!r} already holds blocks: cannot apply a hit")
        if num_new_tokens < 1:
            raise ValueError(f"request {req_id!r}: a hit needs num_new_tokens >= 1, "
                             f"got {num_new_tokens}")
        if hit.disk_items:
            raise RuntimeError(f"request {req_id!r}: the hit has entries on disk only")
        num_tokens = hit.num_tokens + num_new_tokens
        device = [b for b in hit.block_ids if b is not None]
        num_loaded = len(hit.block_ids) - len(device)
        num_new_blocks = self._num_blocks(num_tokens, num_lookahead_tokens) - len(device)
        pool = self.block_pool
        revived = {b for b in device if pool.ref_count(b) == 0}
        if hit.tail_block is not None and pool.ref_count(hit.tail_block) == 0:
            revived.add(hit.tail_block)
        if num_new_blocks + len(revived) > pool.num_free_blocks:
            return None
        off = self.offload
        loaded_hashes = [request.block_hashes[j] for j, b in enumerate(hit.block_ids)
                         if b is None]
        if off is not None:
            # Locked before any allocation: the stores it triggers must not evict them.
            for h in loaded_hashes:
                off.lock("kv", h)
            if hit.tail_offloaded:
                off.lock("kv", hit.key)
            if hit.checkpoint is None:
                off.lock("state", hit.key)
        pool.share(device)
        if hit.tail_block is not None:
            pool.share([hit.tail_block])
            self._step_pins.append(hit.tail_block)
        if hit.checkpoint is not None:
            self.checkpoint_pool.lock(hit.checkpoint.key)
        new_blocks = pool.allocate(num_new_blocks)
        load_blocks, new_blocks = new_blocks[:num_loaded], new_blocks[num_loaded:]
        for h, b in zip(loaded_hashes, load_blocks):
            off.load("kv", h, b)
            pool.cache_block(b, h)
        it = iter(load_blocks)
        blocks = [b if b is not None else next(it) for b in hit.block_ids]
        self._blocks[req_id] = blocks + new_blocks
        self._num_cached_blocks[req_id] = len(blocks)
        copy = (hit.tail_block, new_blocks[0]) if hit.tail_block is not None else None
        if hit.tail_offloaded:
            off.load("kv", hit.key, new_blocks[0])
        if off is not None and hit.offloaded:
            off.record_hit(hit.num_tokens, any(
                off.from_disk("kv", h) for h in loaded_hashes) or (
                hit.tail_offloaded and off.from_disk("kv", hit.key)) or (
                hit.checkpoint is None and off.from_disk("state", hit.key)))
        num_known = min(num_tokens, request.num_tokens)
        if num_known // self.block_size > len(blocks):
            self._cache_full_blocks(request, num_known)
        return HitAllocation(new_blocks, copy,
                             hit.checkpoint.slot if hit.checkpoint is not None else None)

    def load_state(self, hit: PrefixHit, slot: int) -> None:
        """The offload tier's checkpoint of the hit into the request's state slot (after
        allocate_with_hit, once the slot is allocated)."""
        self.offload.load("state", hit.key, slot)

    # ---- checkpoint export ----
    def reserve_checkpoint(self, request: Request, num_tokens: int) -> Checkpoint | None:
        """A checkpoint slot for the request's KDA state after num_tokens tokens, unless one is
        ready or pending already or no slot can be freed (None). The request must hold the
        blocks of those tokens; the checkpoint is pending until commit_checkpoints."""
        pool = self.checkpoint_pool
        if not self.enable_prefix_caching or pool.num_slots == 0:
            return None
        key, anchor = self.checkpoint_key(request, num_tokens)
        if pool.known(key):
            pool.touch(key)
            return None
        offset = num_tokens % self.block_size
        blocks = self._blocks.get(request.req_id, [])
        if len(blocks) < cdiv(num_tokens, self.block_size):
            raise RuntimeError(f"request {request.req_id!r} holds {len(blocks)} blocks: no KV "
                               f"for a checkpoint at {num_tokens} tokens")
        if anchor != NONE_HASH and self.block_pool.get_cached_block(anchor) is None:
            return None  # the chain is not cached: it could not be hit
        ckpt = pool.reserve(key, anchor, offset, num_tokens)
        if ckpt is not None and offset:
            self.block_pool.cache_partial(blocks[num_tokens // self.block_size], key)
        return ckpt

    def commit_checkpoints(self, keys: list[BlockHash]) -> None:
        """Make pending checkpoints hit-able (their forward is done)."""
        for key in keys:
            if self.checkpoint_pool.commit(key) is None:
                self.block_pool.uncache_partial(key)

    def end_step(self) -> None:
        """The step's copies are done: release copy-source pins and checkpoint locks (and the
        offload tier's: its stores are ready)."""
        pins, self._step_pins = self._step_pins, []
        self.block_pool.free(pins)
        self.checkpoint_pool.unlock_all()
        if self.offload is not None:
            self.offload.end_step()

    def reset_prefix_cache(self) -> int:
        """Forget every cached block hash and checkpoint. Returns how many hashes were dropped."""
        for ckpt in self.checkpoint_pool.evict_all():
            self.block_pool.uncache_partial(ckpt.key)
        return self.block_pool.reset_prefix_cache()

    def _on_blocks_evicted(self, hashes: list[BlockHash]) -> None:
        for ckpt in self.checkpoint_pool.drop_hashes(hashes):
            self._on_checkpoint_evicted(ckpt)

    def _on_checkpoint_evicted(self, ckpt: Checkpoint) -> None:
        """A ready checkpoint left the device pool (LRU, or with its blocks): with an offload
        tier its state goes there, and for a position inside a block the KV of its tail."""
        if self.offload is not None:
            self.offload.store("state", ckpt.key, ckpt.slot,
                               CheckpointMeta(ckpt.anchor, ckpt.offset, ckpt.num_tokens))
            tail = self.block_pool.get_cached_block(ckpt.key) if ckpt.offset else None
            if tail is not None:
                self.offload.store("kv", ckpt.key, tail)
        if ckpt.offset:
            self.block_pool.uncache_partial(ckpt.key)

    def _on_block_reused(self, block_id: int, full_hash: BlockHash | None,
                         partial_keys: list[BlockHash]) -> None:
        """A cached block is handed out again: its KV goes to the offload tier first (under
        its hash, and under each partial key whose checkpoint is ready)."""
        if full_hash is not None:
            self.offload.store("kv", full_hash, block_id)
        for key in partial_keys:
            if self.checkpoint_pool.get(key) is not None:
                self.offload.store("kv", key, block_id)

    # ---- KDA state slots ----
    def allocate_state_slot(self, request: Request, num_reserved: int = 0) -> int | None:
        """Give the request a state slot, plus `num_reserved` held for its future n > 1 children.
        Returns the slot, or None (nothing taken) when not enough are free."""
        req_id = request.req_id
        if req_id in self._slot:
            raise RuntimeError(f"request {req_id!r} already holds state slot {self._slot[req_id]}")
        if 1 + num_reserved > self.state_pool.num_free_slots:
            return None
        slot = self.state_pool.allocate()
        self._slot[req_id] = slot
        request.state_slot = slot
        if num_reserved:
            self._reserved_slots[req_id] = [self.state_pool.allocate() for _ in range(num_reserved)]
        return slot

    # ---- n > 1 ----
    def num_blocks_to_fork(self, parent: Request) -> int:
        return parent.num_samples - 1 if parent.num_computed_tokens % self.block_size else 0

    def fork(self, parent: Request, children: list[Request]) -> ForkResult | None:
        """Hand the parent's computed prefix to its children and drop the parent.

        Full blocks of the computed prefix are shared (ref count +1 per extra child). The partial
        last block (if any) and the parent's state slot go to the last child; every other child
        gets a fresh block copy and a reserved slot with a state copy. Returns None (nothing
        changed) when the copy blocks cannot be allocated.
        """
        pid = parent.req_id
        reserved = self._reserved_slots.get(pid, [])
        if len(children) != len(reserved) + 1 or pid not in self._slot:
            raise RuntimeError(f"fork of {pid!r}: {len(children)} children but "
                               f"{len(reserved)} reserved slots")
        num_computed = parent.num_computed_tokens
        num_full, rem = divmod(num_computed, self.block_size)
        blocks = self._blocks.get(pid, [])
        num_used = num_full + (1 if rem else 0)
        if len(blocks) < num_used:
            raise RuntimeError(f"fork of {pid!r}: {len(blocks)} blocks for {num_computed} tokens")
        num_copies = (len(children) - 1) if rem else 0
        if num_copies > self.block_pool.num_free_blocks:
            return None

        full, used = blocks[:num_full], blocks[:num_used]
        copy_blocks = self.block_pool.allocate(num_copies)
        result = ForkResult(block_copies=[], state_copies=[])
        parent_slot = self._slot.pop(pid)
        num_cached = min(self._num_cached_blocks.pop(pid, 0), num_full)
        for i, child in enumerate(children):
            cid = child.req_id
            if self.holds_resources(cid):
                raise RuntimeError(f"fork child {cid!r} already holds cache resources")
            if i == len(children) - 1:
                self._blocks[cid] = list(used)
                slot = parent_slot
            else:
                self.block_pool.share(full)
                self._blocks[cid] = list(full)
                if rem:
                    dst = copy_blocks[i]
                    self._blocks[cid].append(dst)
                    result.block_copies.append((blocks[num_full], dst))
                slot = reserved[i]
                result.state_copies.append(KDAStateCopy(src_slot=parent_slot, dst_slot=slot))
            self._slot[cid] = slot
            child.state_slot = slot
            self._num_cached_blocks[cid] = num_cached
        # Blocks past the computed prefix (drafter lookahead) were never written.
        self.block_pool.free(reversed(blocks[num_used:]))
        del self._blocks[pid]
        del self._reserved_slots[pid]
        parent.state_slot = None
        return result

    # ---- release ----
    def free(self, request: Request) -> None:
        """Release every block reference, the state slot and reserved slots of the request."""
        req_id = request.req_id
        blocks = self._blocks.pop(req_id, [])
        # Reverse order: the tail of a sequence is the least likely to be reused.
        self.block_pool.free(reversed(blocks))
        slot = self._slot.pop(req_id, None)
        if slot is not None:
            self.state_pool.free(slot)
        for reserved in self._reserved_slots.pop(req_id, []):
            self.state_pool.free(reserved)
        self._num_cached_blocks.pop(req_id, None)
        request.state_slot = None
