"""Both cache kinds under one manager: MLA latent-KV blocks and KDA state slots, per request.

The manager is the only owner of "which request holds which block / slot". The scheduler asks it
to grow a request (`allocate_slots`), to give a request its state slot (`allocate_state_slot`),
to fork an n > 1 parent into its samples (`fork`) and to release everything (`free`).
"""

from __future__ import annotations

from dataclasses import dataclass

from kdaserve.core.block_pool import BlockHash, BlockPool, hash_request_blocks
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


class KVCacheManager:
    def __init__(self, block_size: int, num_gpu_blocks: int, num_state_slots: int,
                 enable_prefix_caching: bool = False, max_model_len: int | None = None) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.enable_prefix_caching = enable_prefix_caching
        self.block_pool = BlockPool(num_gpu_blocks, enable_caching=enable_prefix_caching)
        self.state_pool = StateSlotPool(num_state_slots)
        self._blocks: dict[str, list[int]] = {}
        self._slot: dict[str, int] = {}
        self._reserved_slots: dict[str, list[int]] = {}
        """Slots held for an n > 1 parent's future children (n - 1 of them)."""
        self._block_hashes: dict[str, list[BlockHash]] = {}
        self._num_cached_blocks: dict[str, int] = {}

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

    @property
    def usage(self) -> float:
        """MLA KV block usage in [0, 1]."""
        return self.block_pool.usage

    def get_block_ids(self, req_id: str) -> list[int]:
        """The request's MLA blocks in position order (a copy; [] if it holds none)."""
        return list(self._blocks.get(req_id, ()))

    def get_state_slot(self, req_id: str) -> int | None:
        return self._slot.get(req_id)

    def holds_resources(self, req_id: str) -> bool:
        return req_id in self._blocks or req_id in self._slot or req_id in self._reserved_slots

    # ---- KV blocks ----
    def num_blocks_to_allocate(self, request: Request, num_new_tokens: int,
                               num_lookahead_tokens: int = 0) -> int:
        num_tokens = request.num_computed_tokens + num_new_tokens
        total = num_tokens + num_lookahead_tokens
        if self.max_model_len is not None:
            total = min(total, max(self.max_model_len, num_tokens))
        have = len(self._blocks.get(request.req_id, ()))
        return max(cdiv(total, self.block_size) - have, 0)

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
        need = self.num_blocks_to_allocate(request, num_new_tokens, num_lookahead_tokens)
        if need > self.block_pool.num_free_blocks:
            return None
        new_blocks = self.block_pool.allocate(need) if need else []
        if new_blocks:
            self._blocks.setdefault(request.req_id, []).extend(new_blocks)
        if self.enable_prefix_caching:
            # Drafts may be rejected: only tokens that are known for sure get cached.
            num_tokens = min(request.num_computed_tokens + num_new_tokens, request.num_tokens)
            if num_tokens // self.block_size > self._num_cached_blocks.get(request.req_id, 0):
                self._cache_full_blocks(request, num_tokens)
        return new_blocks

    def _cache_full_blocks(self, request: Request, num_tokens: int) -> None:
        req_id = request.req_id
        hashes = hash_request_blocks(request.all_token_ids, self.block_size,
                                     self._block_hashes.setdefault(req_id, []), num_tokens)
        blocks = self._blocks[req_id]
        start = self._num_cached_blocks.get(req_id, 0)
        end = min(num_tokens // self.block_size, len(blocks))
        for i in range(start, end):
            self.block_pool.cache_block(blocks[i], hashes[i])
        self._num_cached_blocks[req_id] = max(start, end)

    def find_cached_kv_prefix(self, request: Request) -> list[int]:
        """Longest run of the request's leading full blocks already in the prefix cache (at least
        one prompt token is left out so logits can be computed). Takes no references.

        KV side only: a hit is usable only together with a KDA state checkpoint at the same
        boundary, which is not implemented yet, so the scheduler does not call this.
        """
        if not self.enable_prefix_caching:
            return []
        hashes = hash_request_blocks(request.all_token_ids, self.block_size, [],
                                     request.num_tokens - 1)
        hit = []
        for block_hash in hashes:
            block_id = self.block_pool.get_cached_block(block_hash)
            if block_id is None:
                break
            hit.append(block_id)
        return hit

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
        num_children = parent.num_samples
        partial = parent.num_computed_tokens % self.block_size != 0
        return (num_children - 1) if partial else 0

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
        hashes = self._block_hashes.pop(pid, [])
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
            self._block_hashes[cid] = list(hashes[:num_full])
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
        self._block_hashes.pop(req_id, None)
        self._num_cached_blocks.pop(req_id, None)
        request.state_slot = None
