"""The scheduler: one token-budget rule for prefill, chunked prefill, decode and spec verification.

Each step every request gets `min(num_tokens_with_spec - num_computed_tokens, budgets)` new
tokens: RUNNING requests first, then WAITING ones, both first-come first-served. When KV blocks run
out the newest running request is preempted by recompute (everything freed, back to the front of
the waiting queue) and no waiting request is admitted in that step.

Budgets (vLLM #51725): `token_budget` counts target tokens; `input_budget` counts target tokens
plus `draft_slots` per *scheduled* request (the drafter's extra query slots, K - 1 with K
speculative tokens). The old static rule (`adaptive_spec_budget=False`) instead reserves
`draft_slots * max_num_seqs` up front, whatever the number of requests.

n > 1: a parent request prefills `prompt_len - 1` tokens, then is forked into n children that share
its full KV blocks (ref counts), copy its partial last block and its KDA state (`block_copies`,
`state_copies` in the SchedulerOutput), and each compute the last prompt token on their own.

Prefix caching (prefix_cache.py): a waiting request starts at the longest prefix with cached KV
blocks and a ready KDA checkpoint (num_computed_tokens > 0 at its first schedule, the state
restored by a state copy); chunks export checkpoints as they cross the chosen positions. With
an offload tier (offload.py) the prefix may come from host memory (loads into the request's
new blocks and slot) or disk: a request whose hit needs entries only on disk is passed over,
kept in order, until their reads into host memory finish.

Async scheduling under speculation (`async_spec`, set by the engine when the worker proposes
drafts on the device): step N+1 is scheduled before step N's accepted counts reach the host.
A request that samples in step N is given K placeholder drafts (DRAFT_PLACEHOLDER) at once, and
`num_output_placeholders` counts the worst case of the step in flight (1 + its drafts), so the
one rule above schedules it 1 + K tokens in step N+1: `num_computed_tokens` runs ahead of the
truth by step N's rejected drafts (optimistic), blocks are allocated for that worst case, and
the worker builds the real positions on the device from step N's accepted counts. When step N's
output arrives, `update_from_output` rolls num_computed_tokens back by the rejected drafts (the
same rule as one step at a time) and takes 1 + drafts off the placeholders; a stop found there
frees the request at once and the output of its step N+1 is dropped. Blocks allocated for the
worst case stay with the request (it grows into them) and go back when it finishes. Requests
with penalties / logit_bias or a grammar get no placeholders (never drafted, or drafts checked
on the host): the engine runs those steps one at a time.

KV connector (prefill/decode disaggregation, kdaserve.disagg; optional): a request whose prompt
state comes from a remote prefill gets that prefill's first token as its first output when it
is added, then at admission takes blocks and a state slot for the load and waits outside the
queues until the worker reports the load; done, it goes back to the front of the waiting queue
with its prompt computed (failed: everything freed, it recomputes). A finished request the
connector holds for a remote reader keeps its blocks and slot until the reader acknowledges or
the hold expires. A request aborted during its load is freed when the load ends (the transfer
still writes into its blocks until then).

Call order (the engine): `add_request` ... then per step `schedule()` -> worker ->
`update_from_output()`; `finish_requests()` at any time (stop strings, aborts).

Worker contract for one SchedulerOutput: drop `finished_req_ids` and `preempted_req_ids`; apply
`block_copies` and then `state_copies`, each in list order, before the forward (their
destinations may belong to requests the worker has not seen yet); a new request with
`num_computed_tokens == 0` starts from a zero KDA state, one with `num_computed_tokens > 0` (a
forked sample or a prefix hit) continues from its slot as is (after the copies); write each
`kda_checkpoint_exports` entry's state into its slot during the forward; sample only for
requests whose `num_computed_tokens + num_scheduled_tokens` reaches prompt + outputs (+ drafts);
return [] for the others.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from kdaserve.config import CacheConfig, SchedulerConfig, SpeculativeConfig
from kdaserve.core.engine_output import EngineCoreOutput, SchedulerStats
from kdaserve.core.kv_cache_manager import KVCacheManager, PrefixHit, cdiv
from kdaserve.core.offload import OffloadManager
from kdaserve.core.prefix_cache import HybridPrefixCache, resolve_num_checkpoint_slots
from kdaserve.core.sched_output import (
    CachedRequestData,
    KDAStateCopy,
    DRAFT_PLACEHOLDER,
    KVConnectorOutput,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
)
from kdaserve.request import Request, RequestStatus

if TYPE_CHECKING:
    from kdaserve.disagg.base import ConnectorScheduler

# Proposers that write their own KV past the verified tokens need lookahead slots.
_NO_LOOKAHEAD_METHODS = ("ngram",)
# update_from_output takes tokens for these (PREEMPTED: preempted while its step was in flight).
_TAKES_OUTPUT = (RequestStatus.RUNNING, RequestStatus.PREEMPTED)


class Scheduler:
    def __init__(
        self,
        scheduler_config: SchedulerConfig,
        cache_config: CacheConfig,
        num_gpu_blocks: int,
        num_state_slots: int,
        speculative_config: SpeculativeConfig | None = None,
        max_model_len: int | None = None,
        connector: ConnectorScheduler | None = None,
        decode_context_parallel_size: int = 1,
        offload: OffloadManager | None = None,
    ) -> None:
        """num_gpu_blocks: MLA KV blocks (each rank's count). With decode context parallelism
        of size n, each block of a request's table holds cache_config.block_size tokens on each
        of the n ranks, so the scheduler's blocks (and prefix-cache hashes) cover
        n * block_size tokens: n times the token capacity of the same cache memory."""
        if decode_context_parallel_size < 1:
            raise ValueError(f"decode_context_parallel_size must be >= 1, got "
                             f"{decode_context_parallel_size}")
        self.max_model_len = max_model_len or scheduler_config.max_model_len
        self.max_num_seqs = scheduler_config.max_num_seqs
        self.max_num_batched_tokens = scheduler_config.max_num_batched_tokens
        self.long_prefill_token_threshold = scheduler_config.long_prefill_token_threshold
        self.enable_chunked_prefill = scheduler_config.enable_chunked_prefill
        self.block_size = cache_config.block_size * decode_context_parallel_size
        """Tokens per scheduler block (logical; attention/dcp.py's layout under DCP)."""

        spec = speculative_config
        spec_on = spec is not None and spec.enabled
        self.num_spec_tokens = spec.num_speculative_tokens if spec_on else 0
        self.draft_slots = max(self.num_spec_tokens - 1, 0)
        """Extra query slots the drafter needs per scheduled request."""
        self.num_lookahead_tokens = (
            self.num_spec_tokens if spec_on and spec.method not in _NO_LOOKAHEAD_METHODS else 0)
        self.adaptive_spec_budget = scheduler_config.adaptive_spec_budget
        if self.adaptive_spec_budget:
            self.max_num_scheduled_tokens = self.max_num_batched_tokens
            self._draft_charge = self.draft_slots
        else:
            self.max_num_scheduled_tokens = (
                self.max_num_batched_tokens - self.draft_slots * self.max_num_seqs)
            self._draft_charge = 0
        self._check_config(num_gpu_blocks)

        self.kv_cache_manager = KVCacheManager(
            self.block_size, num_gpu_blocks, num_state_slots,
            enable_prefix_caching=cache_config.enable_prefix_caching,
            max_model_len=self.max_model_len,
            num_checkpoint_slots=resolve_num_checkpoint_slots(cache_config), offload=offload)
        self.offload = self.kv_cache_manager.offload
        self.prefix_cache = HybridPrefixCache(self.kv_cache_manager, cache_config)
        self.requests: dict[str, Request] = {}
        """Unfinished requests by id (a forked parent is replaced by its children)."""
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self._children: dict[str, list[str]] = {}
        """n > 1 parent id -> its children's ids, from add_request until all are finished."""
        self._child_ids: set[str] = set()
        """Every id in _children's values: reserved even before the fork creates them."""
        self._unsent: set[str] = set()
        """Forked children the worker has not seen yet (they go out as NewRequestData)."""
        self._finished_req_ids: set[str] = set()
        self.num_preemptions = 0
        self.async_spec = False
        """Set by the engine: the worker proposes drafts on the device, so a request that
        samples gets placeholder drafts for the next step at once (see the module doc)."""
        self.connector = connector
        self._loading: dict[str, tuple[Request, int]] = {}
        """Requests whose prompt state is being loaded -> the tokens the load brings."""
        self._loaded: set[str] = set()
        """Loaded requests back in the waiting queue (they hold their blocks and slot)."""
        self._held: dict[str, Request] = {}
        """Finished requests whose blocks and slot the connector holds for a remote reader."""
        self._pending_outputs: list[EngineCoreOutput] = []
        """Outputs made outside a step (a remote prefill's first token), sent with the next."""
        self.grammar_ready: Callable[[Request], bool] | None = None
        """Set by the engine: False while a waiting structured-output request's grammar is
        still compiling (it is passed over, not blocking the queue). None: all are ready."""

    def _check_config(self, num_gpu_blocks: int) -> None:
        if self.max_num_scheduled_tokens <= 0:
            raise ValueError(
                f"static spec budget max_num_batched_tokens={self.max_num_batched_tokens} - "
                f"draft_slots={self.draft_slots} * max_num_seqs={self.max_num_seqs} leaves "
                f"{self.max_num_scheduled_tokens} tokens; raise max_num_batched_tokens or use the "
                "adaptive budget")
        if self.max_num_batched_tokens <= self.draft_slots:
            raise ValueError(
                f"max_num_batched_tokens={self.max_num_batched_tokens} must exceed the "
                f"{self.draft_slots} draft slots of one request")
        if cdiv(self.max_model_len, self.block_size) > num_gpu_blocks:
            raise ValueError(
                f"num_gpu_blocks={num_gpu_blocks} (block_size={self.block_size}) cannot hold one "
                f"sequence of max_model_len={self.max_model_len}; lower max_model_len or give "
                "the KV cache more blocks")
        per_step = self.max_num_scheduled_tokens - self._draft_charge
        if not self.enable_chunked_prefill and per_step < self.max_model_len:
            raise ValueError(
                f"without chunked prefill one step must fit a max_model_len={self.max_model_len} "
                f"prompt, but only {per_step} tokens fit (max_num_batched_tokens="
                f"{self.max_num_batched_tokens})")

    # ------------------------------------------------------------------ requests in / out
    def add_request(self, request: Request) -> None:
        """Queue a request (status WAITING). An n > 1 request with a one-token prompt has no
        prefix to share, so its n children are queued directly."""
        if request.status != RequestStatus.WAITING or request.num_computed_tokens:
            raise ValueError(f"request {request.req_id!r} is not fresh: {request!r}")
        if request.num_prompt_tokens > self.max_model_len:
            raise ValueError(
                f"request {request.req_id!r}: prompt of {request.num_prompt_tokens} tokens "
                f"exceeds max_model_len={self.max_model_len}")
        n = request.num_samples
        if n > min(self.max_num_seqs, self.kv_cache_manager.num_state_slots):
            raise ValueError(
                f"request {request.req_id!r}: n={n} exceeds max_num_seqs={self.max_num_seqs} "
                f"or num_state_slots={self.kv_cache_manager.num_state_slots}")
        if n > 1:
            fork_tokens = request.num_prompt_tokens - 1
            fork_blocks = cdiv(fork_tokens, self.block_size) + (
                n - 1 if fork_tokens % self.block_size else 0)
            if fork_blocks > self.kv_cache_manager.num_gpu_blocks:
                raise ValueError(
                    f"request {request.req_id!r}: forking n={n} samples of a "
                    f"{request.num_prompt_tokens}-token prompt needs {fork_blocks} KV blocks, "
                    f"more than num_gpu_blocks={self.kv_cache_manager.num_gpu_blocks}")
        child_ids = [request.child_req_id(i) for i in range(n)] if n > 1 else []
        for rid in [request.req_id] + child_ids:
            if rid in self.requests or rid in self._children or rid in self._child_ids:
                raise ValueError(f"request id {rid!r} is already in use")
        if self.connector is not None and n == 1 and self._take_remote_first_token(request):
            return
        new = [request]
        if n > 1:
            self._children[request.req_id] = child_ids
            self._child_ids.update(child_ids)
            if request.num_prompt_tokens == 1:
                new = [request.make_child(i) for i in range(n)]
        for r in new:
            self.requests[r.req_id] = r
            self.waiting.append(r)

    def _take_remote_first_token(self, request: Request) -> bool:
        """Append the first token a remote prefill sampled (reported with the next step's
        outputs). True if that token already finishes the request (it is not queued)."""
        first = self.connector.on_new_request(request)
        if first is None:
            return False
        request.append_output_token_ids(first)
        status = self._check_stop(request)
        if status is not None:
            request.status = status
            self.connector.request_finished(request, [], None)
        self._pending_outputs.append(EngineCoreOutput(
            req_id=request.req_id, new_token_ids=[first], finish_reason=request.finish_reason,
            stop_reason=request.stop_reason))
        return status is not None

    def finish_requests(self, req_ids: str | Iterable[str],
                        finished_status: RequestStatus) -> None:
        """Finish requests from outside (stop string: FINISHED_STOPPED, abort:
        FINISHED_ABORTED), whatever their state. Frees their blocks and slots now and reports
        them in the next SchedulerOutput.finished_req_ids. A forked n > 1 parent id finishes all
        its unfinished children. Unknown or already finished ids are ignored."""
        if not RequestStatus.is_finished(finished_status):
            raise ValueError(f"finished_status must be a FINISHED_* status, got {finished_status!r}")
        if isinstance(req_ids, str):
            req_ids = [req_ids]
        to_finish = {cid: self.requests[cid] for rid in req_ids
                     for cid in [rid] + self._children.get(rid, []) if cid in self.requests}
        if not to_finish:
            return
        self.running = [r for r in self.running if r.req_id not in to_finish]
        self.waiting = deque(r for r in self.waiting if r.req_id not in to_finish)
        for request in to_finish.values():
            request.status = finished_status
            self._free_request(request)

    def _free_request(self, request: Request) -> dict | None:
        """Release a finished request (already out of running/waiting) and forget it. Returns
        the connector's kv_transfer_params for the client (None without)."""
        self.prefix_cache.on_finish(request)
        params = None
        self._loaded.discard(request.req_id)
        if request.req_id in self._loading:
            pass    # its load still writes into its blocks: freed when the load ends
        elif self.connector is not None:
            kv = self.kv_cache_manager
            hold, params = self.connector.request_finished(
                request, kv.get_block_ids(request.req_id), request.state_slot)
            if hold:
                self._held[request.req_id] = request
            else:
                kv.free(request)
        else:
            self.kv_cache_manager.free(request)
        self._finished_req_ids.add(request.req_id)
        self._unsent.discard(request.req_id)
        del self.requests[request.req_id]
        # An unforked parent's children will never exist; a child may be the last of its kind.
        parent = request.req_id if request.is_fork_parent else request.parent_req_id
        if parent in self._children and all(
                cid not in self.requests for cid in self._children[parent]):
            self._child_ids.difference_update(self._children.pop(parent))
        return params

    # ------------------------------------------------------------------ schedule
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        token_budget = self.max_num_scheduled_tokens
        input_budget = (self.max_num_batched_tokens if self.adaptive_spec_budget
                        else self.max_num_scheduled_tokens)
        charge = self._draft_charge
        scheduled: list[Request] = []
        new_blocks: dict[str, list[int]] = {}
        preempted: list[Request] = []
        self.prefix_cache.begin_step(out)
        if self.connector is not None:
            for rid in self.connector.take_expired():
                held = self._held.pop(rid, None)
                if held is not None:
                    self.kv_cache_manager.free(held)

        # RUNNING first, oldest first.
        i = 0
        while i < len(self.running) and token_budget > 0 and input_budget > charge:
            request = self.running[i]
            if request.is_fork_parent and request.num_computed_tokens >= self._target(request):
                if not self._fork(i, out, preempted):
                    break  # the parent itself was preempted
                request = self.running[i]
            num_new = self._num_new_tokens(request, token_budget, input_budget - charge)
            if num_new == 0:
                i += 1
                continue
            num_new = self.prefix_cache.split_chunk(request, num_new)
            blocks = self._allocate_or_preempt(request, num_new, preempted, scheduled)
            if blocks is None:
                break  # the request itself was preempted: nothing newer is left
            new_blocks[request.req_id] = blocks
            out.num_scheduled_tokens[request.req_id] = num_new
            token_budget -= num_new
            input_budget -= num_new + charge
            scheduled.append(request)
            i += 1

        # WAITING next, FCFS, only if nobody was preempted this step.
        if not preempted:
            num_seqs = sum(self._weight(r) for r in self.running)
            skipped: list[Request] = []   # waiting for a grammar or a disk read: kept in order
            while self.waiting and token_budget > 0 and input_budget > charge:
                request = self.waiting[0]
                if self._waits_for_grammar(request):
                    skipped.append(self.waiting.popleft())
                    continue
                if request.num_output_placeholders:
                    break  # preempted with a token in flight: re-admit it once it has landed
                weight = self._weight(request)
                if num_seqs + weight > self.max_num_seqs:
                    break
                loaded = request.req_id in self._loaded   # holds its blocks and slot
                if not loaded and self.kv_cache_manager.num_free_slots < weight:
                    break
                num_external = (self.connector.get_num_new_matched_tokens(request)
                                if self.connector is not None and not loaded else 0)
                if num_external:
                    if not self._start_load(request, num_external):
                        break
                    self.waiting.popleft()
                    continue
                base = request.num_computed_tokens if loaded else 0
                hit = None if loaded else self.prefix_cache.find_hit(
                    request, self._target(request) - 1)
                if hit is not None and hit.disk_items:
                    if self.offload.promote(hit.disk_items):
                        skipped.append(self.waiting.popleft())
                        continue
                    hit = self.prefix_cache.find_hit(request, self._target(request) - 1,
                                                     use_disk=False)
                request.num_computed_tokens = hit.num_tokens if hit is not None else base
                num_new = self._num_new_tokens(request, token_budget, input_budget - charge)
                remaining = self._target(request) - request.num_computed_tokens
                if num_new == 0 or (not self.enable_chunked_prefill and num_new < remaining):
                    request.num_computed_tokens = base
                    break
                num_new = self.prefix_cache.split_chunk(request, num_new)
                blocks = (self.kv_cache_manager.allocate_slots(request, num_new,
                                                               self.num_lookahead_tokens)
                          if loaded else self._allocate_waiting(request, hit, num_new, out))
                if blocks is None:
                    request.num_computed_tokens = base
                    break
                self.waiting.popleft()
                self._loaded.discard(request.req_id)
                self.running.append(request)
                request.status = RequestStatus.RUNNING
                if request.num_preemptions == 0:
                    request.num_cached_tokens = request.num_computed_tokens
                self.prefix_cache.record_admission(request, hit)
                self._unsent.add(request.req_id)
                num_seqs += weight
                new_blocks[request.req_id] = blocks
                out.num_scheduled_tokens[request.req_id] = num_new
                token_budget -= num_new
                input_budget -= num_new + charge
                scheduled.append(request)
            self.waiting.extendleft(reversed(skipped))

        self._build_output(out, scheduled, new_blocks, preempted)
        return out

    def _start_load(self, request: Request, num_external: int) -> bool:
        """Blocks for the request's known tokens (the remote prompt and the first token) and a
        state slot, handed to the connector for its load. False (nothing taken) when the
        blocks do not suffice."""
        kv = self.kv_cache_manager
        blocks = kv.allocate_for_load(request, request.num_tokens)
        if blocks is None:
            return False
        slot = kv.allocate_state_slot(request)
        self.connector.update_state_after_alloc(request, blocks, slot, num_external)
        self._loading[request.req_id] = (request, num_external)
        return True

    def _update_from_connector(self, output: KVConnectorOutput) -> None:
        """Apply the workers' report: free what remote readers are done with; loaded
        requests go back to the front of the waiting queue (in their order), computed up to
        the loaded tokens, or, when their load failed, holding nothing (recompute)."""
        kv = self.kv_cache_manager
        for rid in output.finished_sending:
            held = self._held.pop(rid, None)
            if held is not None:
                kv.free(held)
        ended = [rid for rid in self._loading
                 if rid in output.finished_recving or rid in output.failed_recving]
        back = []
        for rid in ended:
            request, num_external = self._loading.pop(rid)
            if RequestStatus.is_finished(request.status):
                kv.free(request)    # aborted during its load
                continue
            if rid in output.failed_recving:
                kv.free(request)
                request.num_computed_tokens = 0
            else:
                request.num_computed_tokens = num_external
                self._loaded.add(rid)
            back.append(request)
        self.waiting.extendleft(reversed(back))
        self.connector.update_connector_output(output)

    def _waits_for_grammar(self, request: Request) -> bool:
        """A structured-output request whose grammar is not compiled yet (vLLM's
        WAITING_FOR_FSM): the engine's `grammar_ready` hook decides."""
        return (request.sampling_params.structured_outputs is not None
                and self.grammar_ready is not None and not self.grammar_ready(request))

    def _allocate_waiting(self, request: Request, hit: PrefixHit | None, num_new: int,
                          out: SchedulerOutput) -> list[int] | None:
        """Blocks and state slot(s) for a waiting request (free slots already checked); with a
        hit, the copies that restore its prefix. Returns the new blocks, or None (nothing
        taken) when blocks run out."""
        kv = self.kv_cache_manager
        if hit is None:
            blocks = kv.allocate_slots(request, num_new, self.num_lookahead_tokens)
            if blocks is not None:
                kv.allocate_state_slot(request, num_reserved=self._weight(request) - 1)
            return blocks
        alloc = kv.allocate_with_hit(request, hit, num_new, self.num_lookahead_tokens)
        if alloc is None:
            return None
        kv.allocate_state_slot(request, num_reserved=self._weight(request) - 1)
        if alloc.block_copy is not None:
            out.block_copies.append(alloc.block_copy)
        if alloc.state_copy_src is None:
            kv.load_state(hit, request.state_slot)
        else:
            out.state_copies.append(KDAStateCopy(src_slot=alloc.state_copy_src,
                                                 dst_slot=request.state_slot))
        return alloc.new_block_ids

    def _weight(self, request: Request) -> int:
        """Sequences (and state slots) a request will need: n for an unforked parent."""
        return request.num_samples if request.is_fork_parent else 1

    def _target(self, request: Request) -> int:
        """Tokens the request wants computed: an n > 1 parent stops one short of its prompt;
        tokens still on their way from the worker count (async scheduling)."""
        if request.is_fork_parent:
            return request.num_prompt_tokens - 1
        return request.num_tokens_with_spec + request.num_output_placeholders

    def _num_new_tokens(self, request: Request, token_budget: int, input_room: int) -> int:
        if request.num_output_placeholders and self._last_output_in_flight(request):
            return 0
        num_new = self._target(request) - request.num_computed_tokens
        if self.async_spec and request.spec_token_ids:
            # drafts are capped here (the device proposer always makes K): verifying them may
            # not pass max_tokens, counting the step in flight at its worst case
            max_tokens = request.sampling_params.max_tokens
            if max_tokens is not None:
                num_out = request.num_output_tokens + request.num_output_placeholders
                num_new = min(num_new, max(max_tokens - num_out, 1))
        if self.enable_chunked_prefill and 0 < self.long_prefill_token_threshold < num_new:
            num_new = self.long_prefill_token_threshold
        num_new = min(num_new, token_budget, input_room,
                      self.max_model_len - request.num_computed_tokens)
        return max(num_new, 0)

    def _last_output_in_flight(self, request: Request) -> bool:
        """True when the tokens on their way already reach max_tokens or max_model_len: another
        step would compute a token that can never be emitted."""
        num_out = request.num_output_tokens + request.num_output_placeholders
        max_tokens = request.sampling_params.max_tokens
        return ((max_tokens is not None and num_out >= max_tokens)
                or request.num_tokens + request.num_output_placeholders >= self.max_model_len)

    def _allocate_or_preempt(self, request: Request, num_new: int, preempted: list[Request],
                             scheduled: list[Request]) -> list[int] | None:
        """Allocate blocks for a running request, preempting the newest running requests until
        it fits. Returns None when the request itself had to be preempted."""
        while True:
            blocks = self.kv_cache_manager.allocate_slots(request, num_new,
                                                          self.num_lookahead_tokens)
            if blocks is not None:
                return blocks
            if self._preempt_newest(request, preempted, scheduled):
                return None

    def _preempt_newest(self, request: Request, preempted: list[Request],
                        scheduled: list[Request]) -> bool:
        """Preempt running[-1]; True if that was `request` itself."""
        victim = self.running.pop()
        # Running requests are visited oldest first, so the newest is never scheduled yet.
        assert victim not in scheduled, victim
        self._preempt(victim)
        preempted.append(victim)
        return victim is request

    def _preempt(self, request: Request) -> None:
        self.kv_cache_manager.free(request)
        self._unsent.discard(request.req_id)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.spec_token_ids = []
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    def _fork(self, index: int, out: SchedulerOutput, preempted: list[Request]) -> bool:
        """Replace the parent at running[index] by its n children. False if the parent had to be
        preempted to find blocks for the partial-block copies."""
        parent = self.running[index]
        need = self.kv_cache_manager.num_blocks_to_fork(parent)
        while self.kv_cache_manager.num_free_blocks < need:
            if self._preempt_newest(parent, preempted, []):
                return False
        children = [parent.make_child(k) for k in range(parent.num_samples)]
        result = self.kv_cache_manager.fork(parent, children)
        assert result is not None
        out.block_copies.extend(result.block_copies)
        out.state_copies.extend(result.state_copies)
        for child in children:
            child.status = RequestStatus.RUNNING
            child.num_computed_tokens = parent.num_computed_tokens
            child.num_cached_tokens = parent.num_cached_tokens
            self.requests[child.req_id] = child
            self._unsent.add(child.req_id)
        self.running[index:index + 1] = children
        # The parent is done: the worker drops it (its slot now belongs to the last child).
        del self.requests[parent.req_id]
        self._unsent.discard(parent.req_id)
        self._finished_req_ids.add(parent.req_id)
        parent.status = RequestStatus.FINISHED_STOPPED
        return True

    @staticmethod
    def _drafted_on_device(request: Request) -> bool:
        """Gets placeholder drafts under async_spec: not with penalties / logit_bias (never
        drafted) nor a grammar (its drafts are checked on the host, one step at a time)."""
        params = request.sampling_params
        return not params.processes_logits and params.structured_outputs is None

    def _build_output(self, out: SchedulerOutput, scheduled: list[Request],
                      new_blocks: dict[str, list[int]], preempted: list[Request]) -> None:
        cached = CachedRequestData()
        for request in scheduled:
            rid = request.req_id
            if rid in self._unsent:
                self._unsent.discard(rid)
                out.scheduled_new_reqs.append(NewRequestData(
                    req_id=rid,
                    prompt_token_ids=list(request.prompt_token_ids),
                    output_token_ids=list(request.output_token_ids),
                    sampling_params=request.sampling_params,
                    block_ids=self.kv_cache_manager.get_block_ids(rid),
                    state_slot=request.state_slot,
                    num_computed_tokens=request.num_computed_tokens,
                    sample_seed_offset=request.num_output_tokens,
                ))
            else:
                cached.req_ids.append(rid)
                cached.new_block_ids.append(new_blocks[rid])
                cached.num_computed_tokens.append(request.num_computed_tokens)
            num_new = out.num_scheduled_tokens[rid]
            self.prefix_cache.plan_exports(request, num_new, out)
            num_spec = request.num_computed_tokens + num_new - request.num_tokens
            spec = request.spec_token_ids
            if spec and spec[0] == DRAFT_PLACEHOLDER:
                # [last token] + drafts, all from the step in flight: num_new - 1 drafts
                if num_new > 1:
                    out.scheduled_spec_decode_tokens[rid] = spec[:num_new - 1]
            elif num_spec > 0 and spec:
                out.scheduled_spec_decode_tokens[rid] = spec[:num_spec]
            request.spec_token_ids = []
            # Advance now (the KV/state of these tokens is written by this step's forward);
            # update_from_output rolls back rejected drafts.
            request.num_computed_tokens += num_new
            if (not request.is_fork_parent and request.num_computed_tokens
                    >= request.num_tokens + request.num_output_placeholders):
                # this step samples for it: 1 + its drafts tokens at most are on their way
                request.num_output_placeholders += 1 + len(
                    out.scheduled_spec_decode_tokens.get(rid, ()))
                out.sampling_req_ids.add(rid)
                if self.async_spec and self._drafted_on_device(request):
                    request.spec_token_ids = [DRAFT_PLACEHOLDER] * self.num_spec_tokens
        out.scheduled_cached_reqs = cached
        out.total_num_scheduled_tokens = sum(out.num_scheduled_tokens.values())
        out.preempted_req_ids = {r.req_id for r in preempted}
        out.finished_req_ids = self._finished_req_ids
        self._finished_req_ids = set()
        if self.connector is not None:
            out.kv_connector_metadata = self.connector.build_connector_meta()
            out.kv_connector_poll = bool(self._loading or self._held)
        if self.offload is not None:
            out.offload = self.offload.take_ops()

    # ------------------------------------------------------------------ after the forward
    def update_from_output(self, scheduler_output: SchedulerOutput,
                           runner_output: ModelRunnerOutput) -> list[EngineCoreOutput]:
        """Append sampled tokens, roll back rejected drafts, check stop conditions and free
        finished requests. Returns one EngineCoreOutput per request that got tokens."""
        self.prefix_cache.end_step()
        if self.offload is not None and runner_output.offload_output is not None:
            self.offload.update(runner_output.offload_output)
        if self.connector is not None and runner_output.kv_connector_output is not None:
            self._update_from_connector(runner_output.kv_connector_output)
        index = {rid: j for j, rid in enumerate(runner_output.req_ids)}
        outputs, self._pending_outputs = self._pending_outputs, []
        finished: list[Request] = []
        in_waiting = False    # a finished request was preempted: it sits in the waiting queue
        for rid in scheduler_output.num_scheduled_tokens:
            request = self.requests.get(rid)
            if request is None or request.status not in _TAKES_OUTPUT:
                continue  # finished or aborted during the step
            j = index.get(rid)
            generated = runner_output.sampled_token_ids[j] if j is not None else []
            logprobs = (runner_output.logprobs[j]
                        if j is not None and j < len(runner_output.logprobs) else None)
            drafts = scheduler_output.scheduled_spec_decode_tokens.get(rid, ())
            if request.status == RequestStatus.RUNNING:
                self._check_runner_output(request, generated, scheduler_output)
                if drafts:
                    request.num_computed_tokens -= len(drafts) + 1 - len(generated)
            # else: preempted by a later schedule() while this step was in flight (async
            # scheduling); its tokens are kept, and its recompute will include them.
            if not generated:
                continue
            request.num_output_placeholders = max(
                request.num_output_placeholders - 1 - len(drafts), 0)
            status = None
            new_token_ids: list[int] = []
            for token_id in generated:
                request.append_output_token_ids(token_id)
                new_token_ids.append(token_id)
                status = self._check_stop(request)
                if status is not None:
                    break
            if status is not None:
                in_waiting |= request.status != RequestStatus.RUNNING
                request.status = status
                finished.append(request)
            outputs.append(EngineCoreOutput(
                req_id=rid,
                new_token_ids=new_token_ids,
                new_logprobs=list(logprobs[:len(new_token_ids)]) if logprobs else None,
                finish_reason=request.finish_reason,
                stop_reason=request.stop_reason,
                num_cached_tokens=request.num_cached_tokens,
                parent_req_id=request.parent_req_id,
                sample_index=request.sample_index,
            ))
        if finished:
            done = {id(r) for r in finished}
            self.running = [r for r in self.running if id(r) not in done]
            if in_waiting:
                self.waiting = deque(r for r in self.waiting if id(r) not in done)
            by_id = {o.req_id: o for o in outputs}
            for request in finished:
                params = self._free_request(request)
                if params is not None:
                    by_id[request.req_id].kv_transfer_params = params
        return outputs

    def _check_runner_output(self, request: Request, generated: list[int],
                             scheduler_output: SchedulerOutput) -> None:
        in_prefill = request.req_id not in scheduler_output.sampling_req_ids
        if in_prefill and generated:
            raise RuntimeError(
                f"runner sampled {generated} for request {request.req_id!r} whose prompt is "
                f"still being prefilled ({request.num_computed_tokens}/{request.num_tokens})")
        if not in_prefill and not generated:
            raise RuntimeError(f"runner sampled no token for request {request.req_id!r}")
        num_drafts = len(scheduler_output.scheduled_spec_decode_tokens.get(request.req_id, ()))
        if len(generated) > num_drafts + 1:
            raise RuntimeError(
                f"runner returned {len(generated)} tokens for request {request.req_id!r} with "
                f"{num_drafts} scheduled drafts")

    def _check_stop(self, request: Request) -> RequestStatus | None:
        """Stop after the last appended token? EOS (unless ignore_eos) and stop_token_ids count
        only once min_tokens are out; max_tokens and max_model_len always."""
        params = request.sampling_params
        last = request.output_token_ids[-1]
        if request.num_output_tokens >= params.min_tokens:
            if not params.ignore_eos and last in request.eos_token_ids:
                return RequestStatus.FINISHED_STOPPED
            if last in params.stop_token_ids:
                request.stop_reason = last
                return RequestStatus.FINISHED_STOPPED
        if request.num_tokens >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH_CAPPED
        if params.max_tokens is not None and request.num_output_tokens >= params.max_tokens:
            return RequestStatus.FINISHED_LENGTH_CAPPED
        return None

    # ------------------------------------------------------------------ speculative decoding
    def update_draft_token_ids(self, draft_token_ids: dict[str, list[int]]) -> None:
        """Set the drafts to verify next step (the proposer's output), at most
        num_speculative_tokens each. Ids of finished requests are ignored. Under async_spec
        they replace the placeholders of a step that was processed before the next schedule."""
        for rid, drafts in draft_token_ids.items():
            request = self.requests.get(rid)
            if request is None or request.status != RequestStatus.RUNNING:
                continue
            request.spec_token_ids = list(drafts[:self.num_spec_tokens])

    # ------------------------------------------------------------------ introspection
    def has_unfinished_requests(self) -> bool:
        return bool(self.running or self.waiting or self._pending_outputs
                    or any(not RequestStatus.is_finished(r.status)
                           for r, _ in self._loading.values()))

    def has_pending_transfers(self) -> bool:
        """Loads in flight, requests held for a remote reader, or offload copies and file
        jobs: the engine keeps stepping (the worker polls the transfers) even with nothing to
        schedule."""
        return bool(self._loading or self._held) or (
            self.offload is not None and self.offload.busy)

    def has_finished_requests(self) -> bool:
        """Finished ids not yet reported to the worker (one more schedule() flushes them)."""
        return bool(self._finished_req_ids)

    def get_num_unfinished_requests(self) -> int:
        return len(self.running) + len(self.waiting) + sum(
            not RequestStatus.is_finished(r.status) for r, _ in self._loading.values())

    def reset_prefix_cache(self) -> int:
        """Forget every cached block hash and KDA checkpoint (vLLM's reset_prefix_cache).
        Returns how many hashes were dropped."""
        return self.kv_cache_manager.reset_prefix_cache()

    def get_stats(self) -> SchedulerStats:
        kv = self.kv_cache_manager
        ckpt = kv.checkpoint_pool
        return SchedulerStats(
            num_running_reqs=len(self.running),
            num_waiting_reqs=len(self.waiting),
            kv_cache_usage=kv.block_pool.usage,
            num_free_blocks=kv.num_free_blocks,
            num_total_blocks=kv.num_gpu_blocks,
            num_total_kv_tokens=kv.num_gpu_blocks * self.block_size,
            num_free_state_slots=kv.num_free_slots,
            num_total_state_slots=kv.num_state_slots,
            num_preemptions=self.num_preemptions,
            prefix_cache_queries=self.prefix_cache.num_queries,
            prefix_cache_hits=self.prefix_cache.num_hits,
            num_kda_checkpoints=ckpt.num_ready,
            num_total_kda_checkpoint_slots=ckpt.num_slots,
            num_kda_checkpoint_exports=ckpt.num_exports,
            num_kv_transfer_held=len(self._held),
            num_kv_transfer_loading=len(self._loading),
            **(self.connector.stats() if self.connector is not None else {}),
            **(self.offload.stats_dict() if self.offload is not None else {}),
        )
