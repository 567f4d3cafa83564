"""SchedulerOutput -> flattened inputs + metadata -> model -> sampler -> ModelRunnerOutput.

The runner keeps a persistent copy of every running request (token ids, block ids, state slot,
seeded generator) keyed by req_id; each step applies the scheduler's delta to it.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from kdaserve.attention.builder import build_metadata
from kdaserve.attention.metadata import ForwardContext, ModelCaches
from kdaserve.config import EngineConfig, KernelConfig
from kdaserve.core.sched_output import ModelRunnerOutput, NewRequestData, SchedulerOutput
from kdaserve.models.loader import load_weights
from kdaserve.models.registry import build_model, resolve_architecture
from kdaserve.outputs import Logprob
from kdaserve.sample.metadata import SamplingMetadata, min_tokens_banned_ids
from kdaserve.sample.penalties import PenaltyCache, logits_processing
from kdaserve.sample.sampler import Sampler, SamplerOutput, to_logprob_dicts
from kdaserve.sampling_params import SamplingParams
from kdaserve.worker import cache as cache_mod
from kdaserve.worker import checkpoints
from kdaserve.spec_decode.decoder import SpecDecoder

logger = logging.getLogger(__name__)


@dataclass
class CachedRequestState:
    req_id: str
    token_ids: list[int]
    """Prompt + outputs known to the worker."""
    num_prompt_tokens: int
    sampling_params: SamplingParams
    block_ids: list[int]
    state_slot: int
    num_computed_tokens: int
    block_np: np.ndarray = field(default=None, repr=False)
    """block_ids as int32 with spare capacity: rows of the graph block table copy from it."""
    num_pending: int = 0
    """Tokens sampled by launched steps and not yet collected (not in token_ids yet)."""

    def __post_init__(self) -> None:
        self.block_np = np.empty(max(16, 2 * len(self.block_ids)), dtype=np.int32)
        self.block_np[:len(self.block_ids)] = self.block_ids

    def add_blocks(self, new_blocks: list[int]) -> None:
        n = len(self.block_ids)
        self.block_ids.extend(new_blocks)
        if len(self.block_ids) > len(self.block_np):
            grown = np.empty(2 * len(self.block_ids), dtype=np.int32)
            grown[:n] = self.block_np[:n]
            self.block_np = grown
        self.block_np[n:len(self.block_ids)] = new_blocks


@dataclass
class StepBatch:
    """One step's flattened batch on the host, requests ordered decodes first."""

    req_ids: list[str]
    input_ids: list[int]
    query_lens: list[int]
    num_computed: list[int]
    sample_rows: list[int]
    """Indices (into req_ids) of requests that sample a token this step."""
    drafts: list[list[int]] = field(default_factory=list)
    """Per request, the draft tokens it verifies ([] for non-spec rows)."""
    pending_inputs: list[tuple[int, str]] = field(default_factory=list)
    """(position in input_ids, req_id) of decode inputs that the previous launched step sampled
    and the host has not seen yet: they are copied on the device from its sampled ids."""

    @property
    def has_spec(self) -> bool:
        return any(self.drafts)


@dataclass
class LaunchedStep:
    """A step queued on the device; ModelRunner.collect turns it into its ModelRunnerOutput.

    Either `output` is already final (steps that need the host in the loop: speculative
    decoding, penalties, steps that sample nothing), or the sampled ids are on their way into
    pinned host memory and `done` fires when they are there."""

    output: ModelRunnerOutput | None = None
    batch: StepBatch | None = None
    states: list[CachedRequestState] = field(default_factory=list)
    host: SamplerOutput | None = None
    """The sampler's output in host memory (filled once `done` has fired)."""
    done: torch.cuda.Event | None = None


def _to_host(out: SamplerOutput) -> SamplerOutput:
    """Queue the copies of the sampler's output into pinned host memory (no wait)."""
    def copy(t: torch.Tensor | None) -> torch.Tensor | None:
        if t is None or t.device.type == "cpu":
            return t
        host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        return host.copy_(t, non_blocking=True)
    return SamplerOutput(copy(out.sampled_token_ids), copy(out.logprob_token_ids),
                         copy(out.logprobs), copy(out.ranks))


def _supported_kernels(kc: KernelConfig, device: torch.device) -> KernelConfig:
    """kc less what this device cannot run: PDL needs compute capability 9.0 (Hopper)."""
    if kc.pdl and device.type == "cuda" and torch.cuda.get_device_capability(device)[0] < 9:
        logger.info("pdl off: compute capability %s < 9.0",
                    torch.cuda.get_device_capability(device))
        return dataclasses.replace(kc, pdl=False)
    return kc


def _use_expandable_segments() -> None:
    """Expandable allocator segments unless the user configured the allocator: loading folds
    and merges weights (new tensors, old ones freed), which otherwise leaves tens of GiB of
    reserved fragments that the multi-GiB cache pools cannot use."""
    import os

    if os.environ.get("PYTORCH_CUDA_ALLOC_CONF") or os.environ.get("PYTORCH_ALLOC_CONF"):
        return
    setter = getattr(torch._C, "_accelerator_setAllocatorSettings", None) or \
        getattr(torch._C, "_cuda_cudaCachingAllocator_set_allocator_settings", None)  # < 2.13
    if setter is None:
        logger.info("expandable segments not set: this torch has no allocator-settings call")
        return
    try:
        setter("expandable_segments:True")
    except RuntimeError as exc:   # refused: keep the default allocator
        logger.info("expandable segments not set: %s", exc)


class ModelRunner:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.device = torch.device(config.device)
        mc = config.model_config
        self.args = mc.arch
        self.dtype = mc.torch_dtype(self.device.type)
        self.block_size = config.cache_config.block_size
        if self.device.type == "cuda":
            _use_expandable_segments()
        t0 = time.perf_counter()
        cls = resolve_architecture(mc.hf_config)
        self.model = build_model(self.args, self.dtype, self.device, cls)
        load_weights(self.model, mc.model, config.load_config)
        self.kernel_config = _supported_kernels(config.kernel_config, self.device)
        self.model.configure_kernels(dataclasses.replace(self.kernel_config, pdl=False))
        logger.info("model loaded in %.2f s (%s, %s)", time.perf_counter() - t0, self.dtype,
                    self.device)
        self.sampler = Sampler(config.kernel_config.sampling_threshold_kernel)
        self.penalties = PenaltyCache(self.args.vocab_size, self.device)
        self.requests: dict[str, CachedRequestState] = {}
        self.generators: dict[str, torch.Generator] = {}
        self.caches: ModelCaches | None = None
        self.graphs = None
        self.spec_graphs = None
        """SpecVerifyGraphs (CUDA, recover + contiguous spec decoding)."""
        self.spec: SpecDecoder | None = None
        if config.speculative_config.enabled:   # before profiling: a draft model's memory counts
            self.spec = SpecDecoder(config, self.args, self.device, self.dtype)
        self._last_sampled: torch.Tensor | None = None
        """[R] sampled ids of the last launched step, on the device."""
        self._last_rows: dict[str, int] = {}
        """req_id -> its row in _last_sampled."""

    # -----------------------------------------------------------------------------------------
    # Cache sizing and allocation
    # -----------------------------------------------------------------------------------------

    def determine_num_blocks_and_slots(self) -> tuple[int, int]:
        """CPU: explicit sizes or defaults. CUDA: profile the largest step, then split the free
        memory under gpu_memory_utilization between KDA slots (max_num_seqs of them) and KV."""
        cc, sc = self.config.cache_config, self.config.scheduler_config
        num_slots = cc.num_state_slots or sc.max_num_seqs + 8
        if self.device.type != "cuda":
            cc.num_kda_checkpoint_slots = checkpoints.num_checkpoint_slots(
                cc, None, 0, sc.max_num_seqs)
            return cc.num_gpu_blocks or 512, num_slots
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        self._profile_run()
        peak = torch.cuda.max_memory_allocated()
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info()
        used_elsewhere = total - free - torch.cuda.memory_reserved()
        budget = total * cc.gpu_memory_utilization - peak - used_elsewhere
        # The pools are new multi-GiB tensors: only memory the driver reports free can hold
        # them (reserved-but-unused fragments cannot), less room for the activation peak.
        activations = peak - torch.cuda.memory_allocated()
        budget = min(budget, free - activations - (256 << 20))
        slot_bytes = cache_mod.state_bytes_per_slot(self.args, self.dtype)
        block_bytes = cache_mod.kv_bytes_per_block(self.args, self.block_size, self.dtype)
        if cc.num_state_slots is None:
            num_slots = sc.max_num_seqs
        budget -= num_slots * self._spec_rows_per_slot() * slot_bytes
        cc.num_kda_checkpoint_slots = checkpoints.num_checkpoint_slots(
            cc, budget - (num_slots + 1) * slot_bytes, slot_bytes, sc.max_num_seqs)
        num_blocks = cc.num_gpu_blocks or int(
            (budget - (num_slots + 1 + cc.num_kda_checkpoint_slots) * slot_bytes) // block_bytes)
        if num_blocks < 1:
            raise RuntimeError(
                f"no memory left for the KV cache: budget {budget / 2**30:.2f} GiB, "
                f"{num_slots} KDA slots need {num_slots * slot_bytes / 2**30:.2f} GiB; lower "
                "max_num_seqs or raise gpu_memory_utilization")
        return num_blocks, num_slots

    def initialize_cache(self, num_blocks: int, num_slots: int) -> None:
        """KDA rows: num_slots request slots, then the prefix-cache checkpoint slots, then one
        scratch row (index self.num_slots) for CUDA-graph padding rows, then (per-position spec
        decoding) K scratch rows per request slot."""
        cc = self.config.cache_config
        cc.num_kda_checkpoint_slots = num_ckpt = checkpoints.resolve_num_checkpoint_slots(cc)
        self.first_ckpt_slot, self.num_ckpt_slots = num_slots, num_ckpt
        self.num_blocks, self.num_slots = num_blocks, num_slots + num_ckpt
        extra_rows = num_slots * self._spec_rows_per_slot()
        self.caches = cache_mod.allocate_caches(self.args, num_blocks, self.block_size,
                                                self.num_slots + 1 + extra_rows, self.dtype,
                                                self.device)
        if self.spec is not None:
            self.spec.scratch_base = self.num_slots + 1
        kv_tokens = num_blocks * self.block_size
        max_len = self.config.scheduler_config.max_model_len
        logger.info("MLA KV cache: %d tokens; %s; max concurrency at max_model_len: %.2f",
                    kv_tokens, checkpoints.capacity_line(
                        num_slots, num_ckpt, cache_mod.state_bytes_per_slot(self.args, self.dtype)),
                    min(num_slots, kv_tokens / max_len))
        if self.spec is not None:
            logger.info("%s", self.spec.memory_line())
        if self.device.type == "cuda":
            self._warmup_mixed_step()
            self._warmup_sampler()
            if self.spec is not None:
                self.spec.warmup()
        if self.device.type == "cuda" and not self.config.enforce_eager:
            self._capture_graphs()

    def _capture_graphs(self) -> None:
        """Decode (and spec verification) graphs, captured with the PDL launches when
        KernelConfig.pdl is on. Eager steps launch without PDL: it saves ~1 us per kernel
        boundary, nothing against eager launch overhead, and each prefill shape would JIT its
        own PDL kernel variants on first use."""
        from kdaserve.worker.cuda_graphs import DecodeGraphs

        self.model.configure_kernels(self.kernel_config)
        try:
            self.graphs = DecodeGraphs(self)
            self.graphs.capture()
            if self.spec is not None:
                self.spec.capture_graphs()
                if not self.spec.per_position and self.spec.layout == "contiguous":
                    from kdaserve.spec_decode.verify_graphs import SpecVerifyGraphs

                    self.spec_graphs = SpecVerifyGraphs(self, self.graphs.pool)
                    self.spec_graphs.capture()
        finally:
            self.model.configure_kernels(dataclasses.replace(self.kernel_config, pdl=False))

    def _warmup_mixed_step(self) -> None:
        """Eager forwards over the step compositions serving meets, so the kernel variants they
        JIT-compile (Triton specialises on integer values and pointer alignment; fla autotunes
        its l2norm per token-count bucket) are built at start-up, not in a request's TTFT:
        every count of decode rows from 0 to 16 and some beyond (the prefill rows' index arrays
        start after them), each alone (eager decode steps: past the captured graph sizes, or
        enforce_eager) and next to a chunk over a cached prefix and a fresh prefill, one
        decode row at a long context (the MLA split count follows the longest context), and
        fresh prefills across the token budget. Runs on the live caches before any request
        holds a block or a slot: what it writes is garbage that a request overwrites before it
        reads (new KV rows are stored before attention reads them; a new request's KDA state
        is not read, has_initial_state is false)."""
        sc = self.config.scheduler_config
        max_rows = min(sc.max_num_seqs, self.num_slots) - 2
        long_ctx = min(sc.max_model_len, self.num_blocks * self.block_size // 2) - 1
        for d in [d for d in range(max_rows + 3) if d <= 16 or d % 8 == 0 or d >= max_rows]:
            computed = [long_ctx] + [17 + 3 * i for i in range(1, d)] if d else []
            if d <= max_rows:
                self._warmup_forward([1] * d + [100, 61], computed + [33, 0])
            if d:                                   # decode only: eager past the graph sizes
                self._warmup_forward([1] * d, computed)
        budget = min(sc.max_num_batched_tokens, sc.max_model_len)
        for j in range(1, 9):
            self._warmup_forward([max(1, budget * j // 8 - 3)], [0])
        if self.device.type == "cuda":
            torch.cuda.synchronize()

    def _warmup_forward(self, query_lens: list[int], computed: list[int]) -> None:
        bs = self.block_size
        need = [-(-(c + q) // bs) for q, c in zip(query_lens, computed)]
        if sum(need) > self.num_blocks:
            return
        starts = np.cumsum([0] + need)
        blocks = [list(range(a, b)) for a, b in zip(starts[:-1], starts[1:])]
        md = build_metadata(query_lens, computed, blocks, list(range(len(query_lens))), bs,
                            self.device)
        # distinct tokens (the routed experts spread as in real steps)
        ids = torch.arange(sum(query_lens), device=self.device) * 7919 % self.args.vocab_size
        pos = torch.from_numpy(np.concatenate([np.arange(c, c + q) for q, c in
                                               zip(query_lens, computed)])).to(self.device)
        with torch.inference_mode():
            h = self.model(ids, pos, ForwardContext(md, self.caches))
            self.model.compute_logits(h[-len(query_lens):])

    def _warmup_sampler(self) -> None:
        """Sample once with top-p alone and once with top-p plus top-k on some rows: the
        threshold kernels' variants compile at start-up, not in the first requests' steps.
        Seeded rows, so the global CUDA generator is left as it was."""
        logits = torch.randn(2, self.args.vocab_size, device=self.device)
        gens = {i: torch.Generator(device=self.device).manual_seed(i) for i in range(2)}
        for params in ([SamplingParams(temperature=1.0, top_p=0.9, seed=0)] * 2,
                       [SamplingParams(temperature=1.0, top_k=50, top_p=0.9, seed=0),
                        SamplingParams(temperature=1.0, top_p=0.9, seed=1)]):
            self.sampler(logits, SamplingMetadata.build(params, gens, None, self.device))
        torch.cuda.synchronize()

    def _spec_rows_per_slot(self) -> int:
        return self.spec.extra_rows_per_slot if self.spec is not None else 0

    def _profile_run(self) -> None:
        """A forward over max_num_batched_tokens prefill tokens on throwaway caches."""
        sc = self.config.scheduler_config
        n = min(sc.max_num_batched_tokens, sc.max_model_len)
        nb = (n + self.block_size - 1) // self.block_size
        caches = cache_mod.allocate_caches(self.args, nb, self.block_size, 1, self.dtype,
                                           self.device)
        md = build_metadata([n], [0], [list(range(nb))], [0], self.block_size, self.device)
        ids = torch.zeros(n, dtype=torch.long, device=self.device)
        with torch.inference_mode():
            h = self.model(ids, ids, ForwardContext(md, caches))
            self.model.compute_logits(h[-min(n, sc.max_num_seqs):])
        torch.cuda.synchronize()
        del caches, h

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
        for src, dst in so.block_copies:
            self.caches.copy_block(src, dst)
        for copy in so.state_copies:
            self.caches.copy_state(copy.src_slot, copy.dst_slot)

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
        for i, req_id in enumerate(order):
            state = self.requests[req_id]
            n = so.num_scheduled_tokens[req_id]
            start = state.num_computed_tokens
            drafts = list(specs.get(req_id, ()))
            ids = state.token_ids[start:start + n] + drafts
            known = len(state.token_ids)
            if n == 1 and not drafts and start == known and state.num_pending:
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
        checkpoints.apply_post_copies(self.caches, exports)
        step = LaunchedStep(batch=batch, states=states)
        if not batch.sample_rows:
            step.output = ModelRunnerOutput(req_ids=batch.req_ids,
                                            sampled_token_ids=[[] for _ in batch.req_ids],
                                            logprobs=[None] * len(batch.req_ids))
        elif batch.has_spec:
            emitted, logprobs = self._sample_spec(hidden_rows, batch, sample_states, sampling)
            step.output = self._finish(batch, states, emitted, logprobs)
        else:
            out = self.sampler(self.model.compute_logits(hidden_rows), sampling)
            self._last_sampled = out.sampled_token_ids                        # [R]
            self._last_rows = {s.req_id: j for j, s in enumerate(sample_states)}
            for s in sample_states:
                s.num_pending += 1
            step.host = _to_host(out)
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
                emitted: list[list[int]], logprobs: list) -> ModelRunnerOutput:
        """Append the emitted tokens (per sampling row) and build the step's output."""
        out_tokens: list[list[int]] = [[] for _ in batch.req_ids]
        out_lps: list = [None] * len(batch.req_ids)
        for j, i in enumerate(batch.sample_rows):
            out_tokens[i] = emitted[j]
            states[i].token_ids.extend(emitted[j])
            out_lps[i] = logprobs[j]
            if batch.drafts[i]:   # mirror the scheduler's rollback of the rejected drafts
                states[i].num_computed_tokens = batch.num_computed[i] + len(emitted[j])
        sample_states = [states[i] for i in batch.sample_rows]
        drafts = (self.spec.propose(sample_states, len(batch.req_ids)) if self.spec is not None
                  else {})
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
                     states: list[CachedRequestState], prepared):
        """Rejection sampling over every sampling row, then the KDA state commit."""
        drafts = [batch.drafts[i] for i in batch.sample_rows]
        emitted, logprobs = self.spec.sample(self.model.compute_logits(hidden), states, drafts,
                                             prepared)
        self.spec.commit(self.caches, [len(e) for e, d in zip(emitted, drafts) if d])
        return emitted, logprobs

    def _forward(self, batch: StepBatch, states: list[CachedRequestState],
                 kda_checkpoints=None, spec_exports=()) -> torch.Tensor:
        """Runs the model; returns the final hidden state of each sampling row (every position
        of a spec row). Decode-only steps and uniform verification steps (every request verifying K
drafts) replay CUDA graphs; other steps run eager."""
        if kda_checkpoints is None and self.graphs is not None and self.graphs.can_run(batch):
            return self.graphs.run(batch, states)
        if (kda_checkpoints is None and not spec_exports and self.spec_graphs is not None
                and self.spec_graphs.can_run(batch)):
            return self.spec_graphs.run(batch, states)
        md = build_metadata(batch.query_lens, batch.num_computed,
                            [s.block_np[:len(s.block_ids)] for s in states],
                            [s.state_slot for s in states], self.block_size, self.device)
        md.kda_checkpoints = kda_checkpoints
        if batch.has_spec:
            self.spec.build_step(md, [bool(d) for d in batch.drafts],
                                 [s.state_slot for s in states], list(spec_exports))
        ids = torch.tensor(batch.input_ids, dtype=torch.long, device=self.device)
        self.patch_pending_inputs(ids, batch)
        hidden = self.model(ids, ids, ForwardContext(md, self.caches))
        qsl = md.query_start_loc_cpu.tolist()
        rows = [t for i in batch.sample_rows
                for t in range(qsl[i + 1] - 1 - len(batch.drafts[i]), qsl[i + 1])]
        return hidden[torch.tensor(rows, dtype=torch.long, device=self.device)]

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
