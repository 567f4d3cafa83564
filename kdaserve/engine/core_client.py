# SPDX-License-Identifier: Apache-2.0
"""The engine core in its own process, and the wire protocol to it (ZMQ PUSH/PULL + msgspec).

The core process owns an `LLMEngine` and runs a busy loop: take new / abort / stats messages
from the input socket, step while work exists, and push each step's progress back as *deltas*
(new text, token ids and logprobs per sample) so no message grows with the output length. When
idle it blocks on the socket (1 s at a time, to notice a dead parent).

Front (API server process)                     Core process
  AddRequest / AbortRequests / GetStats  --->  PULL  (input_addr)
  PULL (output_addr)                     <---  Ready / StartupFailed / Outputs / RequestFailed /
                                               Stats / CoreFailed
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
import traceback
from typing import Any

import msgspec
import zmq

from kdaserve.outputs import Logprob
from kdaserve.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

_IDLE_POLL_MS = 1000


# ----------------------------------------------------------------------------- front -> core


class AddRequest(msgspec.Struct, tag=True):
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: dict[str, Any]
    arrival_time: float
    prompt: str | None = None
    cache_salt: str | None = None


class AbortRequests(msgspec.Struct, tag=True):
    request_ids: list[str]


class GetStats(msgspec.Struct, tag=True):
    nonce: int


class Shutdown(msgspec.Struct, tag=True):
    pass


InputMessage = AddRequest | AbortRequests | GetStats | Shutdown


# ----------------------------------------------------------------------------- core -> front


class CompletionDelta(msgspec.Struct):
    """What one sample gained in one step (not cumulative)."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class RequestDelta(msgspec.Struct):
    request_id: str
    completions: list[CompletionDelta]
    finished: bool
    num_cached_tokens: int = 0
    first_token_time: float | None = None
    finished_time: float | None = None


class Ready(msgspec.Struct, tag=True):
    info: dict[str, Any]


class StartupFailed(msgspec.Struct, tag=True):
    message: str


class Outputs(msgspec.Struct, tag=True):
    outputs: list[RequestDelta]


class RequestFailed(msgspec.Struct, tag=True):
    request_id: str
    message: str
    bad_request: bool
    """True for a ValueError from add_request (the client's fault: HTTP 400)."""


class Stats(msgspec.Struct, tag=True):
    nonce: int
    stats: dict[str, Any]


class CoreFailed(msgspec.Struct, tag=True):
    message: str
    request_ids: list[str]


OutputMessage = Ready | StartupFailed | Outputs | RequestFailed | Stats | CoreFailed


def sampling_params_to_dict(params: SamplingParams) -> dict[str, Any]:
    return dataclasses.asdict(params)


# ------------------------------------------------------------------------------- the process


class _SentState:
    """How much of each sample of one request has been pushed to the front already."""

    def __init__(self, n: int):
        self.text_len = [0] * n
        self.num_tokens = [0] * n
        self.num_logprobs = [0] * n
        self.finished = [False] * n
        self.first_token_time: float | None = None


class EngineCoreProc:
    """The loop inside the core process (constructed there, from picklable arguments)."""

    def __init__(self, engine, input_sock: zmq.Socket, output_sock: zmq.Socket,
                 parent_pid: int):
        self.engine = engine
        self.input_sock = input_sock
        self.output_sock = output_sock
        self.parent_pid = parent_pid
        self.encoder = msgspec.msgpack.Encoder()
        self.decoder = msgspec.msgpack.Decoder(InputMessage)
        self.sent: dict[str, _SentState] = {}
        self.running = True

    def send(self, msg: OutputMessage) -> None:
        self.output_sock.send(self.encoder.encode(msg), copy=False)

    def run(self) -> None:
        poller = zmq.Poller()
        poller.register(self.input_sock, zmq.POLLIN)
        while self.running:
            busy = self.engine.has_unfinished_requests()
            if poller.poll(0 if busy else _IDLE_POLL_MS):
                self._drain_inputs()
            if not self.running:
                return
            if os.getppid() != self.parent_pid:
                logger.warning("engine core: parent process died, exiting")
                return
            if self.running and self.engine.has_unfinished_requests():
                self._step()

    def _drain_inputs(self) -> None:
        while self.running:
            try:
                raw = self.input_sock.recv(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            self._handle(self.decoder.decode(raw.buffer))

    def _handle(self, msg: InputMessage) -> None:
        if isinstance(msg, AddRequest):
            try:
                params = SamplingParams(**msg.sampling_params)
                self.engine.add_request(msg.request_id, msg.prompt_token_ids, params,
                                        arrival_time=msg.arrival_time, prompt=msg.prompt,
                                        cache_salt=msg.cache_salt)
            except ValueError as e:
                self.send(RequestFailed(msg.request_id, str(e), bad_request=True))
                return
            self.sent[msg.request_id] = _SentState(params.n)
        elif isinstance(msg, AbortRequests):
            live = [rid for rid in msg.request_ids if rid in self.sent]
            for rid in live:
                del self.sent[rid]
            if live:
                self.engine.abort_request(live)
        elif isinstance(msg, GetStats):
            stats = self.engine.get_stats()
            self.send(Stats(msg.nonce, dataclasses.asdict(stats)))
        elif isinstance(msg, Shutdown):
            self.running = False

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception:
            # The engine's state may be inconsistent: fail the requests it held, free them,
            # and keep serving new ones. If even aborting fails, die (health then reports it).
            message = traceback.format_exc()
            logger.error("engine core: step failed:\n%s", message)
            request_ids = list(self.sent)
            self.sent.clear()
            self.send(CoreFailed(message.strip().splitlines()[-1], request_ids))
            self.engine.abort_request(request_ids)
            return
        deltas = [d for d in (self._delta(out) for out in outputs) if d is not None]
        if deltas:
            self.send(Outputs(deltas))

    def _delta(self, out) -> RequestDelta | None:
        state = self.sent.get(out.request_id)
        if state is None:
            return None  # aborted meanwhile
        now = time.time()
        completions = []
        for comp in out.outputs:
            i = comp.index
            if state.finished[i]:
                continue
            new_tokens = comp.token_ids[state.num_tokens[i]:]
            new_text = comp.text[state.text_len[i]:]
            if not new_tokens and not new_text and comp.finish_reason is None:
                continue
            logprobs = None
            if comp.logprobs is not None:
                logprobs = [{tid: _as_logprob(v) for tid, v in step.items()}
                            for step in comp.logprobs[state.num_logprobs[i]:]]
                state.num_logprobs[i] = len(comp.logprobs)
            state.num_tokens[i] = len(comp.token_ids)
            state.text_len[i] = len(comp.text)
            state.finished[i] = comp.finish_reason is not None
            completions.append(CompletionDelta(
                i, new_text, list(new_tokens), logprobs, comp.cumulative_logprob,
                comp.finish_reason, comp.stop_reason))
        if not completions and not out.finished:
            return None
        if state.first_token_time is None:
            state.first_token_time = now
        if out.finished:
            del self.sent[out.request_id]
        return RequestDelta(out.request_id, completions, out.finished, out.num_cached_tokens,
                            first_token_time=state.first_token_time,
                            finished_time=now if out.finished else None)


def _as_logprob(value) -> Logprob:
    return value if isinstance(value, Logprob) else Logprob(float(value))


def run_engine_core(engine_kwargs: dict[str, Any], input_addr: str, output_addr: str,
                    parent_pid: int, log_level: str = "INFO") -> None:
    """Entry point of the core process: build the engine, report Ready, then loop."""
    logging.basicConfig(level=log_level.upper(),
                        format="%(asctime)s %(levelname)s [engine-core] %(message)s")
    ctx = zmq.Context()
    input_sock = ctx.socket(zmq.PULL)
    input_sock.connect(input_addr)
    output_sock = ctx.socket(zmq.PUSH)
    output_sock.connect(output_addr)
    encoder = msgspec.msgpack.Encoder()
    try:
        from kdaserve.engine.llm_engine import LLMEngine

        engine = LLMEngine.from_engine_args(**engine_kwargs)
    except Exception as e:  # noqa: BLE001 - any start-up failure goes back to the front
        logger.error("engine core: start-up failed:\n%s", traceback.format_exc())
        msg = str(e) if isinstance(e, ValueError) else f"{type(e).__name__}: {e}"
        output_sock.send(encoder.encode(StartupFailed(msg)))
        output_sock.close(linger=2000)
        ctx.term()
        return
    output_sock.send(encoder.encode(Ready(_engine_info(engine))))
    proc = EngineCoreProc(engine, input_sock, output_sock, parent_pid)
    try:
        proc.run()
    finally:
        input_sock.close(linger=0)
        output_sock.close(linger=1000)
        ctx.term()


def _engine_info(engine) -> dict[str, Any]:
    """What the front needs to know about the engine it talks to."""
    cfg = engine.engine_config
    stats = engine.get_stats()
    return {
        "model": cfg.model_config.model,
        "tokenizer": cfg.model_config.tokenizer,
        "max_model_len": cfg.model_config.max_model_len,
        "max_num_seqs": cfg.scheduler_config.max_num_seqs,
        "max_logprobs": cfg.max_logprobs,
        "device": str(cfg.device),
        "num_total_blocks": stats.num_total_blocks,
        "num_total_state_slots": stats.num_total_state_slots,
        "eos_token_ids": list(getattr(engine, "eos_token_ids", [])),
        "vocab_size": getattr(engine, "vocab_size", None),
    }
