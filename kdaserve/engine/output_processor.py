"""OutputProcessor: the front's half of each request, shared by LLMEngine (in process) and
AsyncEngine (the API server's process).

The engine core sends token ids, logprobs and the scheduler's finish reasons; here, per request
and per sample, they become text (IncrementalDetokenizer), stop strings are matched and the
RequestOutputs are assembled, with the first-token / finish times. A stop string ends a sample
here first: `process_outputs` returns its core id in `reqs_to_abort` for the caller to abort in
the core. The core may have produced more tokens for that sample by then (the next step was in
flight, or the server's abort is still on its way): outputs for a sample already finished here
are dropped, so its token ids and the token counters end exactly at the stop.

Requests are checked here on entry (token ids in the vocabulary, prompt length, logprobs,
logit_bias ids), so the offline and the server paths reject the same requests alike.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from kdaserve.core.engine_output import EngineCoreOutput
from kdaserve.engine.detokenizer import IncrementalDetokenizer
from kdaserve.outputs import CompletionOutput, RequestMetrics, RequestOutput
from kdaserve.sampling_params import SamplingParams


def eos_token_ids(model_eos_token_ids: Iterable[int], tokenizer: Any) -> list[int]:
    """The model's EOS ids and the tokenizer's: what ends a request (unless ignore_eos)."""
    ids = set(model_eos_token_ids)
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return sorted(ids)


@dataclass
class ProcessedOutputs:
    request_outputs: list[RequestOutput] = field(default_factory=list)
    reqs_to_abort: list[str] = field(default_factory=list)
    """Core request ids (an n > 1 sample's own id) that a stop string finished."""


@dataclass
class _Sample:
    output: CompletionOutput
    """Cumulative: all text, token ids and logprobs so far."""
    detok: IncrementalDetokenizer
    # Delta mode: how much of `output` earlier RequestOutputs carried.
    num_sent_text: int = 0
    num_sent_tokens: int = 0
    num_sent_logprobs: int = 0
    sent_finished: bool = False


@dataclass
class _RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    samples: list[_Sample]
    metrics: RequestMetrics
    delta: bool
    num_cached_tokens: int = 0
    kv_transfer_params: dict | None = None

    @property
    def finished(self) -> bool:
        return all(s.output.finish_reason is not None for s in self.samples)


class OutputProcessor:
    """tokenizer: the HF tokenizer; vocab_size, max_model_len, max_logprobs: the engine's limits
    that add_request checks."""

    def __init__(self, tokenizer: Any, vocab_size: int, max_model_len: int, max_logprobs: int):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.max_logprobs = max_logprobs
        self.requests: dict[str, _RequestState] = {}
        self.num_prompt_tokens = 0
        """Prompt tokens of the requests added (total)."""
        self.num_generation_tokens = 0
        """Tokens that reached an output (total)."""

    def add_request(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                    params: SamplingParams, arrival_time: float | None = None,
                    delta: bool = False) -> None:
        """Check a request and start its outputs. delta=False: each RequestOutput is cumulative
        (the live per-sample outputs); delta=True: it holds what is new since the last one.
        Raises ValueError for a request the engine cannot serve."""
        self._check(request_id, prompt_token_ids, params)
        samples = [_Sample(CompletionOutput(index=i, logprobs=[] if params.logprobs is not None
                                            else None),
                           IncrementalDetokenizer(
                               self.tokenizer, prompt_token_ids,
                               skip_special_tokens=params.skip_special_tokens, stop=params.stop,
                               include_stop_str_in_output=params.include_stop_str_in_output))
                   for i in range(params.n)]
        self.requests[request_id] = _RequestState(
            request_id, prompt, list(prompt_token_ids), samples,
            RequestMetrics(arrival_time=arrival_time or time.time()), delta)
        self.num_prompt_tokens += len(prompt_token_ids)

    def _check(self, request_id: str, prompt_token_ids: list[int],
               params: SamplingParams) -> None:
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        bad = [t for t in prompt_token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"request {request_id!r}: token id {bad[0]} is outside the "
                             f"vocabulary [0, {self.vocab_size})")
        bad = [t for t in (params.logit_bias or {}) if t >= self.vocab_size]
        if bad:
            raise ValueError(f"request {request_id!r}: logit_bias token id {bad[0]} is outside "
                             f"the vocabulary [0, {self.vocab_size})")
        bad = [t for t in params.stop_token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"request {request_id!r}: stop token id {bad[0]} is outside the "
                             f"vocabulary [0, {self.vocab_size})")
        # the sampler keeps top_k in int32 rows and seeds a torch generator (int64)
        if params.top_k >= 2**31:
            raise ValueError(f"top_k={params.top_k} is too large (a top_k of the vocabulary "
                             f"size or more is the same as -1)")
        if params.seed is not None and not 0 <= params.seed < 2**63:
            raise ValueError(f"seed={params.seed} must be in [0, 2**63)")
        if len(prompt_token_ids) >= self.max_model_len:
            raise ValueError(
                f"request {request_id!r}: the prompt has {len(prompt_token_ids)} tokens, but "
                f"max_model_len is {self.max_model_len}: no room to generate")
        if params.logprobs is not None and params.logprobs > self.max_logprobs:
            raise ValueError(f"logprobs={params.logprobs} exceeds max_logprobs="
                             f"{self.max_logprobs}")

    def abort_requests(self, request_ids: Iterable[str]) -> None:
        """Forget requests (the caller aborts them in the core); unknown ids are ignored."""
        for rid in request_ids:
            self.requests.pop(rid, None)

    def reject_request(self, request_id: str) -> None:
        """The core refused a request added here: forget it as if it had never been added."""
        req = self.requests.pop(request_id, None)
        if req is not None:
            self.num_prompt_tokens -= len(req.prompt_token_ids)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def process_outputs(self, outputs: Iterable[EngineCoreOutput]) -> ProcessedOutputs:
        """Apply one engine step's token outputs; returns one RequestOutput per request that
        changed (finished requests are forgotten) and the samples to abort in the core."""
        result = ProcessedOutputs()
        now = time.time()
        touched: dict[str, _RequestState] = {}
        for out in outputs:
            rid = out.parent_req_id or out.req_id
            req = self.requests.get(rid)
            if req is None:
                continue  # aborted, or finished here before the core saw it
            sample = req.samples[out.sample_index]
            if sample.output.finish_reason is not None:
                continue  # a stop string ended it; the core made this before the abort
            if self._apply(req, sample, out, now) and not out.finished:
                result.reqs_to_abort.append(out.req_id)
            touched[rid] = req
        for rid, req in touched.items():
            finished = req.finished
            if finished:
                req.metrics.finished_time = now
                del self.requests[rid]
            outputs = _deltas(req) if req.delta else [s.output for s in req.samples]
            if req.delta and not outputs and not finished:
                continue
            result.request_outputs.append(RequestOutput(
                request_id=rid, prompt=req.prompt, prompt_token_ids=req.prompt_token_ids,
                outputs=outputs, finished=finished, num_cached_tokens=req.num_cached_tokens,
                metrics=req.metrics, kv_transfer_params=req.kv_transfer_params))
        return result

    def _apply(self, req: _RequestState, sample: _Sample, out: EngineCoreOutput,
               now: float) -> bool:
        """Append one output to a running sample; True if a stop string ended it."""
        comp = sample.output
        if req.metrics.first_token_time is None:
            req.metrics.first_token_time = now
        req.metrics.last_token_time = now
        req.num_cached_tokens = out.num_cached_tokens
        if out.kv_transfer_params is not None:
            req.kv_transfer_params = out.kv_transfer_params
        self.num_generation_tokens += len(out.new_token_ids)
        comp.token_ids.extend(out.new_token_ids)
        if comp.logprobs is not None and out.new_logprobs:
            comp.logprobs.extend(out.new_logprobs)
        # Only text the detokenizer released: it holds back what may start a stop string.
        delta, stop_str = sample.detok.append(out.new_token_ids)
        if out.finished and stop_str is None:
            delta += sample.detok.flush()
        comp.text += delta
        if stop_str is not None:
            comp.finish_reason, comp.stop_reason = "stop", stop_str
            return True
        if out.finished:
            comp.finish_reason, comp.stop_reason = out.finish_reason, out.stop_reason
        return False


def _deltas(req: _RequestState) -> list[CompletionOutput]:
    """What each sample gained since the previous RequestOutput (samples with nothing new and
    no finish are left out)."""
    deltas = []
    for s in req.samples:
        comp = s.output
        if s.sent_finished:
            continue
        new_tokens = comp.token_ids[s.num_sent_tokens:]
        new_text = comp.text[s.num_sent_text:]
        if not new_tokens and not new_text and comp.finish_reason is None:
            continue
        logprobs = None
        if comp.logprobs is not None:
            logprobs = comp.logprobs[s.num_sent_logprobs:]
            s.num_sent_logprobs = len(comp.logprobs)
        s.num_sent_tokens = len(comp.token_ids)
        s.num_sent_text = len(comp.text)
        s.sent_finished = comp.finish_reason is not None
        deltas.append(CompletionOutput(comp.index, new_text, new_tokens, comp.cumulative_logprob,
                                       logprobs, comp.finish_reason, comp.stop_reason))
    return deltas
