"""The engine core's grammar state: compilation off the step loop, one matcher per request, the
token bitmask of each step, and the tokens sampled and drafted under it.

Life of a structured request in the core:
  1. `add_request`: its grammar is compiled on a thread pool (the backend itself, the
     tokenizer's vocabulary, is loaded there by the first structured request); the scheduler
     leaves the request waiting until `grammar_ready` (others are admitted past it);
  2. `grammar_bitmask`, after each schedule: the bitmask rows of the step's sampling requests,
     one per logits row the worker samples (a spec row: one per draft position and the bonus
     position, filled by advancing over the drafts and rolling back), in the SchedulerOutput;
  3. `accept_tokens`, after the step: the matcher advances over the tokens the request emitted;
  4. `validate_drafts`: the proposer's next drafts, cut at the first token the grammar refuses.

Grammars are keyed by the request the front added (an n > 1 request's samples share its
compiled grammar, each sample has its own matcher) and dropped once none of its samples is
left in the scheduler. While no structured request is alive, `active` is False and the engine
skips every hook.
"""

from __future__ import annotations

import collections
import logging
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from kdaserve.structured_output.backend_xgrammar import (RequestGrammar, XgrammarBackend,
                                                         bitmask_width)
from kdaserve.structured_output.spec import GrammarSpec

if TYPE_CHECKING:
    from kdaserve.core.engine_output import EngineCoreOutput
    from kdaserve.core.sched_output import SchedulerOutput
    from kdaserve.request import Request

logger = logging.getLogger(__name__)

NUM_COMPILE_THREADS = 2
"""Grammars compiled at once (each compilation also runs xgrammar's own threads)."""


def _front_id(request: Request) -> str:
    return request.parent_req_id or request.req_id


class StructuredOutputManager:
    """load_tokenizer: loads the tokenizer the grammars compile against (the engine core has
    none of its own: the front detokenizes; called once, on a compile thread, when the first
    structured request arrives); vocab_size: the model's (bitmask width); backend: an already
    built XgrammarBackend (tests), else it is built on first use."""

    def __init__(self, load_tokenizer: Callable[[], Any], vocab_size: int,
                 backend: XgrammarBackend | None = None) -> None:
        self.load_tokenizer = load_tokenizer
        self.vocab_size = vocab_size
        self._executor: ThreadPoolExecutor | None = None
        self._backend: Future | None = None
        if backend is not None:
            self._backend = Future()
            self._backend.set_result(backend)
        self._compiled: dict[str, Future] = {}
        """Front request id -> Future of its CompiledGrammar."""
        self._grammars: dict[str, RequestGrammar] = {}
        """Core request id -> its matcher (made when it first samples)."""
        self._failed: collections.deque[tuple[str, str]] = collections.deque()
        """(front id, reason) of compilations that raised (appended by the pool's threads)."""

    @property
    def active(self) -> bool:
        """Any structured request alive (compiling or in the scheduler)?"""
        return bool(self._compiled)

    # ------------------------------------------------------------------------- compilation

    def add_request(self, request: Request, spec: GrammarSpec) -> None:
        """Start compiling `spec` (validated) for a request the scheduler just took."""
        rid = request.req_id
        # An id used again (its earlier request finished): no matcher of that one may remain.
        samples = range(request.num_samples) if request.is_fork_parent else ()
        for core_id in [rid] + [request.child_req_id(i) for i in samples]:
            self._grammars.pop(core_id, None)
        future = self._pool().submit(self._compile, spec)
        future.add_done_callback(lambda f: self._on_compiled(rid, f))
        self._compiled[rid] = future

    def _pool(self) -> ThreadPoolExecutor:
        if self._executor is None:
            self._executor = ThreadPoolExecutor(NUM_COMPILE_THREADS,
                                                thread_name_prefix="grammar-compile")
        if self._backend is None:
            self._backend = self._executor.submit(
                lambda: XgrammarBackend(self.load_tokenizer(), self.vocab_size))
        return self._executor

    def _compile(self, spec: GrammarSpec):
        return self._backend.result().compile(spec)

    def _on_compiled(self, front_id: str, future: Future) -> None:
        if not future.cancelled() and future.exception() is not None:
            self._failed.append((front_id, f"{type(future.exception()).__name__}: "
                                           f"{future.exception()}"))

    def grammar_ready(self, request: Request) -> bool:
        """The scheduler's question for a waiting structured request: may it be scheduled?"""
        future = self._compiled.get(_front_id(request))
        return future is not None and future.done() and future.exception() is None

    def take_failed(self) -> list[tuple[str, str]]:
        """(front id, reason) of the compilations that failed since the last call."""
        failed = []
        while self._failed:
            fid, reason = self._failed.popleft()
            if fid in self._compiled:
                failed.append((fid, reason))
        return failed

    def wait_for_compile(self, timeout: float) -> None:
        """Block up to `timeout` s for a compilation to finish (the engine has nothing else to
        do while every request waits for its grammar)."""
        pending = [f for f in self._compiled.values() if not f.done()]
        if pending:
            wait(pending, timeout, FIRST_COMPLETED)

    # --------------------------------------------------------------------------- each step

    def grammar_bitmask(self, so: SchedulerOutput, requests: dict[str, Request]) -> None:
        """Fill `so.grammar_bitmask` ([rows, ceil(V/32)] int32, host) and
        `so.structured_output_request_ids` (its requests in row order; each owns 1 + its
        scheduled drafts rows) for the structured requests that sample this step."""
        if any(r in self._compiled or r in self._grammars for r in so.finished_req_ids):
            self._collect(requests)
        todo: list[tuple[str, RequestGrammar, list[int]]] = []
        for rid in so.sampling_req_ids:
            grammar = self._grammar(requests[rid])
            if grammar is not None:
                todo.append((rid, grammar, so.scheduled_spec_decode_tokens.get(rid, [])))
        if not todo:
            return
        bitmask = torch.empty((sum(1 + len(d) for _, _, d in todo),
                               bitmask_width(self.vocab_size)), dtype=torch.int32)
        row = 0
        plain: list[RequestGrammar] = []   # one row, not terminated: filled as one batch
        plain_rows: list[int] = []
        for _, grammar, drafts in todo:
            if drafts or grammar.is_terminated():
                grammar.fill_rows(bitmask, row, list(drafts))
            else:
                plain.append(grammar)
                plain_rows.append(row)
            row += 1 + len(drafts)
        if plain:
            self._backend.result().fill_next_rows(plain, plain_rows, bitmask)
        so.structured_output_request_ids = [rid for rid, _, _ in todo]
        so.grammar_bitmask = bitmask

    def _grammar(self, request: Request) -> RequestGrammar | None:
        """The request's matcher (made on its first sampling step); None if unconstrained."""
        grammar = self._grammars.get(request.req_id)
        if grammar is None:
            future = self._compiled.get(_front_id(request))
            if future is None:
                return None
            params = request.sampling_params
            grammar = self._backend.result().request_grammar(
                future.result(), set(request.eos_token_ids) | set(params.stop_token_ids))
            self._grammars[request.req_id] = grammar
        return grammar

    def accept_tokens(self, outputs: list[EngineCoreOutput]) -> list[str]:
        """Advance each structured request's matcher over the tokens it emitted; returns the
        ids whose tokens the grammar refused (the engine ends them)."""
        refused = []
        for out in outputs:
            grammar = self._grammars.get(out.req_id)
            if grammar is not None and out.new_token_ids and not grammar.accept_tokens(
                    out.new_token_ids):
                logger.error("request %s: token(s) %s outside its grammar; ending it",
                             out.req_id, out.new_token_ids)
                refused.append(out.req_id)
        return refused

    def validate_drafts(self, drafts: dict[str, list[int]]) -> dict[str, list[int]]:
        """Each structured request's drafts cut before the first token its grammar refuses
        (from where the matcher is now: after this step's tokens)."""
        out = {}
        for rid, tokens in drafts.items():
            grammar = self._grammars.get(rid)
            if grammar is not None:
                tokens = grammar.validate_tokens(list(tokens))
            if tokens:
                out[rid] = tokens
        return out

    def _collect(self, requests: dict[str, Request]) -> None:
        """Forget the grammars of requests the scheduler no longer holds."""
        live = {_front_id(r) for r in requests.values()}
        for fid in [f for f in self._compiled if f not in live]:
            self._compiled.pop(fid).cancel()
        for rid in [r for r in self._grammars if r not in requests]:
            del self._grammars[rid]

    def forget(self, front_id: str) -> None:
        """Drop a request's grammar now (its compilation failed, or the scheduler refused it)."""
        future = self._compiled.pop(front_id, None)
        if future is not None:
            future.cancel()

    def shutdown(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
