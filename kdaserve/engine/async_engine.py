# SPDX-License-Identifier: Apache-2.0
"""AsyncEngine: the asyncio front of the engine-core process.

The event loop never runs model work: requests go to the core process over ZMQ, and a reader
task turns the core's per-step token outputs into text (OutputProcessor: detokenization, stop
strings) and dispatches them into per-request collectors; a stop string aborts its sample in
the core. `generate()` is an async iterator per request; leaving it early (client gone, task
cancelled) aborts the request in the core at once, which frees its KV blocks and state slot.

Backpressure: a consumer that stops taking its outputs (a client that no longer reads its
stream) lets them pile up in its collector; past `stream_buffer_limit` undelivered step outputs
the request is aborted in the core, so it stops costing the engine, and its consumer, should
it resume, gets what was buffered and then the error.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import multiprocessing
import os
import shutil
import tempfile
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from kdaserve.core.engine_output import SchedulerStats
from kdaserve.engine.core import run_engine_core
from kdaserve.engine.core_client import (AbortRequests, AddRequest, CoreFailed, GetStats,
                                         OutputMessage, Outputs, Ready, RequestFailed, Shutdown,
                                         StartupFailed, Stats, core_sampling_params)
from kdaserve.engine.output_processor import OutputProcessor, eos_token_ids
from kdaserve.models.tokenizer import get_tokenizer
from kdaserve.outputs import CompletionOutput, RequestOutput
from kdaserve.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The engine-core process is gone; nothing more can be served."""


class EngineStartupError(RuntimeError):
    pass


@dataclass
class RequestTiming:
    """Front-side timestamps of one finished request (what the client saw)."""

    arrival_time: float
    first_token_time: float | None
    finished_time: float
    num_prompt_tokens: int
    num_generation_tokens: int
    finish_reasons: list[str] = field(default_factory=list)


class _RequestCollector:
    """Collects one request's delta outputs (OutputProcessor, delta mode) until its consumer
    takes them. A slow consumer gets the deltas of several steps merged into one output."""

    def __init__(self, n: int, delta: bool):
        self.pending: list[RequestOutput] = []
        self.error: BaseException | None = None
        self.event = asyncio.Event()
        self.totals = None if delta else {i: CompletionOutput(index=i) for i in range(n)}
        """Cumulative mode: each sample's output so far (None in delta mode)."""
        self.num_generation_tokens = 0
        self.finish_reasons: list[str] = []

    @property
    def num_pending(self) -> int:
        """Step outputs put and not yet taken by the consumer."""
        return len(self.pending)

    def put(self, delta: RequestOutput) -> None:
        self.num_generation_tokens += sum(len(c.token_ids) for c in delta.outputs)
        self.finish_reasons += [c.finish_reason for c in delta.outputs if c.finish_reason]
        self.pending.append(delta)
        self.event.set()

    def fail(self, error: BaseException) -> None:
        self.error = error
        self.event.set()

    async def get(self) -> RequestOutput:
        while not self.pending:
            if self.error is not None:
                raise self.error
            self.event.clear()
            await self.event.wait()
        pending, self.pending = self.pending, []
        merged = {} if self.totals is None else self.totals
        for d in pending:
            for c in d.outputs:
                _extend(merged.setdefault(c.index, CompletionOutput(index=c.index)), c)
        # Copies: the totals grow on (_extend replaces logprobs, so only token_ids is shared).
        outputs = [dataclasses.replace(merged[i], token_ids=list(merged[i].token_ids))
                   for i in sorted(merged)]
        return dataclasses.replace(pending[-1], outputs=outputs)


def _extend(out: CompletionOutput, c: CompletionOutput) -> None:
    out.text += c.text
    out.token_ids.extend(c.token_ids)
    if c.logprobs is not None:
        out.logprobs = (out.logprobs or []) + c.logprobs
    out.cumulative_logprob = c.cumulative_logprob
    if c.finish_reason is not None:
        out.finish_reason, out.stop_reason = c.finish_reason, c.stop_reason


class AsyncEngine:
    def __init__(self, proc: multiprocessing.Process, ctx: zmq.asyncio.Context,
                 input_sock: zmq.asyncio.Socket, output_sock: zmq.asyncio.Socket,
                 info: dict[str, Any], ipc_dir: str, tokenizer: Any,
                 stream_buffer_limit: int | None = None):
        self.proc = proc
        self.ctx = ctx
        self.input_sock = input_sock
        self.output_sock = output_sock
        self.info = info
        self.ipc_dir = ipc_dir
        self.tokenizer = tokenizer
        """The model's HF tokenizer: the front detokenizes (and the serving layer encodes)."""
        self.eos_token_ids = eos_token_ids(info["eos_token_ids"], tokenizer)
        self.output_processor = OutputProcessor(tokenizer, info["vocab_size"],
                                                info["max_model_len"], info["max_logprobs"])
        self.encoder = msgspec.msgpack.Encoder()
        self.decoder = msgspec.msgpack.Decoder(OutputMessage)
        self.collectors: dict[str, _RequestCollector] = {}
        self.stats_waiters: dict[int, asyncio.Future] = {}
        self.nonces = itertools.count()
        self.stream_buffer_limit = stream_buffer_limit
        """Undelivered step outputs a request may buffer before it is aborted (None: no
        limit)."""
        self.dead_error: EngineDeadError | None = None
        self.closed = False
        """shutdown() has begun: nothing more is sent to the core."""
        self.request_observer: Callable[[RequestTiming], None] | None = None
        self.tasks = [asyncio.create_task(self._output_loop()),
                      asyncio.create_task(self._watch_process())]

    # ------------------------------------------------------------------------------ start-up

    @classmethod
    async def start(cls, engine_kwargs: dict[str, Any], startup_timeout: float = 900.0,
                    log_level: str = "INFO",
                    stream_buffer_limit: int | None = None) -> "AsyncEngine":
        """Spawn the core process, wait until its engine is built, load the tokenizer, return
        the front. stream_buffer_limit: see the module docstring (None: never abort a request
        for a consumer that lags).

        Raises EngineStartupError with the engine's message (e.g. a bad flag value)."""
        ipc_dir = tempfile.mkdtemp(prefix="kdaserve-")
        input_addr = f"ipc://{ipc_dir}/input"
        output_addr = f"ipc://{ipc_dir}/output"
        ctx = zmq.asyncio.Context()
        input_sock = ctx.socket(zmq.PUSH)
        input_sock.bind(input_addr)
        output_sock = ctx.socket(zmq.PULL)
        output_sock.bind(output_addr)
        proc = multiprocessing.get_context("spawn").Process(
            target=run_engine_core, name="kdaserve-engine-core", daemon=True,
            args=(engine_kwargs, input_addr, output_addr, os.getpid(), log_level))
        proc.start()
        decoder = msgspec.msgpack.Decoder(OutputMessage)
        deadline = time.monotonic() + startup_timeout
        try:
            while True:
                if await output_sock.poll(200):
                    msg = decoder.decode(await output_sock.recv())
                    break
                if not proc.is_alive():
                    raise EngineStartupError(
                        f"the engine process exited during start-up (exit code {proc.exitcode})")
                if time.monotonic() > deadline:
                    raise EngineStartupError(f"the engine did not start in {startup_timeout}s")
            if isinstance(msg, StartupFailed):
                raise EngineStartupError(msg.message)
            assert isinstance(msg, Ready), msg
            tokenizer = get_tokenizer(msg.info["tokenizer"])
        except BaseException:
            _close(proc, ctx, (input_sock, output_sock), ipc_dir)
            raise
        return cls(proc, ctx, input_sock, output_sock, msg.info, ipc_dir, tokenizer,
                   stream_buffer_limit)

    # ------------------------------------------------------------------------------ requests

    async def generate(self, prompt_token_ids: list[int], sampling_params: SamplingParams,
                       request_id: str, prompt: str | None = None,
                       delta: bool = False, cache_salt: str | None = None,
                       kv_transfer_params: dict | None = None,
                       ) -> AsyncIterator[RequestOutput]:
        """Stream one request's outputs, one per engine step (merged if the consumer lags).

        delta=False: each output is cumulative (all text / tokens so far), as LLMEngine.step.
        delta=True: each output holds only what is new since the previous one.
        Raises ValueError if the engine rejects the request, EngineDeadError if it is gone (or
        shut down, or abort_all failed the request); RuntimeError if it was aborted otherwise
        (abort(), a step failure, a consumer past stream_buffer_limit). kv_transfer_params:
        prefill/decode disaggregation (see kdaserve.disagg.params)."""
        if self.dead_error is not None:
            raise self.dead_error
        if self.closed:
            raise EngineDeadError("the engine is shut down")
        if request_id in self.collectors:
            raise ValueError(f"request id {request_id!r} is already in use")
        prompt_token_ids = list(prompt_token_ids)
        arrival_time = time.time()
        self.output_processor.add_request(request_id, prompt, prompt_token_ids, sampling_params,
                                          arrival_time, delta=True)
        collector = _RequestCollector(sampling_params.n, delta)
        self.collectors[request_id] = collector
        self._send(AddRequest(request_id, prompt_token_ids, core_sampling_params(sampling_params),
                              arrival_time, self.eos_token_ids, cache_salt,
                              kv_transfer_params))
        finished = False
        try:
            while not finished:
                out = await collector.get()
                finished = out.finished
                yield out
        finally:
            self.collectors.pop(request_id, None)
            if not finished:
                self._abort_now([request_id])

    async def abort(self, request_id: str | list[str]) -> None:
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        for rid in ids:
            collector = self.collectors.pop(rid, None)
            if collector is not None:
                collector.fail(RuntimeError(f"request {rid} was aborted"))
        self._abort_now(ids)

    def abort_all(self, reason: str) -> int:
        """Fail every request in flight with EngineDeadError(reason) and abort it in the core
        (a server's shutdown once its graceful timeout is over: each consumer gets the error,
        and a stream can end with an error event). Returns how many requests there were."""
        request_ids = list(self.collectors)
        error = EngineDeadError(reason)
        for rid in request_ids:
            self.collectors[rid].fail(error)
        if request_ids:
            self._abort_now(request_ids)
        return len(request_ids)

    def _abort_now(self, request_ids: list[str]) -> None:
        self.output_processor.abort_requests(request_ids)
        if self.dead_error is None:
            self._send(AbortRequests(request_ids))

    def _abort_stalled(self, request_id: str, collector: _RequestCollector) -> None:
        """The consumer has not taken `stream_buffer_limit` step outputs: abort the request
        (its blocks and slot are freed) and fail the collector after what it holds."""
        logger.info("request %s aborted: its client has not read %d step outputs",
                    request_id, collector.num_pending)
        self._abort_now([request_id])
        collector.fail(RuntimeError(
            f"request {request_id} was aborted: its client stopped reading the stream "
            f"({collector.num_pending} step outputs buffered)"))

    async def get_stats(self) -> SchedulerStats:
        if self.dead_error is not None:
            raise self.dead_error
        nonce = next(self.nonces)
        future = asyncio.get_running_loop().create_future()
        self.stats_waiters[nonce] = future
        self._send(GetStats(nonce))
        try:
            stats = await asyncio.wait_for(future, timeout=30.0)
        finally:
            self.stats_waiters.pop(nonce, None)
        processor = self.output_processor
        return dataclasses.replace(SchedulerStats(**stats),
                                   num_prompt_tokens=processor.num_prompt_tokens,
                                   num_generation_tokens=processor.num_generation_tokens)

    @property
    def is_healthy(self) -> bool:
        return self.dead_error is None and self.proc.is_alive()

    @property
    def num_in_flight(self) -> int:
        return len(self.collectors)

    def _send(self, msg) -> None:
        # PUSH to a connected peer queues at once; the future needs no awaiting. After
        # shutdown() began, the socket is (being) closed and the core is stopped regardless:
        # a generator finalized late (its consumer cancelled at exit) must not touch it.
        if self.closed:
            return
        self.input_sock.send(self.encoder.encode(msg), copy=False)

    # --------------------------------------------------------------------------- background

    async def _output_loop(self) -> None:
        try:
            while True:
                raw = await self.output_sock.recv(copy=False)
                self._dispatch(self.decoder.decode(raw.buffer))
                # A message already queued is received without suspending: yield, so that
                # the consumers take each step's outputs before the next step's (a backlog
                # must not count as a client that stopped reading).
                await asyncio.sleep(0)
        except Exception as e:  # noqa: BLE001 - a broken channel means a dead engine
            logger.exception("engine output loop failed")
            self._set_dead(f"engine output channel failed: {e}")

    def _dispatch(self, msg) -> None:
        if isinstance(msg, Outputs):
            processed = self.output_processor.process_outputs(msg.outputs)
            for out in processed.request_outputs:
                collector = self.collectors.get(out.request_id)
                if collector is None:
                    continue
                collector.put(out)
                if out.finished:
                    self._observe(collector, out)
                elif (self.stream_buffer_limit is not None and collector.error is None
                      and collector.num_pending > self.stream_buffer_limit):
                    self._abort_stalled(out.request_id, collector)
            if processed.reqs_to_abort:
                self._send(AbortRequests(processed.reqs_to_abort, stopped=True))
        elif isinstance(msg, RequestFailed):
            self.output_processor.reject_request(msg.request_id)
            collector = self.collectors.get(msg.request_id)
            if collector is not None:
                collector.fail((ValueError if msg.bad_request else RuntimeError)(msg.message))
        elif isinstance(msg, Stats):
            future = self.stats_waiters.get(msg.nonce)
            if future is not None and not future.done():
                future.set_result(msg.stats)
        elif isinstance(msg, CoreFailed):
            self.output_processor.abort_requests(msg.request_ids)
            for rid in msg.request_ids:
                collector = self.collectors.get(rid)
                if collector is not None:
                    collector.fail(RuntimeError(f"engine step failed: {msg.message}"))

    def _observe(self, collector: _RequestCollector, out: RequestOutput) -> None:
        if self.request_observer is None:
            return
        self.request_observer(RequestTiming(
            out.metrics.arrival_time, out.metrics.first_token_time, time.time(),
            len(out.prompt_token_ids), collector.num_generation_tokens,
            collector.finish_reasons))

    async def _watch_process(self) -> None:
        while self.proc.is_alive():
            await asyncio.sleep(0.5)
        self._set_dead(f"the engine process died (exit code {self.proc.exitcode})")

    def _set_dead(self, message: str) -> None:
        if self.dead_error is not None:
            return
        logger.error(message)
        self.dead_error = EngineDeadError(message)
        for collector in self.collectors.values():
            collector.fail(self.dead_error)
        for future in self.stats_waiters.values():
            if not future.done():
                future.set_exception(self.dead_error)

    # ------------------------------------------------------------------------------ shutdown

    async def shutdown(self) -> None:
        """Fail what is still in flight, stop the core (a Shutdown message, then SIGTERM,
        then SIGKILL) and release the sockets. Idempotent; later calls into the engine send
        nothing (generate() raises EngineDeadError)."""
        if self.closed:
            return
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        error = self.dead_error or EngineDeadError("the engine is shut down")
        for collector in self.collectors.values():
            collector.fail(error)
        for future in self.stats_waiters.values():
            if not future.done():
                future.set_exception(error)
        if self.proc.is_alive():
            try:
                self._send(Shutdown())
            except zmq.ZMQError:
                pass
        self.closed = True
        if self.proc.is_alive():
            await asyncio.get_running_loop().run_in_executor(None, self.proc.join, 5.0)
        _close(self.proc, self.ctx, (self.input_sock, self.output_sock), self.ipc_dir)


def _close(proc: multiprocessing.Process, ctx: zmq.asyncio.Context,
           socks: tuple[zmq.asyncio.Socket, ...], ipc_dir: str) -> None:
    """Stop the core process (SIGTERM, then SIGKILL) and release the sockets and ipc folder."""
    if proc.is_alive():
        proc.terminate()
        proc.join(5.0)
    if proc.is_alive():
        proc.kill()
        proc.join(5.0)
    for sock in socks:
        sock.close(linger=0)
    ctx.term()
    shutil.rmtree(ipc_dir, ignore_errors=True)
