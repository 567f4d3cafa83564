"""SchedulerOutput -> step plan -> flattened inputs + metadata -> model -> sampler ->
ModelRunnerOutput.

The runner keeps a persistent copy of every running request (token ids, block ids, state slot,
seeded generator) keyed by req_id; each step applies the scheduler's delta to it, builds the
step's plan (attention/forward_context.py: a captured decode or verification graph, or an eager
forward) and runs it. Under speculation with device drafts (SpecDecoder.device_drafts) a step's
sampling, commit and proposal stay on the device and the next step's windows are read from
there (worker/spec_async.py). Start-up (model load, cache sizing, warm-up, graph capture) is
the worker's (worker/worker.py).
"""

from __future__ import annotations

import torch

from kdaserve.attention.builder import build_metadata
from kdaserve.attention.dcp import DCPGroup
from kdaserve.attention.forward_context import ExecMode, ForwardContext, StepPlan
from kdaserve.attention.metadata import ModelCaches
from kdaserve.config import EngineConfig
from kdaserve.core.sched_output import (DRAFT_PLACEHOLDER, ModelRunnerOutput, NewRequestData,
                                        SchedulerOutput)
from kdaserve.outputs import Logprob
from kdaserve.sample.grammar_mask import GrammarMask, apply_grammar_bitmask
from kdaserve.sample.metadata import SamplingMetadata, min_tokens_banned_ids
from kdaserve.sample.penalties import PenaltyCache, logits_processing
from kdaserve.sample.sampler import Sampler, SamplerOutput, to_logprob_dicts
from kdaserve.spec_decode.decoder import SpecDecoder
from kdaserve.worker import checkpoints
from kdaserve.worker.cuda_graphs import CudaGraphManager, DecodeGraphs
from kdaserve.worker import spec_async
from kdaserve.worker.input_batch import CachedRequestState, LaunchedStep, StepBatch
from kdaserve.worker.spec_async import (CarryRows, SpecCarry, correct_metadata,
                                        correct_spec_rows, correct_window, to_device,
                                        to_host)


class ModelRunner:
    def __init__(self, config: EngineConfig, model: torch.nn.Module, sampler: Sampler,
                 spec: SpecDecoder | None, device: torch.device, dtype: torch.dtype,
                 dcp: DCPGroup | None = None) -> None:
        """dcp: this rank's decode-context-parallel group (its steps' metadata then maps only
        the positions it stores; attention/dcp.py); None without DCP."""
        self.config = config
        self.dcp = dcp
        self.model, self.sampler, self.spec = model, sampler, spec
        self.device, self.dtype = device, dtype
        self.args = config.model_config.arch
        self.block_size = config.cache_config.block_size
        self.penalties = PenaltyCache(self.args.vocab_size, device)
        self.requests: dict[str, CachedRequestState] = {}
        self.generators: dict[str, torch.Generator] = {}
        self.caches: ModelCaches | None = None
        self.graphs: CudaGraphManager | None = None
        self.decode_graphs: DecodeGraphs | None = None
        """The decode-only steps' graphs (None: every decode step runs eager)."""
        self._last_sampled: torch.Tensor | None = None
        """[R] sampled ids of the last launched step, on the device."""
        self._last_rows: dict[str, int] = {}
        """req_id -> its row in _last_sampled."""
        self.carry: SpecCarry | None = None
        """Device drafts: each request slot's next window, made by the step in flight."""
        self._step_ids: torch.Tensor | None = None
        """[T] the launched step's input ids on the device (device drafts)."""
        self._step_start: torch.Tensor | None = None
        """[N] int64 the launched step's true window starts on the device (device drafts)."""
        self.offload = None
        """The offload tier's host side (worker/offload.py), set by the worker; None: none."""

    def bind_caches(self, caches: ModelCaches, num_blocks: int, num_slots: int,
                    num_ckpt_slots: int) -> None:
        """The caches the worker allocated. KDA rows: num_slots request slots, then the
        prefix-cache checkpoint slots, then one scratch row (index self.num_slots) for
        CUDA-graph padding rows, then (per-position spec decoding) K scratch rows per request
        slot."""
        self.caches = caches
        self.first_ckpt_slot, self.num_ckpt_slots = num_slots, num_ckpt_slots
        self.num_blocks, self.num_slots = num_blocks, num_slots + num_ckpt_slots
        if self.spec is not None:
            self.spec.scratch_base = self.num_slots + 1
            if self.spec.device_drafts:
                self.carry = SpecCarry(self.num_slots + 1, self.spec.k, self.device)

    def bind_graphs(self, graphs: CudaGraphManager, decode_graphs: DecodeGraphs) -> None:
        self.graphs, self.decode_graphs = graphs, decode_graphs

    # -----------------------------------------------------------------------------------------
    # Step
    # -----------------------------------------------------------------------------------------

    def _update_states(self, so: SchedulerOutput) -> None:
        for req_id in so.finished_req_ids:
            self.requests.pop(req_id, None)
            self.generators.pop(req_id, None)
            self.penalties.free(req_id)
        for req_id in so.preempted_req_ids:
            self.requests.pop(req_id, None)   # the generator survives: sampling resumes
            self.penalties.free(req_id)
        if self.spec is not None:
            for req_id in so.finished_req_ids | so.preempted_req_ids:
                self.spec.free(req_id)
        for new in so.scheduled_new_reqs:
            self._add_request(new)
        cached = so.scheduled_cached_reqs
        for req_id, new_blocks, num_computed in zip(cached.req_ids, cached.new_block_ids,
                                                    cached.num_computed_tokens):
            state = self.requests[req_id]
            state.add_blocks(new_blocks)
            state.num_computed_tokens = num_computed
        ops = so.offload
        if ops is not None and ops.stores:
            self.offload.store(ops.stores)   # first: the step may reuse what they read
        for src, dst in so.block_copies:
            self.caches.copy_block(src, dst)
        for copy in so.state_copies:
            self.caches.copy_state(copy.src_slot, copy.dst_slot)
        if ops is not None and ops.loads:
            self.offload.load(ops.loads)

    def _add_request(self, new: NewRequestData) -> None:
        sp = new.sampling_params
        self.requests[new.req_id] = CachedRequestState(
            req_id=new.req_id, token_ids=list(new.prompt_token_ids) + list(new.output_token_ids),
            num_prompt_tokens=len(new.prompt_token_ids), sampling_params=sp,
            block_ids=list(new.block_ids), state_slot=new.state_slot,
            num_computed_tokens=new.num_computed_tokens)
        if sp.seed is not None and not sp.greedy and new.req_id not in self.generators:
            gen = torch.Generator(device=self.device)
            gen.manual_seed(sp.seed)
            self.generators[new.req_id] = gen

    def _build_batch(self, so: SchedulerOutput) -> StepBatch:
        """Order: decodes, then prefill chunks, then spec rows (the contiguous spec layout; the
        gather layout leaves spec rows among the prefill chunks in scheduler order)."""
        specs = so.scheduled_spec_decode_tokens
        last = 2 if self.spec is not None and self.spec.layout == "contiguous" else 1
        order = sorted(so.num_scheduled_tokens,
                       key=lambda r: 0 if self._is_decode(r, so) else last if specs.get(r) else 1)
        batch = StepBatch([], [], [], [], [])
        carry = batch.carry = CarryRows() if self.carry is not None else None
        for i, req_id in enumerate(order):
            state = self.requests[req_id]
            n = so.num_scheduled_tokens[req_id]
            start = state.num_computed_tokens
            drafts = list(specs.get(req_id, ()))
            ids = state.token_ids[start:start + n] + drafts
            known = len(state.token_ids)
            in_flight = bool(state.num_pending) and start >= known
            if carry is not None and (in_flight or DRAFT_PLACEHOLDER in drafts):
                # [last token] + drafts of the last proposal: read on the device
                if len(drafts) != n - 1 or any(d != DRAFT_PLACEHOLDER for d in drafts):
                    raise RuntimeError(f"request {req_id!r}: its window comes from the step in "
                                       f"flight but {drafts} drafts were scheduled")
                p0 = len(batch.input_ids)
                carry.token_pos.extend(range(p0, p0 + n))
                carry.src_slot.extend([state.state_slot] * n)
                carry.src_col.extend(range(n))
                if in_flight and state.last_num_drafts > 0:
                    carry.fix_rows.append(i)
                    carry.fix_slots.append(state.state_slot)
                ids = [0] * n
            elif n == 1 and not drafts and start == known and state.num_pending:
                batch.pending_inputs.append((len(batch.input_ids), req_id))
                ids = [0]   # a placeholder: the device copies the sampled id in
            if len(ids) != n:
                raise RuntimeError(f"request {req_id!r}: {n} tokens scheduled but {len(ids)} "
                                   f"known from {start} (drafts {drafts})")
            batch.req_ids.append(req_id)
            batch.input_ids.extend(ids)
            batch.query_lens.append(n)
            batch.num_computed.append(start)
            batch.drafts.append(drafts)
            if start + n >= known + state.num_pending:
                batch.sample_rows.append(i)
        return batch

    def patch_pending_inputs(self, input_ids: torch.Tensor, batch: StepBatch) -> None:
        """Copy the previous launched step's sampled ids into the placeholder positions of
        `input_ids` ([T] on the device), in stream order: no host wait."""
        if not batch.pending_inputs:
            return
        try:
            rows = [self._last_rows[rid] for _, rid in batch.pending_inputs]
        except KeyError as exc:
            raise RuntimeError(f"request {exc.args[0]!r}: its input token was not sampled by the "
                               "last launched step") from None
        positions = [p for p, _ in batch.pending_inputs]
        if positions == rows == list(range(len(rows))):
            # Steady decoding: the same requests, in the same order, as the last step sampled.
            input_ids[:len(rows)].copy_(self._last_sampled[:len(rows)])
            return
        idx = torch.tensor([positions, rows], dtype=torch.long)
        if input_ids.is_cuda:
            idx = idx.pin_memory().to(input_ids.device, non_blocking=True)
        input_ids.index_copy_(0, idx[0], self._last_sampled[idx[1]].to(input_ids.dtype))

    def _is_decode(self, req_id: str, so: SchedulerOutput) -> bool:
        return (so.num_scheduled_tokens[req_id] == 1
                and self.requests[req_id].num_computed_tokens > 0)

    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step to completion (launch, then collect)."""
        return self.collect(self.launch(so))

    @torch.inference_mode()
    def launch(self, so: SchedulerOutput) -> LaunchedStep:
        """Apply the scheduler's delta and queue the step's forward and sampler on the device.
        Decode inputs still pending from the previous launched step are read on the device."""
        self._update_states(so)
        if so.total_num_scheduled_tokens == 0:
            return LaunchedStep(output=ModelRunnerOutput())
        batch = self._build_batch(so)
        states = [self.requests[r] for r in batch.req_ids]
        exports = checkpoints.plan_step_exports(
            so, batch.req_ids, batch.num_computed, batch.query_lens,
            [s.state_slot for s in states], self.first_ckpt_slot, self.num_ckpt_slots)
        internal, spec_exports = exports.internal, []
        if batch.has_spec:
            internal, spec_exports = self.spec.split_exports(
                internal, [bool(d) for d in batch.drafts])
        sample_states = [states[i] for i in batch.sample_rows]
        # SamplingMetadata's copies are pinned and non-blocking: built after the (graph) launch,
        # its host work overlaps the forward. Spec metadata and logits processing (penalties,
        # logit_bias) still make pageable copies, which would wait for the forward to finish
        # and leave the GPU idle until the sampler's launches: those are built first.
        early = batch.has_spec or any(s.sampling_params.processes_logits for s in sample_states)
        sampling = self._prepare_sampling(batch, sample_states) if early else None
        hidden_rows = self._forward(batch, states, internal, spec_exports)  # [logit rows, D]
        if not early:
            sampling = self._prepare_sampling(batch, sample_states)
        grammar = (self._grammar_mask(so, batch, hidden_rows.shape[0])
                   if so.grammar_bitmask is not None else None)
        checkpoints.apply_post_copies(self.caches, exports)
        step = LaunchedStep(batch=batch, states=states)
        if self.carry is not None:
            spec_async.launch_step(self, step, hidden_rows, sample_states, sampling, grammar)
            return step
        if not batch.sample_rows:
            step.output = ModelRunnerOutput(req_ids=batch.req_ids,
                                            sampled_token_ids=[[] for _ in batch.req_ids],
                                            logprobs=[None] * len(batch.req_ids))
        elif batch.has_spec:
            emitted, logprobs = self._sample_spec(hidden_rows, batch, sample_states, sampling,
                                                  grammar)
            step.output = self._finish(batch, states, emitted, logprobs)
        else:
            logits = self.model.compute_logits(hidden_rows)                   # [R, V]
            if grammar is not None:
                apply_grammar_bitmask(logits, grammar)
            out = self.sampler(logits, sampling)
            self._last_sampled = out.sampled_token_ids                        # [R]
            self._last_rows = {s.req_id: j for j, s in enumerate(sample_states)}
            for s in sample_states:
                s.num_pending += 1
            step.host = to_host(out)
            if out.sampled_token_ids.is_cuda:
                step.done = torch.cuda.Event()
                step.done.record()
        return step

    def collect(self, step: LaunchedStep) -> ModelRunnerOutput:
        """Wait for a launched step's sampled ids and append them to the request states."""
        if step.output is not None:
            return step.output
        if step.done is not None:
            step.done.synchronize()
        if step.spec is not None:
            return spec_async.collect_step(self, step)
        batch = step.batch
        sampled = step.host.sampled_token_ids.tolist()
        num_logprobs = [step.states[i].sampling_params.logprobs for i in batch.sample_rows]
        lp_dicts, rank_dicts = to_logprob_dicts(step.host, num_logprobs)
        logprobs = [None if lp is None else [{t: Logprob(v, rk[t]) for t, v in lp.items()}]
                    for lp, rk in zip(lp_dicts, rank_dicts)]
        for i in batch.sample_rows:
            step.states[i].num_pending -= 1
        return self._finish(batch, step.states, [[t] for t in sampled], logprobs)

    def _finish(self, batch: StepBatch, states: list[CachedRequestState],
                emitted: list[list[int]], logprobs: list,
                drafts: dict[str, list[int]] | None = None) -> ModelRunnerOutput:
        """Append the emitted tokens (per sampling row) and build the step's output. drafts:
        the step's proposal (device drafts); None: proposed here, on the host."""
        out_tokens: list[list[int]] = [[] for _ in batch.req_ids]
        out_lps: list = [None] * len(batch.req_ids)
        for j, i in enumerate(batch.sample_rows):
            out_tokens[i] = emitted[j]
            states[i].token_ids.extend(emitted[j])
            out_lps[i] = logprobs[j]
            if batch.drafts[i]:   # mirror the scheduler's rollback of the rejected drafts
                states[i].num_computed_tokens = batch.num_computed[i] + len(emitted[j])
        sample_states = [states[i] for i in batch.sample_rows]
        if drafts is None:
            drafts = (self.spec.propose(sample_states, len(batch.req_ids))
                      if self.spec is not None else {})
        return ModelRunnerOutput(req_ids=batch.req_ids, sampled_token_ids=out_tokens,
                                 logprobs=out_lps, draft_token_ids=drafts)

    def _prepare_sampling(self, batch: StepBatch, states: list[CachedRequestState]):
        """The sampler's (or the rejection sampler's) inputs for the sampling rows; None when
        the step samples nothing."""
        if not states:
            return None
        if batch.has_spec:
            return self._spec_sampling_metadata(batch, states)
        return self._sampling_metadata(states)

    def _spec_sampling_metadata(self, batch: StepBatch, states: list[CachedRequestState]):
        drafts = [batch.drafts[i] for i in batch.sample_rows]
        eos = self.args.eos_token_id
        eos = {eos} if isinstance(eos, int) else set(eos or ())
        return self.spec.sampling_metadata(states, drafts, self.generators, eos, self.penalties)

    def _sample_spec(self, hidden: torch.Tensor, batch: StepBatch,
                     states: list[CachedRequestState], prepared,
                     grammar: GrammarMask | None = None):
        """Rejection sampling over every sampling row (under the grammar masks of structured
        requests, one per position), then the KDA state commit."""
        drafts = [batch.drafts[i] for i in batch.sample_rows]
        out = self.spec.sample_graphed(states, drafts, prepared, grammar)
        if out is not None:
            emitted, logprobs = self.spec.emitted_tokens(out, prepared[0], states, drafts,
                                                         out.parse_output())
        else:
            logits = self.model.compute_logits(hidden)                        # [R, V]
            if grammar is not None:
                apply_grammar_bitmask(logits, grammar)
            emitted, logprobs = self.spec.sample(logits, states, drafts, prepared)
        self.spec.commit(self.caches, [len(e) for e, d in zip(emitted, drafts) if d])
        return emitted, logprobs

    def _grammar_mask(self, so: SchedulerOutput, batch: StepBatch,
                      num_logit_rows: int) -> GrammarMask | None:
        """The step's bitmask rows on the device, each aimed at its logits row (sampling rows
        in batch order, 1 + drafts rows each; the bitmask is in the core's request order)."""
        first_row: dict[str, int] = {}
        row = 0
        for i in batch.sample_rows:
            first_row[batch.req_ids[i]] = row
            row += 1 + len(batch.drafts[i])
        src, dst = [], []
        offset = 0
        for rid in so.structured_output_request_ids:
            n = 1 + len(so.scheduled_spec_decode_tokens.get(rid, ()))
            start = first_row.get(rid)
            if start is not None:
                src.extend(range(offset, offset + n))
                dst.extend(range(start, start + n))
            offset += n
        if not dst:
            return None
        return GrammarMask.build(so.grammar_bitmask, src, dst, num_logit_rows, self.device)

    def _plan(self, batch: StepBatch, kda_checkpoints, spec_exports) -> StepPlan:
        """How this step runs: decode-only steps and uniform verification steps (every request
        verifying K drafts) without checkpoint exports replay a captured graph; the others run
        eager (without PDL)."""
        n = len(batch.req_ids)
        if kda_checkpoints is None and self.graphs is not None:
            corrected = batch.carry is not None and batch.carry.corrected
            if (self.decode_graphs is not None and not corrected
                    and self.decode_graphs.can_run(batch)):
                return self.graphs.plan(DecodeGraphs.descriptor(self.graphs.padded_size(n)))
            if not spec_exports and self.spec is not None and self.spec.can_replay_verify(batch):
                return self.graphs.plan(self.spec.verify_graphs.descriptor(
                    self.graphs.padded_size(n)))
        num_spec = sum(1 for d in batch.drafts if d)
        num_decodes = sum(1 for q, c, d in zip(batch.query_lens, batch.num_computed,
                                               batch.drafts) if q == 1 and c > 0 and not d)
        return StepPlan.eager_for(num_decodes, num_spec, n - num_decodes - num_spec,
                                  kda_checkpoints is not None)

    def _forward(self, batch: StepBatch, states: list[CachedRequestState],
                 kda_checkpoints=None, spec_exports=()) -> torch.Tensor:
        """Runs the step's plan; returns the final hidden state of each sampling row (every
        position of a spec row)."""
        plan = self._plan(batch, kda_checkpoints, spec_exports)
        carry = batch.carry
        n = len(batch.req_ids)
        fix = self.carry.fix(n, carry) if carry else None                  # [N] or None
        if carry is not None:
            start = to_device(batch.num_computed, torch.long, self.device)
            self._step_start = start if fix is None else start - fix
        if plan.mode is ExecMode.DECODE_GRAPH:
            bs = self.decode_graphs.load(batch, states)
            if carry is not None:
                self.carry.patch_ids(self.decode_graphs.input_ids, carry)
                self._step_ids = self.decode_graphs.input_ids[:n]
            else:
                self.patch_pending_inputs(self.decode_graphs.input_ids, batch)
            hidden, aux = self.decode_graphs.replay(bs, batch)
            if aux is not None:
                self._hand_hidden(batch, states, list(range(n + 1)), aux, graph_buffer=True)
            return hidden
        if plan.mode is ExecMode.VERIFY_GRAPH:
            def patch(vg) -> None:
                self.carry.patch_ids(vg.input_ids, carry)
                correct_window(vg, fix, batch.num_computed, self.block_size)
            hidden, aux = self.spec.replay_verify(batch, states, patch if carry else None)
            self._step_ids = self.spec.verify_graphs.input_ids[:sum(batch.query_lens)]
            if aux is not None:
                k1 = self.spec.verify_graphs.k1
                self._hand_hidden(batch, states, [i * k1 for i in range(n + 1)], aux,
                                  graph_buffer=True)
            return hidden
        md = build_metadata(batch.query_lens, batch.num_computed,
                            [s.block_np[:len(s.block_ids)] for s in states],
                            [s.state_slot for s in states], self.block_size, self.device,
                            dcp=self.dcp)
        md.kda_checkpoints = kda_checkpoints
        if fix is not None:   # the carry rows' positions, moved back by their rejected drafts
            fix_tok = correct_metadata(md, fix, batch.query_lens, batch.num_computed,
                                       self.block_size)
        if batch.has_spec:
            self.spec.build_step(md, [bool(d) for d in batch.drafts],
                                 [s.state_slot for s in states], list(spec_exports))
            if fix is not None:
                correct_spec_rows(md, fix, fix_tok, [bool(d) for d in batch.drafts])
        ids = to_device(batch.input_ids, torch.long, self.device)
        if carry is not None:
            self.carry.patch_ids(ids, carry)
        else:
            self.patch_pending_inputs(ids, batch)
        self._step_ids = ids
        ctx = ForwardContext(md, self.caches, plan)
        qsl = md.query_start_loc_cpu.tolist()
        if self.spec is not None and self.spec.needs_hidden:
            hidden, prenorm = self.model(ids, ctx, **self.spec.hidden_outputs)  # [T, D], [T, *]
            self._hand_hidden(batch, states, qsl, prenorm)
        else:
            hidden = self.model(ids, ctx)
        rows = [t for i in batch.sample_rows
                for t in range(qsl[i + 1] - 1 - len(batch.drafts[i]), qsl[i + 1])]
        return hidden[to_device(rows, torch.long, self.device)]

    def _hand_hidden(self, batch: StepBatch, states: list[CachedRequestState], qsl: list[int],
                     prenorm: torch.Tensor, graph_buffer: bool = False) -> None:
        """The drafter's hidden rows of this step [T, W] (request i's rows qsl[i]..qsl[i+1])
        to the spec decoder: under async scheduling kept for propose_device, which this
        launch queues before any later forward (stream order), so a graph's output buffer is
        read before the next replay rewrites it; otherwise held per request across steps,
        so a graph buffer is copied first."""
        if self.carry is not None:
            self.spec.keep_aux(prenorm)
            return
        if graph_buffer:
            prenorm = prenorm.clone()
        self.spec.add_hidden(states, batch.num_computed, qsl, prenorm)

    def _sampling_metadata(self, states: list[CachedRequestState]) -> SamplingMetadata:
        params = [s.sampling_params for s in states]
        gens = {j: self.generators[s.req_id] for j, s in enumerate(states)
                if s.req_id in self.generators}
        banned = min_tokens_banned_ids(
            params, [len(s.token_ids) + s.num_pending - s.num_prompt_tokens for s in states],
            self.args.eos_token_id)
        md = SamplingMetadata.build(params, gens, banned, self.device)
        md.processing = logits_processing(range(len(states)), states, self.penalties)
        return md
