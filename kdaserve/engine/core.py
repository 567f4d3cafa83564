# SPDX-License-Identifier: Apache-2.0
"""The engine core: the scheduler and the model runner, stepping token by token.

`EngineCore` takes requests that are already validated and tokenized, and each step returns
token-level outputs (new token ids, logprobs, the scheduler's finish reasons: EOS, stop token
ids, length, abort). It never detokenizes and never sees stop strings: those are the front's
(OutputProcessor), which aborts a request here when a stop string ends it. Every call into
kdaserve.worker is made here. Structured outputs' grammar state (kdaserve.structured_output)
lives here too, beside the scheduler: after each schedule it puts the step's token bitmask into
the SchedulerOutput, after each step it advances the grammars over the sampled tokens and cuts
the next drafts where the grammar refuses them; without a structured request alive every hook
is skipped.

`EngineCoreProc` runs an EngineCore in its own process for the server: a busy loop that takes
new / abort / stats messages from the input socket, steps while work exists and pushes each
step's token outputs back (kdaserve.engine.core_client is the wire protocol). When idle it
blocks on the socket (1 s at a time, to notice a dead parent). The front owns its lifetime:
SIGINT (a terminal's Ctrl-C reaches the whole process group) is ignored, so that the front's
graceful shutdown still has an engine; SIGTERM ends it quietly.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import os
import signal
import time
import traceback
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import msgspec
import zmq

from kdaserve.config import EngineConfig
from kdaserve.core.engine_output import EngineCoreOutput, SchedulerStats
from kdaserve.core.sched_output import SchedulerOutput
from kdaserve.core.scheduler import Scheduler
from kdaserve.core.offload import OffloadManager
from kdaserve.disagg.factory import make_connector_scheduler
from kdaserve.engine.arg_utils import config_from_kwargs
from kdaserve.engine.core_client import (AbortRequests, AddRequest, CoreFailed, CoreOutput,
                                         GetStats, InputMessage, OutputMessage, Outputs, Ready,
                                         RequestFailed, Shutdown, StartupFailed, Stats)
from kdaserve.engine.floor import StepFloor, measure_copy_bandwidth
from kdaserve.models.tokenizer import get_tokenizer
from kdaserve.request import Request, RequestStatus
from kdaserve.sampling_params import SamplingParams
from kdaserve.structured_output.manager import StructuredOutputManager
from kdaserve.structured_output.spec import validate_structured_outputs

if TYPE_CHECKING:
    from kdaserve.worker.input_batch import LaunchedStep

logger = logging.getLogger(__name__)

SLOW_STEP_S = 1.0
"""A step that computes prompt tokens (a prefill chunk, alone or with decodes) and takes longer
than this is logged: a full chunk of max_num_batched_tokens takes a fraction of it on a GPU.
On CUDA the line is a warning, since it shows mid-serving JIT or autotune stalls; elsewhere (the
CPU reference path is slow by nature) it is a debug line."""
SLOW_DECODE_STEP_S = 0.1
"""The same for a step without prompt tokens (decodes, speculative verifies): those take
milliseconds on a GPU, so anything near this is a stall the serving log should show."""

_IDLE_POLL_MS = 1000
_TRANSFER_POLL_MS = 5
"""Input wait of an idle loop that still has KV transfers to poll (held requests, loads)."""
_GRAMMAR_WAIT_S = 0.005
"""How long a step with nothing to schedule waits for a grammar compilation before returning."""
_TRANSFER_WAIT_S = 0.002
"""How long a step with nothing to schedule but KV transfers in flight (loads, requests held
for a remote reader) sleeps before returning: the worker polls the transfers each step."""


def slow_step_log_level(device_type: str) -> int:
    """The level of the slow-step line: a warning only where JIT compilation or autotuning
    of a new shape is its likely cause (Triton kernels and CUDA graphs, on CUDA)."""
    return logging.WARNING if device_type == "cuda" else logging.DEBUG


def serve_compile_log(device_type: str):
    """A CompileLog (kernels/jit_log.py) where Triton kernels run (CUDA), else None: after the
    warm-up every compile or disk-cache load is a serve-time stall, named in the log."""
    if device_type != "cuda":
        return None
    try:
        from kdaserve.kernels.jit_log import CompileLog

        return CompileLog()
    except ImportError:   # no Triton: nothing compiles
        return None


def config_eos_token_ids(config: EngineConfig) -> list[int]:
    """The model's EOS ids: config.json's and generation_config.json's (the front adds its
    tokenizer's, see output_processor.eos_token_ids)."""
    ids = list(config.model_config.arch.eos_token_id)
    gen_path = os.path.join(config.model_config.model, "generation_config.json")
    if os.path.isfile(gen_path):
        with open(gen_path) as f:
            eos = json.load(f).get("eos_token_id")
        ids += [eos] if isinstance(eos, int) else list(eos or [])
    return sorted(set(ids))


@dataclass
class _StepInFlight:
    so: SchedulerOutput
    context: int | None
    """Total context of a decode-only step (for the floor gauge), else None."""
    prefill: bool
    """Some request computes prompt (or recomputed) tokens in this step."""
    t0: float
    """perf_counter() at launch."""
    launched: LaunchedStep


class EngineCore:
    def __init__(self, config: EngineConfig) -> None:
        from kdaserve.worker.executor import make_worker

        self.engine_config = config
        self.worker = make_worker(config)
        try:
            self._start(config)
        except BaseException:
            self.shutdown()
            raise

    def _start(self, config: EngineConfig) -> None:
        self.model_runner = self.worker.model_runner
        self.step_floor = self._make_step_floor()
        self.step_floor_ratio: float | None = None
        num_blocks, num_slots = self.worker.determine_num_blocks_and_slots()
        self.worker.initialize_cache(num_blocks, num_slots)
        self.scheduler = Scheduler(
            config.scheduler_config, config.cache_config, num_blocks, num_slots,
            config.speculative_config, max_model_len=config.model_config.max_model_len,
            connector=make_connector_scheduler(config, self.worker.kv_side_channel_ports),
            decode_context_parallel_size=config.parallel_config.decode_context_parallel_size,
            offload=(OffloadManager(**self.worker.offload_spec)
                     if self.worker.offload_spec is not None else None))
        self._in_flight: _StepInFlight | None = None
        """The launched step whose output has not been processed (async scheduling)."""
        self._last_collect: float | None = None
        self._slow_step_level = slow_step_log_level(self.model_runner.device.type)
        mc = config.model_config
        self.structured_output = StructuredOutputManager(
            functools.partial(get_tokenizer, mc.tokenizer, mc.trust_remote_code),
            mc.arch.vocab_size)
        self.scheduler.grammar_ready = self.structured_output.grammar_ready
        spec = self.model_runner.spec
        self.scheduler.async_spec = spec is not None and spec.device_drafts
        self._compiles = serve_compile_log(self.model_runner.device.type)
        """Triton compiles after the warm-up (CUDA): each step's are logged with it."""

    # ------------------------------------------------------------------------------ requests

    def add_request(self, request: Request) -> None:
        """Queue a request; a structured-output one is checked here (ValueError when its
        schema / pattern / grammar does not parse) and its grammar starts compiling."""
        structured = request.sampling_params.structured_outputs
        spec = validate_structured_outputs(structured) if structured is not None else None
        self.scheduler.add_request(request)
        if spec is not None:
            self.structured_output.add_request(request, spec)

    def abort_requests(self, request_ids: list[str], stopped: bool = False) -> None:
        """Finish requests from outside and free their blocks and slots. stopped: a stop
        string ended them (finished as stopped, so a turn-end checkpoint keeps their state).
        An n > 1 request's own id finishes all its samples; unknown ids are ignored."""
        status = RequestStatus.FINISHED_STOPPED if stopped else RequestStatus.FINISHED_ABORTED
        self.scheduler.finish_requests(request_ids, status)

    def has_unfinished_requests(self) -> bool:
        return self._in_flight is not None or self.scheduler.has_unfinished_requests()

    def has_pending_transfers(self) -> bool:
        """KV transfers to poll (loads in flight, requests held for a remote reader): the
        loop keeps stepping for them, with short sleeps when nothing else is to do."""
        return self.scheduler.has_pending_transfers()

    def unfinished_request_ids(self) -> list[str]:
        """The ids the front added (an n > 1 request's own id) that are still running here."""
        return list(dict.fromkeys(r.parent_req_id or r.req_id
                                  for r in self.scheduler.requests.values()))

    def shutdown(self) -> None:
        """Finish the offload tier's file jobs (so that its disk index records them), then
        stop the other tensor-parallel ranks' processes and the worker's threads."""
        compiles = getattr(self, "_compiles", None)
        if compiles is not None:
            compiles.close()
            self._compiles = None
        scheduler = getattr(self, "scheduler", None)
        if scheduler is not None and scheduler.offload is not None:
            self._drain_offload(scheduler)
            scheduler.offload.close()
        stop = getattr(self.worker, "shutdown", None)
        if stop is not None:
            stop()

    def _drain_offload(self, scheduler, timeout_s: float = 30.0) -> None:
        deadline = time.monotonic() + timeout_s
        try:
            while (scheduler.offload.busy and not self.has_unfinished_requests()
                   and self.lost_rank is None and time.monotonic() < deadline):
                self.step()
                time.sleep(0.002)
        except Exception as e:  # noqa: BLE001 - shutting down: what was not recorded is lost
            logger.warning("offload tier: file jobs not drained at shutdown: %s", e)

    @property
    def lost_rank(self) -> str | None:
        """Why the engine can no longer step (a tensor-parallel rank died), else None."""
        return getattr(self.worker, "dead", None)

    def reset_prefix_cache(self) -> int:
        """Drop every cached KV block and KDA checkpoint not held by a running request;
        returns what was dropped (vLLM's reset_prefix_cache)."""
        return self.scheduler.reset_prefix_cache()

    # ---------------------------------------------------------------------------------- step

    def step(self) -> list[EngineCoreOutput]:
        """One engine step; returns the token outputs of the step(s) it completed. With async
        scheduling the next step is scheduled and launched before the previous one's output is
        processed: the host work of one step overlaps the device work of the other, and each
        token comes out one call later. A step in flight that the next one may not overlap is
        completed and returned on its own, so the front's aborts (stop strings) reach the
        scheduler before it schedules again."""
        prev, self._in_flight = self._in_flight, None
        if prev is not None and not self._can_overlap():
            return self._process(prev, next_scheduled=False)
        structured = self.structured_output.active
        failed = self._fail_grammars() if structured else []
        so = self.scheduler.schedule()
        if structured:
            self.structured_output.grammar_bitmask(so, self.scheduler.requests)
        cur = _StepInFlight(so, self._decode_context(so), so.has_prefill(), time.perf_counter(),
                            self.worker.launch(so))
        outputs = failed + (self._process(prev, next_scheduled=True) if prev is not None
                            else [])
        if cur.launched.output is None and self._can_overlap():
            self._in_flight = cur
        else:
            outputs += self._process(cur, next_scheduled=False)
        if structured and so.is_empty and prev is None:
            self.structured_output.wait_for_compile(_GRAMMAR_WAIT_S)
        elif so.is_empty and prev is None and self.scheduler.has_pending_transfers():
            time.sleep(_TRANSFER_WAIT_S)
        return outputs

    def _can_overlap(self) -> bool:
        """May the next step be scheduled before the last one's output is processed? Not with
        penalties or a grammar: their next logits depend on the token still in flight. Under
        speculation only where the proposer drafts on the device (SpecDecoder.device_drafts:
        the next step's drafts and positions come from the device), and not while a request
        is short of its min_tokens (its per-position bans need its exact output count)."""
        spec = self.model_runner.spec
        if not self.engine_config.scheduler_config.async_scheduling:
            return False
        if spec is not None and not spec.device_drafts:
            return False
        return not any(r.sampling_params.has_penalties
                       or r.sampling_params.structured_outputs is not None
                       or (spec is not None
                           and r.num_output_tokens < r.sampling_params.min_tokens)
                       for r in self.scheduler.running)

    def _process(self, step: _StepInFlight, next_scheduled: bool) -> list[EngineCoreOutput]:
        """Collect a launched step (waits for its sampled ids), then update the scheduler.
        next_scheduled: the next step was scheduled meanwhile, so this step's drafts are
        already in it (as placeholders read on the device) and are not handed over again."""
        so = step.so
        ro = self.worker.collect(step.launched)
        now = time.perf_counter()
        # The device ran this step from its launch or from the previous step's end, whichever
        # came later (overlapped steps): the time per step that limits throughput.
        elapsed = now - max(step.t0, self._last_collect or 0.0)
        self._last_collect = now
        self._record_step_time(step, elapsed)
        outputs = self.scheduler.update_from_output(so, ro)
        drafts = {} if next_scheduled else ro.draft_token_ids
        if self.structured_output.active:
            self._end_refused(outputs, self.structured_output.accept_tokens(outputs))
            if drafts:
                drafts = self.structured_output.validate_drafts(drafts)
        if drafts:
            self.scheduler.update_draft_token_ids(drafts)
        return outputs

    # ------------------------------------------------------------------- structured outputs

    def _end_refused(self, outputs: list[EngineCoreOutput], refused: list[str]) -> None:
        """Abort requests whose sampled tokens their grammar refused (an engine fault: the
        masks allow only grammatical tokens); their outputs this step carry the abort."""
        if not refused:
            return
        self.scheduler.finish_requests(refused, RequestStatus.FINISHED_ABORTED)
        for out in outputs:
            if out.req_id in refused and out.finish_reason is None:
                out.finish_reason = "abort"

    def _fail_grammars(self) -> list[EngineCoreOutput]:
        """Abort the requests whose grammar failed to compile; one final output per sample."""
        outputs = []
        for front_id, reason in self.structured_output.take_failed():
            logger.error("request %s: its grammar failed to compile (%s); aborting it",
                         front_id, reason)
            for r in list(self.scheduler.requests.values()):
                if (r.parent_req_id or r.req_id) != front_id:
                    continue
                ids = ([(r.child_req_id(i), r.req_id, i) for i in range(r.num_samples)]
                       if r.is_fork_parent else [(r.req_id, r.parent_req_id, r.sample_index)])
                outputs += [EngineCoreOutput(rid, [], finish_reason="abort",
                                             parent_req_id=parent, sample_index=i)
                            for rid, parent, i in ids]
            self.scheduler.finish_requests(front_id, RequestStatus.FINISHED_ABORTED)
            self.structured_output.forget(front_id)
        return outputs

    # ------------------------------------------------------------------------ floor, stats

    def _make_step_floor(self) -> StepFloor:
        from kdaserve.attention.caches import state_bytes_per_slot

        runner = self.model_runner
        args = self.engine_config.model_config.arch
        pc = self.engine_config.parallel_config
        # one rank's bytes: its weight shard (the model's tensors), its KDA heads, and under
        # decode context parallelism its 1/dcp share of each context's latents
        floor = StepFloor.for_model(runner.model, args, runner.dtype.itemsize,
                                    state_bytes_per_slot(args, runner.dtype,
                                                         pc.tensor_parallel_size),
                                    measure_copy_bandwidth(runner.device))
        dcp = pc.decode_context_parallel_size
        return dataclasses.replace(floor, kv_bytes_per_token=floor.kv_bytes_per_token // dcp)

    def _decode_context(self, so: SchedulerOutput) -> int | None:
        """Total context of a decode-only step (None if any request computes more than one
        token: the floor gauge tracks decode steps only)."""
        if (so.scheduled_new_reqs or not so.num_scheduled_tokens
                or any(n != 1 for n in so.num_scheduled_tokens.values())):
            return None
        requests = self.scheduler.requests
        return sum(requests[rid].num_computed_tokens + 1 for rid in so.num_scheduled_tokens)

    def _record_step_time(self, step: _StepInFlight, elapsed: float) -> None:
        so, context = step.so, step.context
        if context is not None:
            floor = self.step_floor.seconds(len(so.num_scheduled_tokens), context)
            self.step_floor_ratio = elapsed / floor
        # With async scheduling the next step is launched (its kernels built at launch) before
        # this one is collected: a build for step N + 1 may show with step N.
        compiled = self._compiles.take() if self._compiles is not None else []
        slow = (elapsed > (SLOW_STEP_S if step.prefill else SLOW_DECODE_STEP_S)
                and logger.isEnabledFor(self._slow_step_level))
        if not (slow or compiled):
            return
        names = ", ".join(f"{e['kernel']} {e['s']:.2f} s" for e in compiled)
        kind = (" (decode only)" if context else "" if step.prefill
                else " (no prompt tokens)")
        if slow:
            if compiled:
                guess = f": Triton built or loaded {names}"
            elif self._slow_step_level >= logging.WARNING:
                guess = ": JIT compilation or autotuning of a new shape?"
            else:
                guess = ""
            logger.log(self._slow_step_level, "slow step: %.2f s for %d tokens of %d requests "
                       "(%d new)%s%s", elapsed, so.total_num_scheduled_tokens,
                       len(so.num_scheduled_tokens), len(so.scheduled_new_reqs), kind, guess)
        elif compiled:
            logger.warning("Triton built or loaded %s while serving (a step of %d tokens of %d "
                           "requests%s, %.3f s): a composition the warm-up missed", names,
                           so.total_num_scheduled_tokens, len(so.num_scheduled_tokens), kind,
                           elapsed)

    def get_stats(self) -> SchedulerStats:
        """Everything but the token counters, which the front keeps."""
        stats = self.scheduler.get_stats()
        stats.step_floor_ratio = self.step_floor_ratio
        spec = self.spec_decoding_stats
        if spec is not None:
            stats.spec_num_drafts = spec.num_drafts
            stats.spec_num_draft_tokens = spec.num_draft_tokens
            stats.spec_num_accepted_tokens = spec.num_accepted_tokens
            stats.spec_kda_state_bytes_written = spec.kda_state_bytes_written
        return stats

    @property
    def spec_decoding_stats(self):
        """SpecDecodingStats since start-up (None without speculative decoding)."""
        return self.worker.spec_stats


# ------------------------------------------------------------------------------- the process


class EngineCoreProc:
    """The loop inside the core process (constructed there, from picklable arguments)."""

    def __init__(self, core: EngineCore, input_sock: zmq.Socket, output_sock: zmq.Socket,
                 parent_pid: int):
        self.core = core
        self.input_sock = input_sock
        self.output_sock = output_sock
        self.parent_pid = parent_pid
        self.encoder = msgspec.msgpack.Encoder()
        self.decoder = msgspec.msgpack.Decoder(InputMessage)
        self.running = True

    def send(self, msg: OutputMessage) -> None:
        self.output_sock.send(self.encoder.encode(msg), copy=False)

    def run(self) -> None:
        poller = zmq.Poller()
        poller.register(self.input_sock, zmq.POLLIN)
        while self.running:
            busy = self.core.has_unfinished_requests()
            transfers = not busy and self.core.has_pending_transfers()
            timeout = 0 if busy else _TRANSFER_POLL_MS if transfers else _IDLE_POLL_MS
            if poller.poll(timeout):
                self._drain_inputs()
            if not self.running:
                return
            if os.getppid() != self.parent_pid:
                logger.warning("engine core: parent process died, exiting")
                return
            if self.core.has_unfinished_requests() or self.core.has_pending_transfers():
                self._step()   # with transfers only: the worker polls them

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
                self.core.add_request(Request(
                    msg.request_id, msg.prompt_token_ids, SamplingParams(**msg.sampling_params),
                    eos_token_ids=msg.eos_token_ids, arrival_time=msg.arrival_time,
                    cache_salt=msg.cache_salt, kv_transfer_params=msg.kv_transfer_params))
            except ValueError as e:
                self.send(RequestFailed(msg.request_id, str(e), bad_request=True))
        elif isinstance(msg, AbortRequests):
            self.core.abort_requests(msg.request_ids, stopped=msg.stopped)
        elif isinstance(msg, GetStats):
            self.send(Stats(msg.nonce, dataclasses.asdict(self.core.get_stats())))
        elif isinstance(msg, Shutdown):
            self.running = False

    def _step(self) -> None:
        try:
            outputs = self.core.step()
        except Exception:
            # The core's state may be inconsistent: fail the requests it held, free them,
            # and keep serving new ones. If even aborting fails, die (health then reports it).
            message = traceback.format_exc()
            logger.error("engine core: step failed:\n%s", message)
            request_ids = self.core.unfinished_request_ids()
            self.send(CoreFailed(message.strip().splitlines()[-1], request_ids))
            self.core.abort_requests(request_ids)
            if self.core.lost_rank is not None:   # no further step can run: exit non-zero
                logger.error("engine core: %s; exiting", self.core.lost_rank)
                raise SystemExit(1)
            return
        if outputs:
            self.send(Outputs([CoreOutput(**vars(o)) for o in outputs]))


def run_engine_core(engine_kwargs: dict[str, Any], input_addr: str, output_addr: str,
                    parent_pid: int, log_level: str = "INFO") -> None:
    """Entry point of the core process: build the core, report Ready, then loop until the
    front sends Shutdown, SIGTERM arrives or the parent is gone."""
    logging.basicConfig(level=log_level.upper(),
                        format="%(asctime)s %(levelname)s [engine-core] %(message)s")
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    ctx = zmq.Context()
    input_sock = ctx.socket(zmq.PULL)
    input_sock.connect(input_addr)
    output_sock = ctx.socket(zmq.PUSH)
    output_sock.connect(output_addr)
    encoder = msgspec.msgpack.Encoder()
    try:
        core = EngineCore(config_from_kwargs(engine_kwargs))
    except Exception as e:  # noqa: BLE001 - any start-up failure goes back to the front
        # the front prints the one-line reason; the traceback is for debugging
        logger.debug("engine core: start-up failed:\n%s", traceback.format_exc())
        msg = str(e) if isinstance(e, ValueError) else f"{type(e).__name__}: {e}"
        output_sock.send(encoder.encode(StartupFailed(msg)))
        output_sock.close(linger=2000)
        ctx.term()
        return
    if hasattr(core.worker, "on_rank_death"):   # tensor parallel: never outlive a lost rank
        from kdaserve.worker.executor import exit_now

        core.worker.on_rank_death = exit_now
    output_sock.send(encoder.encode(Ready(_engine_info(core))))
    proc = EngineCoreProc(core, input_sock, output_sock, parent_pid)
    try:
        proc.run()
    finally:
        core.worker.shutdown()
        input_sock.close(linger=0)
        output_sock.close(linger=1000)
        ctx.term()
        core.shutdown()
        if core.lost_rank is not None:
            # The process groups' threads still wait on the lost peer; their destructors at
            # interpreter exit would abort. Nothing is left to clean up: leave with status 1.
            logging.shutdown()
            os._exit(1)


def _exit_on_sigterm(signum, frame) -> None:
    """SIGTERM: leave the loop through SystemExit (its finally closes the sockets); no
    traceback, exit status 0."""
    raise SystemExit(0)


def _engine_info(core: EngineCore) -> dict[str, Any]:
    """What the front needs to know about the core it talks to."""
    cfg = core.engine_config
    stats = core.get_stats()
    return {
        "model": cfg.model_config.model,
        "tokenizer": cfg.model_config.tokenizer,
        "max_model_len": cfg.model_config.max_model_len,
        "max_num_seqs": cfg.scheduler_config.max_num_seqs,
        "max_logprobs": cfg.max_logprobs,
        "device": str(cfg.device),
        "num_total_blocks": stats.num_total_blocks,
        "num_total_state_slots": stats.num_total_state_slots,
        "eos_token_ids": config_eos_token_ids(cfg),
        "vocab_size": cfg.model_config.arch.vocab_size,
        "kv_role": cfg.kv_transfer_config.kv_role if cfg.kv_transfer_config else None,
    }
