"""Hybrid prefix caching, the scheduler's side: where KDA checkpoints go, when a hit is taken.

Checkpoint positions (the state after p tokens of a request) are chosen here:
- every `checkpoint_interval` tokens (a multiple of block_size; 512 by default), as the request's
  chunks cross them, prefill or decode;
- with `kda_checkpoint_turn_end`: the end of the prompt and the position where the request
  finishes (its last computed token): any position, not only block multiples. That is where the
  next turn of a chat or an agent loop diverges (its prompt = this prompt + this answer + more).

Export (`kda_checkpoint_mode`):
- internal: a chunk exports every checkpoint it crosses from inside the same forward
  (SchedulerOutput.kda_checkpoint_exports; the worker's KDA kernels emit the states at those
  offsets); the prefill is never split for a checkpoint.
- split (baseline, vLLM's align mode): a prefill chunk that crosses a missing interval checkpoint
  is clipped to end at the last one, whose state is then the chunk's final state; the rest of
  the prompt costs one more forward.
A request that finishes exports through a state copy at the head of the next step's copies (its
slot is freed, but only reused by a request admitted in that step, whose copies come later).

Hits: a waiting request takes the longest prefix with cached KV and a ready checkpoint, leaving
at least one token to compute (logits); for an n > 1 parent, one token before its fork point.
"""

from __future__ import annotations

from kdaserve.config import CacheConfig
from kdaserve.core.block_pool import BlockHash
from kdaserve.core.kv_cache_manager import KVCacheManager, PrefixHit
from kdaserve.core.sched_output import (
    KDACheckpointExport,
    KDAStateCopy,
    SchedulerOutput,
)
from kdaserve.request import Request, RequestStatus

DEFAULT_NUM_CHECKPOINT_SLOTS = 64
"""Checkpoint slots when the cache config leaves it open and nothing sized it (CPU)."""


def resolve_num_checkpoint_slots(cache_config: CacheConfig,
                                 default: int = DEFAULT_NUM_CHECKPOINT_SLOTS) -> int:
    if not cache_config.enable_prefix_caching:
        return 0
    if cache_config.num_kda_checkpoint_slots is not None:
        return cache_config.num_kda_checkpoint_slots
    return default


class HybridPrefixCache:
    def __init__(self, kv: KVCacheManager, cache_config: CacheConfig) -> None:
        self.kv = kv
        self.enabled = cache_config.enable_prefix_caching and kv.checkpoint_pool.num_slots > 0
        self.interval = cache_config.checkpoint_interval
        self.split = cache_config.kda_checkpoint_mode == "split"
        self.turn_end = cache_config.kda_checkpoint_turn_end
        self.num_queries = 0
        """Tokens of admitted requests looked up in the cache (cumulative)."""
        self.num_hits = 0
        """Tokens served from the cache (cumulative)."""
        self._in_flight: list[BlockHash] = []
        """Checkpoints exported by the last scheduled step (committed after its forward)."""
        self._finish_copies: list[tuple[KDAStateCopy, BlockHash]] = []
        """Exports of requests that finished since the last schedule (copied next step)."""

    # ---- hits ----
    def find_hit(self, request: Request, max_tokens: int,
                 use_disk: bool = True) -> PrefixHit | None:
        if not self.enabled or request.num_computed_tokens:
            return None
        return self.kv.find_prefix_hit(request, max_tokens, use_disk)

    def record_admission(self, request: Request, hit: PrefixHit | None) -> None:
        if self.kv.enable_prefix_caching:
            self.num_queries += request.num_tokens
            self.num_hits += hit.num_tokens if hit is not None else 0

    # ---- where chunks end ----
    def split_chunk(self, request: Request, num_new: int) -> int:
        """Split baseline: end the chunk at the last interval checkpoint it would cross that
        is missing. Internal mode: num_new unchanged."""
        if not (self.enabled and self.split):
            return num_new
        start = request.num_computed_tokens
        last = min(start + num_new - 1, request.num_tokens)
        pos = last // self.interval * self.interval
        pool = self.kv.checkpoint_pool
        while pos > start:
            key, _ = self.kv.checkpoint_key(request, pos)
            if not pool.known(key):
                return pos - start
            pos -= self.interval
        return num_new

    # ---- exports ----
    def positions(self, request: Request, start: int, num_new: int) -> list[int]:
        """Checkpoint positions in (start, start + num_new] for this chunk (known tokens only:
        never a draft position)."""
        end = start + num_new
        last = min(end, request.num_tokens)
        first = (start // self.interval + 1) * self.interval
        positions = list(range(first, last + 1, self.interval))
        if self.split:
            positions = [p for p in positions if p == end]
        prompt_end = request.num_prompt_tokens
        if self.turn_end and start < prompt_end <= last and prompt_end not in positions:
            positions.append(prompt_end)
        return positions

    def plan_exports(self, request: Request, num_new: int, out: SchedulerOutput) -> None:
        """Schedule the chunk's checkpoint exports (call before num_computed_tokens advances)."""
        if not self.enabled:
            return
        for pos in self.positions(request, request.num_computed_tokens, num_new):
            ckpt = self.kv.reserve_checkpoint(request, pos)
            if ckpt is not None:
                out.kda_checkpoint_exports.append(
                    KDACheckpointExport(request.req_id, pos, ckpt.slot))
                self._in_flight.append(ckpt.key)

    def on_finish(self, request: Request) -> None:
        """A request finished (before its blocks and slot are freed): with turn-end
        checkpoints, keep its final state (the KV of its partial last block stays cached)."""
        if not (self.enabled and self.turn_end) or request.state_slot is None:
            return
        if request.status not in (RequestStatus.FINISHED_STOPPED,
                                  RequestStatus.FINISHED_LENGTH_CAPPED):
            return
        pos = request.num_computed_tokens
        if not 0 < pos <= request.num_tokens:
            return  # nothing computed, or accepted drafts past a stop (never appended)
        ckpt = self.kv.reserve_checkpoint(request, pos)
        if ckpt is not None:
            self._finish_copies.append(
                (KDAStateCopy(src_slot=request.state_slot, dst_slot=ckpt.slot), ckpt.key))

    # ---- step boundaries ----
    def begin_step(self, out: SchedulerOutput) -> None:
        """First thing in schedule(): the finished requests' exports lead the state copies.
        They are ready at once: a hit in this same step restores with a later copy in the
        list, so a chat's next turn hits its previous turn's final state."""
        copies, self._finish_copies = self._finish_copies, []
        out.state_copies.extend(copy for copy, _ in copies)
        keys = [key for _, key in copies]
        self.kv.commit_checkpoints(keys)
        # With an offload tier, locked for this step: evicted now, the tier would store the
        # slot before the copy above has written it.
        if self.kv.offload is not None:
            for key in keys:
                if self.kv.checkpoint_pool.get(key) is not None:
                    self.kv.checkpoint_pool.lock(key)

    def end_step(self) -> None:
        """First thing in update_from_output(): the forward is done, so the step's exports are
        ready to be hit and its copy sources are free to go."""
        keys, self._in_flight = self._in_flight, []
        self.kv.commit_checkpoints(keys)
        self.kv.end_step()
