"""LLMEngine: add_request / step / abort over the scheduler and the model runner.

Used in-process by the offline `LLM` and, inside the engine-core process, by the server.
"""

from __future__ import annotations

import logging
import os
import time
from typing import TYPE_CHECKING

import torch
from dataclasses import dataclass, fields

from kdaserve.config import (CacheConfig, EngineConfig, KernelConfig, LoadConfig, ModelConfig,
                             ParallelConfig, SchedulerConfig, SpeculativeConfig)
from kdaserve.core.engine_output import EngineCoreOutput
from kdaserve.core.sched_output import SchedulerOutput
from kdaserve.core.scheduler import Scheduler
from kdaserve.engine.detokenizer import IncrementalDetokenizer
from kdaserve.engine.floor import StepFloor, measure_copy_bandwidth
from kdaserve.engine.stats import EngineStats
from kdaserve.outputs import CompletionOutput, RequestMetrics, RequestOutput
from kdaserve.request import Request, RequestStatus
from kdaserve.sampling_params import SamplingParams
from kdaserve.attention.caches import state_bytes_per_slot

if TYPE_CHECKING:
    from kdaserve.worker.input_batch import LaunchedStep

logger = logging.getLogger(__name__)

SLOW_STEP_S = 1.0
"""A step slower than this is logged as a warning (a decode step takes milliseconds and a full
8K-token prefill well under this): it shows mid-serving JIT or autotune stalls."""


@dataclass
class _Sample:
    output: CompletionOutput
    detok: IncrementalDetokenizer


@dataclass
class _EngineRequest:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    samples: list[_Sample]
    metrics: RequestMetrics
    num_cached_tokens: int = 0

    @property
    def finished(self) -> bool:
        return all(s.output.finish_reason is not None for s in self.samples)


def default_max_num_batched_tokens(device: str) -> int:
    """vLLM's rule: 16384 on GPUs with >= 160 GiB of memory, else 8192."""
    if device in ("auto", "cuda") and torch.cuda.is_available():
        if torch.cuda.get_device_properties(0).total_memory >= 160 * 2**30:
            return 16384
    return 8192


def _config_from_kwargs(kwargs: dict) -> EngineConfig:
    """vLLM-style flat kwargs (model=, max_num_seqs=, ...) -> EngineConfig."""
    kwargs = dict(kwargs)
    groups = {}
    for cls in (ModelConfig, CacheConfig, SchedulerConfig, ParallelConfig, LoadConfig,
                KernelConfig):
        names = {f.name for f in fields(cls)}
        groups[cls] = {k: kwargs.pop(k) for k in list(kwargs) if k in names
                       and (cls is not SchedulerConfig or k != "max_model_len")}
    spec = kwargs.pop("speculative_config", None) or {}
    if not isinstance(spec, dict):
        raise ValueError(f"speculative_config must be a dict, got {type(spec).__name__}")
    engine_keys = {f.name for f in fields(EngineConfig)} - {
        "model_config", "cache_config", "scheduler_config", "parallel_config",
        "speculative_config", "load_config", "kernel_config"}
    engine_kwargs = {k: kwargs.pop(k) for k in list(kwargs) if k in engine_keys}
    if kwargs:
        raise ValueError(f"unknown engine arguments: {sorted(kwargs)}")
    model_config = ModelConfig(**groups[ModelConfig])
    load = groups[LoadConfig]
    load.setdefault("seed", model_config.seed)
    sched = groups[SchedulerConfig]
    sched["max_model_len"] = model_config.max_model_len
    if sched.get("max_num_batched_tokens") is None:
        sched["max_num_batched_tokens"] = default_max_num_batched_tokens(
            engine_kwargs.get("device", "auto"))
    return EngineConfig(
        model_config=model_config, cache_config=CacheConfig(**groups[CacheConfig]),
        scheduler_config=SchedulerConfig(**sched),
        parallel_config=ParallelConfig(**groups[ParallelConfig]),
        speculative_config=SpeculativeConfig(**spec), load_config=LoadConfig(**load),
        kernel_config=KernelConfig(**groups[KernelConfig]), **engine_kwargs)


def _eos_token_ids(config: EngineConfig, tokenizer) -> list[int]:
    ids = list(config.model_config.arch.eos_token_id)
    gen_path = os.path.join(config.model_config.model, "generation_config.json")
    if os.path.isfile(gen_path):
        import json

        with open(gen_path) as f:
            eos = json.load(f).get("eos_token_id")
        ids += [eos] if isinstance(eos, int) else list(eos or [])
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.append(tokenizer.eos_token_id)
    return sorted(set(ids))


@dataclass
class _StepInFlight:
    so: SchedulerOutput
    context: int | None
    """Total context of a decode-only step (for the floor gauge), else None."""
    t0: float
    """perf_counter() at launch."""
    launched: LaunchedStep | None = None


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        from transformers import AutoTokenizer

        from kdaserve.worker.worker import Worker

        self.engine_config = config
        mc = config.model_config
        self.tokenizer = AutoTokenizer.from_pretrained(mc.tokenizer)
        self.eos_token_ids = _eos_token_ids(config, self.tokenizer)
        self.vocab_size = mc.arch.vocab_size
        self.worker = Worker(config)
        self.model_runner = self.worker.model_runner
        self.step_floor = self._make_step_floor()
        self.step_floor_ratio: float | None = None
        num_blocks, num_slots = self.worker.determine_num_blocks_and_slots()
        self.worker.initialize_cache(num_blocks, num_slots)
        self.scheduler = Scheduler(config.scheduler_config, config.cache_config, num_blocks,
                                   num_slots, config.speculative_config,
                                   max_model_len=mc.max_model_len)
        self.requests: dict[str, _EngineRequest] = {}
        self._in_flight: _StepInFlight | None = None
        """The launched step whose output has not been processed (async scheduling)."""
        self._last_collect: float | None = None
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0

    @classmethod
    def from_engine_args(cls, **kwargs) -> "LLMEngine":
        return cls(_config_from_kwargs(kwargs))

    # -----------------------------------------------------------------------------------------

    def reset_prefix_cache(self) -> int:
        """Drop every cached KV block and KDA checkpoint not held by a running request;
        returns what was dropped (vLLM's reset_prefix_cache)."""
        return self.scheduler.reset_prefix_cache()

    def add_request(self, request_id: str, prompt_token_ids: list[int],
                    sampling_params: SamplingParams, arrival_time: float | None = None,
                    prompt: str | None = None, cache_salt: str | None = None) -> None:
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        bad = [t for t in prompt_token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"request {request_id!r}: token id {bad[0]} is outside the "
                             f"vocabulary [0, {self.vocab_size})")
        bad = [t for t in (sampling_params.logit_bias or {}) if t >= self.vocab_size]
        if bad:
            raise ValueError(f"request {request_id!r}: logit_bias token id {bad[0]} is outside "
                             f"the vocabulary [0, {self.vocab_size})")
        max_len = self.engine_config.model_config.max_model_len
        if len(prompt_token_ids) >= max_len:
            raise ValueError(
                f"request {request_id!r}: the prompt has {len(prompt_token_ids)} tokens, but "
                f"max_model_len is {max_len}: no room to generate")
        if sampling_params.logprobs is not None and \
                sampling_params.logprobs > self.engine_config.max_logprobs:
            raise ValueError(f"logprobs={sampling_params.logprobs} exceeds max_logprobs="
                             f"{self.engine_config.max_logprobs}")
        request = Request(request_id, prompt_token_ids, sampling_params,
                          eos_token_ids=self.eos_token_ids, arrival_time=arrival_time,
                          cache_salt=cache_salt)
        self.scheduler.add_request(request)
        samples = [_Sample(CompletionOutput(index=i, logprobs=[] if sampling_params.logprobs
                                            is not None else None),
                           IncrementalDetokenizer(
                               self.tokenizer, prompt_token_ids,
                               skip_special_tokens=sampling_params.skip_special_tokens,
                               stop=sampling_params.stop,
                               include_stop_str_in_output=sampling_params.include_stop_str_in_output))
                   for i in range(sampling_params.n)]
        self.requests[request_id] = _EngineRequest(
            request_id, prompt, list(prompt_token_ids), sampling_params, samples,
            RequestMetrics(arrival_time=arrival_time or time.time()))
        self.prompt_tokens_total += len(prompt_token_ids)

    def abort_request(self, request_ids: str | list[str]) -> None:
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)
        for rid in request_ids:
            self.requests.pop(rid, None)

    def has_unfinished_requests(self) -> bool:
        if self._in_flight is not None:
            return True
        return bool(self.requests) or self.scheduler.has_unfinished_requests()

    def _make_step_floor(self) -> StepFloor:
        runner = self.model_runner
        args = self.engine_config.model_config.arch
        elt = torch.empty((), dtype=runner.dtype).element_size()
        return StepFloor.for_model(runner.model, args, elt,
                                   state_bytes_per_slot(args, runner.dtype),
                                   measure_copy_bandwidth(runner.device))

    def _decode_context(self, so) -> int | None:
        """Total context of a decode-only step (None if any request computes more than one
        token: the floor gauge tracks decode steps only)."""
        if so.scheduled_new_reqs or not so.num_scheduled_tokens:
            return None
        total = 0
        for rid, n in so.num_scheduled_tokens.items():
            if n != 1:
                return None
            total += self.scheduler.requests[rid].num_computed_tokens + 1
        return total

    def step(self) -> list[RequestOutput]:
        """One engine step. With async scheduling the next step is scheduled and launched
        before the previous one's output is processed: the host work of one step overlaps the
        device work of the other, and each token's output comes out one call later."""
        prev, self._in_flight = self._in_flight, None
        results: list[RequestOutput] = []
        if prev is not None and not self._can_overlap():
            results, prev = self._process(prev), None
        so = self.scheduler.schedule()
        cur = _StepInFlight(so, self._decode_context(so), time.perf_counter())
        cur.launched = self.model_runner.launch(so)
        if prev is not None:
            results += self._process(prev)
        if cur.launched.output is None and self._can_overlap():
            self._in_flight = cur
        else:
            results += self._process(cur)
        return results

    def _can_overlap(self) -> bool:
        """May the next step be scheduled before the last one's output is processed?"""
        if not self.engine_config.scheduler_config.async_scheduling:
            return False
        if self.model_runner.spec is not None:
            return False
        return not any(r.sampling_params.has_penalties for r in self.scheduler.running)

    def _process(self, step: _StepInFlight) -> list[RequestOutput]:
        """Collect a launched step (waits for its sampled ids), then update the scheduler and
        the request outputs."""
        so = step.so
        ro = self.model_runner.collect(step.launched)
        now_pc = time.perf_counter()
        # The device ran this step from its launch or from the previous step's end, whichever
        # came later (overlapped steps): the time per step that limits throughput.
        elapsed = now_pc - max(step.t0, self._last_collect or 0.0)
        self._last_collect = now_pc
        self._record_step_time(so, step.context, elapsed)
        core_outputs = self.scheduler.update_from_output(so, ro)
        if ro.draft_token_ids:
            self.scheduler.update_draft_token_ids(ro.draft_token_ids)
        now = time.time()
        touched: dict[str, _EngineRequest] = {}
        for out in core_outputs:
            rid = out.parent_req_id or out.req_id
            req = self.requests.get(rid)
            if req is None:
                continue
            self._apply(req, out, now)
            touched[rid] = req
        results = []
        for rid, req in touched.items():
            finished = req.finished
            if finished:
                req.metrics.finished_time = now
                del self.requests[rid]
            results.append(RequestOutput(
                request_id=rid, prompt=req.prompt, prompt_token_ids=req.prompt_token_ids,
                outputs=[s.output for s in req.samples], finished=finished,
                num_cached_tokens=req.num_cached_tokens, metrics=req.metrics))
        return results

    def _record_step_time(self, so: SchedulerOutput, context: int | None,
                          elapsed: float) -> None:
        if context is not None:
            floor = self.step_floor.seconds(len(so.num_scheduled_tokens), context)
            self.step_floor_ratio = elapsed / floor
        if elapsed > SLOW_STEP_S:
            logger.warning("slow step: %.2f s for %d tokens of %d requests (%d new)%s: "
                           "JIT compilation or autotuning of a new shape?", elapsed,
                           so.total_num_scheduled_tokens, len(so.num_scheduled_tokens),
                           len(so.scheduled_new_reqs), " (decode only)" if context else "")

    def _apply(self, req: _EngineRequest, out: EngineCoreOutput, now: float) -> None:
        sample = req.samples[out.sample_index]
        comp = sample.output
        if comp.finish_reason is not None:
            return
        if req.metrics.first_token_time is None:
            req.metrics.first_token_time = now
        req.metrics.last_token_time = now
        req.num_cached_tokens = out.num_cached_tokens
        self.generation_tokens_total += len(out.new_token_ids)
        comp.token_ids.extend(out.new_token_ids)
        if comp.logprobs is not None and out.new_logprobs:
            comp.logprobs.extend(out.new_logprobs)
        _, stop_str = sample.detok.append(out.new_token_ids)
        if out.finished and stop_str is None:
            sample.detok.flush()
        comp.text = sample.detok.output_text
        if stop_str is not None:
            comp.finish_reason, comp.stop_reason = "stop", stop_str
            if not out.finished:
                self.scheduler.finish_requests(out.req_id, RequestStatus.FINISHED_STOPPED)
        elif out.finished:
            comp.finish_reason, comp.stop_reason = out.finish_reason, out.stop_reason

    def get_stats(self) -> EngineStats:
        s = self.scheduler.get_stats()
        spec = self.spec_decoding_stats
        return EngineStats(
            num_running=s.num_running_reqs, num_waiting=s.num_waiting_reqs,
            kv_cache_usage=s.kv_cache_usage, num_free_blocks=s.num_free_blocks,
            num_total_blocks=s.num_total_blocks, num_free_state_slots=s.num_free_state_slots,
            num_total_state_slots=s.num_total_state_slots,
            prompt_tokens_total=self.prompt_tokens_total,
            generation_tokens_total=self.generation_tokens_total,
            prefix_cache_queries=s.prefix_cache_queries, prefix_cache_hits=s.prefix_cache_hits,
            num_kda_checkpoints=s.num_kda_checkpoints,
            num_total_kda_checkpoint_slots=s.num_total_kda_checkpoint_slots,
            num_kda_checkpoint_exports=s.num_kda_checkpoint_exports,
            num_preemptions_total=s.num_preemptions,
            spec_num_drafts=spec.num_drafts if spec else 0,
            spec_num_draft_tokens=spec.num_draft_tokens if spec else 0,
            spec_num_accepted_tokens=spec.num_accepted_tokens if spec else 0,
            spec_kda_state_bytes_written=spec.kda_state_bytes_written if spec else 0,
            step_floor_ratio=self.step_floor_ratio)

    @property
    def spec_decoding_stats(self):
        """SpecDecodingStats since start-up (None without speculative decoding)."""
        runner_spec = self.model_runner.spec
        return runner_spec.stats if runner_spec is not None else None
