"""Speculative decoding behind one interface the model runner calls: spec metadata,
verification (eager, or a CUDA-graph replay), rejection sampling, the KDA state commit, and the
next step's drafts from the proposer (ngram, a draft model, the target's MTP layer, or a DSpark
drafter).

One step with spec rows (requests the scheduler gave drafts, query = [last token] + drafts):
  1. `build_step`: AttentionMetadata.spec (kda_spec runs the spec rows through the verify
     kernels); checkpoint exports that fall inside a spec row are kept for the commit;
  2. `sample`: RejectionSampler over every sampling row (K_i = 0 rows sample as usual), logits
     at every position of the spec rows and the last of the others;
  3. `commit`, before the next forward: recover mode folds the accepted tokens into each spec
     row's slot; per_position copies the accepted column into it. MLA KV needs nothing (the
     scheduler rolls num_computed_tokens back; rejected positions are overwritten later);
  4. `propose`: drafts for the requests that sampled, returned to the engine, which hands them
     to the scheduler for the next step.

Async scheduling (`device_drafts`: async_scheduling on and a proposer with `propose_device`:
DSpark, and the draft model with its window catch-up): the runner launches the next step
before this one's output reaches the host, so nothing between the forward and the next launch
reads a device value on the host:
`sample_tokens` leaves the rejection sampler's output on the device (the drafts it verifies
are read from the step's input ids, which the runner filled on the device), `commit` takes
the emitted counts as a device tensor, `propose_device` stores the drafter's context of this
step's verified positions and drafts from the bonus tokens on the device; `emitted_tokens` turns
the output into host lists (stats, logprobs) when the step is collected.

Per-position scratch rows: request slot s owns KDA cache rows [base + s*K, base + (s+1)*K),
base = the row after the CUDA-graph scratch row.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING

import numpy as np
import torch

from kdaserve.attention import kda_spec
from kdaserve.attention.builder import build_spec_step
from kdaserve.attention.metadata import (
    AttentionMetadata,
    KDACheckpointRequest,
    ModelCaches,
    SpecStep,
)
from kdaserve.config import EngineConfig
from kdaserve.kernels.kda.recover import spec_state_bytes_written, spec_state_memory
from kdaserve.outputs import Logprob
from kdaserve.sample.metadata import SamplingMetadata
from kdaserve.sample.penalties import PenaltyCache, logits_processing
from kdaserve.spec_decode.rejection_sampler import (
    RejectionSampler,
    RejectionSamplerOutput,
    SpecDecodeMetadata,
    spec_banned_ids,
    spec_logprob_dicts,
)
from kdaserve.spec_decode.device_step import DeviceStep
from kdaserve.spec_decode.metrics import SpecDecodingStats
from kdaserve.spec_decode.ngram import NgramProposer
from kdaserve.spec_decode.sample_graphs import SpecSampleGraphs
from kdaserve.spec_decode.verify_graphs import SpecVerifyGraphs

if TYPE_CHECKING:
    from kdaserve.layers.backends import LayerBackends
    from kdaserve.worker.cuda_graphs import CudaGraphManager
    from kdaserve.worker.input_batch import CachedRequestState, StepBatch


@dataclass
class _PendingCommit:
    step: SpecStep
    own_slots: list[int]
    """Host copy of each spec row's own state slot."""
    exports: list[tuple[int, int]] = field(default_factory=list)
    """(spec row, checkpoint slot): the row's state after its first window token (the last
    known token: always accepted), for prefix caching."""
    pad_to: int = 0
    """A CUDA-graph step's row count (padding rows commit zero tokens to the scratch slot)."""
    graph_commit: Callable[[list[int]], None] | None = None
    """A spec-verify graph step's commit (takes num_accepted per real row)."""


class SpecDecoder:
    def __init__(self, config: EngineConfig, target_args, device: torch.device,
                 dtype: torch.dtype, target_model: torch.nn.Module | None = None,
                 backends: LayerBackends | None = None) -> None:
        """target_model: the loaded target (methods mtp, dspark: the drafter shares its
        embedding and LM head). backends: the target's layer backends. The drafter's layers
        (mtp, dspark, draft_model) take them too, and the rejection sampler follows their
        sampler choices: top-k / top-p through the sort-free threshold search, synthetic
        acceptance draws through the fused race. None: build_model's baseline set for the
        drafter, the plain sampler paths."""
        threshold_kernel = backends is not None and backends.sampler == "threshold"
        race_kernel = backends is not None and backends.race_sampler
        sc = config.speculative_config
        self.k = sc.num_speculative_tokens
        self.method = sc.method
        self.disable_by_batch_size = sc.disable_by_batch_size
        self.per_position = sc.kda_state_mode == "per_position"
        self.layout = sc.batch_layout
        self.device = device
        self.args = target_args
        self.conv_dtype_bytes = torch.empty((), dtype=dtype).element_size()
        self.max_model_len = config.scheduler_config.max_model_len
        self.sampler = RejectionSampler(sc.rejection_sample_method, sc.synthetic_rates,
                                        threshold_kernel, race_kernel)
        self.stats = SpecDecodingStats(self.k, synthetic=self.sampler.is_synthetic)
        self.probabilistic = sc.method in ("draft_model", "mtp", "dspark") and \
            sc.draft_sample_method == "probabilistic"
        if sc.method == "ngram":
            self.proposer = NgramProposer(self.k, sc.prompt_lookup_min, sc.prompt_lookup_max)
        elif sc.method == "mtp":
            self.proposer = self._mtp_proposer(config, target_args, target_model, device, dtype,
                                               race_kernel, backends)
        elif sc.method == "dspark":
            self.proposer = self._dspark_proposer(config, target_args, target_model, device,
                                                  dtype, race_kernel, backends)
        else:
            from kdaserve.spec_decode.draft_model import DraftModelProposer

            self.proposer = DraftModelProposer.from_pretrained(
                sc.model, target_args, num_speculative_tokens=self.k,
                max_num_seqs=config.scheduler_config.max_num_seqs,
                max_model_len=self.max_model_len, block_size=config.cache_config.block_size,
                device=device, dtype=dtype, draft_sample_method=sc.draft_sample_method,
                catchup=sc.draft_catchup, race_draws=race_kernel, backends=backends)
        self.draft_probs: dict[str, torch.Tensor] = {}
        """req_id -> [K_i, V] distributions its pending drafts were sampled from."""
        self.scratch_base: int | None = None
        self._step_aux: torch.Tensor | None = None
        self._pending: _PendingCommit | None = None
        self._verify_size: int | None = None
        """The verification graph size this step replayed, for propose_device (consumed)."""
        self.verify_graphs: SpecVerifyGraphs | None = None
        """Graphs of uniform verification steps (CUDA, recover + contiguous), once captured."""
        self.sample_graphs: SpecSampleGraphs | None = None
        """Graphs of those steps' sampling (small batches, common sampling keys)."""
        self.device_drafts = (config.scheduler_config.async_scheduling
                              and getattr(self.proposer, "device_proposals", False)
                              and sc.disable_by_batch_size is None)
        """Drafts are made and fed to the next step on the device (see the module doc): the
        engine may then schedule a step before the previous one's output is processed."""

    @staticmethod
    def _mtp_proposer(config: EngineConfig, target_args, target_model, device, dtype,
                      race_draws: bool = False, backends: LayerBackends | None = None):
        from kdaserve.models.mtp import build_mtp, load_mtp_weights
        from kdaserve.spec_decode.mtp import MTPProposer

        if target_model is None:
            raise ValueError("speculative method 'mtp' needs the target model (its MTP layers "
                             "share its embedding and LM head)")
        sc = config.speculative_config
        model = build_mtp(target_model, target_args, dtype, device, backends)
        load_mtp_weights(model, sc.model, target_args, config.load_config)
        return MTPProposer(model, sc.num_speculative_tokens,
                           config.scheduler_config.max_num_seqs,
                           config.scheduler_config.max_model_len,
                           config.cache_config.block_size, device, dtype,
                           sc.draft_sample_method, race_draws=race_draws)

    @staticmethod
    def _dspark_proposer(config: EngineConfig, target_args, target_model, device, dtype,
                         race_draws: bool = False, backends: LayerBackends | None = None):
        from kdaserve.models.dspark import DSparkConfig, build_dspark, load_dspark_weights
        from kdaserve.spec_decode.dspark import DSparkProposer

        if target_model is None:
            raise ValueError("speculative method 'dspark' needs the target model (the drafter "
                             "shares its embedding and LM head)")
        sc = config.speculative_config
        model = build_dspark(target_model, DSparkConfig.from_folder(sc.model, target_args),
                             dtype, device, backends)
        load_dspark_weights(model, sc.model, config.load_config)
        return DSparkProposer(model, sc.num_speculative_tokens,
                              config.scheduler_config.max_num_seqs,
                              config.scheduler_config.max_model_len,
                              config.cache_config.block_size, device, dtype,
                              sc.draft_sample_method, race_draws=race_draws)

    @property
    def needs_hidden(self) -> bool:
        """The proposer reads the target's hidden states (methods mtp and dspark): every
        forward, eager or a graph replay, returns them too (hidden_outputs) and the runner
        hands them over (add_hidden, or keep_aux under async scheduling)."""
        return self.method in ("mtp", "dspark")

    @property
    def hidden_outputs(self) -> dict:
        """The target forward's keyword arguments that return the proposer's hidden rows as a
        second output ({} when it reads none)."""
        if not self.needs_hidden:
            return {}
        return dict(return_prenorm=True, aux_layers=self.aux_layers)

    @property
    def aux_layers(self) -> tuple[int, ...] | None:
        """The target layers whose outputs the proposer reads (dspark); None: the pre-final-
        norm hidden (mtp)."""
        return getattr(self.proposer, "aux_layers", None)

    def add_hidden(self, states, num_computed: list[int], query_start_loc: list[int],
                   prenorm: torch.Tensor) -> None:
        """A forward's pre-final-norm hidden [T, D], or its aux_layers' outputs [T, n * D]
        (batch order; request i's rows query_start_loc[i]..[i+1] at positions
        num_computed[i]...) for the proposer. Requests
        with penalties / logit_bias are never drafted for: nothing is kept for them."""
        for i, s in enumerate(states):
            if s.sampling_params.processes_logits:
                continue
            self.proposer.add_hidden(s.req_id, num_computed[i],
                                     prenorm[query_start_loc[i]:query_start_loc[i + 1]])

    def warmup(self) -> None:
        """Compile the draft model's kernels at start-up (draft_model method only)."""
        warmup = getattr(self.proposer, "warmup", None)
        if warmup is not None:
            warmup()

    def capture_graphs(self, graphs: "CudaGraphManager", model: torch.nn.Module,
                       caches: ModelCaches, pad_slot: int, block_size: int) -> None:
        """Capture, into `graphs`, the target's verification steps (recover + contiguous only:
        the graph reads the state pool and keeps records for the captured commit) and the
        draft model's steps. pad_slot: the KDA scratch row of padding requests."""
        self.verify_graphs = self._verify_graphs(graphs, model, caches, pad_slot, block_size)
        if self.verify_graphs is not None:
            self.verify_graphs.capture()
            self.sample_graphs = SpecSampleGraphs(
                graphs, self.verify_graphs, model, self.sampler, self.k, self.args.vocab_size,
                self.probabilistic and not self.sampler.is_synthetic, self.device)
            self.sample_graphs.capture()
        capture = getattr(self.proposer, "capture_graphs", None)
        if capture is not None:
            if getattr(self.proposer, "captures_windows", False):
                capture(graphs, self.verify_graphs)
            else:
                capture(graphs)

    def run_uncaptured(self, graphs: "CudaGraphManager", model: torch.nn.Module,
                       caches: ModelCaches, pad_slot: int, block_size: int) -> None:
        """The forwards of the verification graphs capture_graphs would capture, and the
        drafter's passes that sample nothing (DSpark's block pass), eagerly, without captures,
        commits or draws (start-up compiles ahead of them: worker.py)."""
        vg = self._verify_graphs(graphs, model, caches, pad_slot, block_size)
        if vg is not None:
            vg.run_uncaptured()
        block = getattr(self.proposer, "run_block_uncaptured", None)
        if block is not None:
            block()

    def _verify_graphs(self, graphs: "CudaGraphManager", model: torch.nn.Module,
                       caches: ModelCaches, pad_slot: int, block_size: int
                       ) -> SpecVerifyGraphs | None:
        """Verification graphs exist for recover + contiguous only."""
        if self.per_position or self.layout != "contiguous":
            return None
        return SpecVerifyGraphs(graphs, model, caches, self.k, pad_slot, block_size,
                                self.max_model_len, self.device, self.hidden_outputs)

    def can_replay_verify(self, batch: "StepBatch") -> bool:
        """A captured verification graph covers this step (every row verifies K drafts)."""
        return self.verify_graphs is not None and self.verify_graphs.can_run(batch)

    def replay_verify(self, batch: "StepBatch", states: list["CachedRequestState"],
                      patch: Callable[[SpecVerifyGraphs], None] | None = None
                      ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Replay the verification graph of the step; returns (the hidden states of every
        window token [n * (1 + K), D], the drafter's hidden rows of them or None: see
        SpecVerifyGraphs.run) and keeps the captured commit for `commit`. patch(graphs): runs
        after the host inputs are in the buffers (device-side inputs, async scheduling)."""
        vg = self.verify_graphs
        hidden, aux, step, bs = vg.run(batch, states, patch)
        self._verify_size = bs
        self._pending = _PendingCommit(step, [s.state_slot for s in states], [], bs,
                                       lambda accepted: vg.commit(bs, step, accepted))
        return hidden, aux

    # -----------------------------------------------------------------------------------------
    # Sizing
    # -----------------------------------------------------------------------------------------

    @property
    def extra_rows_per_slot(self) -> int:
        """KDA cache rows each request slot needs beyond its own (per_position: K)."""
        return self.k if self.per_position else 0

    @property
    def state_mode(self) -> str:
        return "per_position" if self.per_position else "recover"

    @cached_property
    def _kda_dims(self) -> tuple[int, int, int, int, int, int]:
        """(KDA layers, heads, head_k_dim, head_v_dim, conv_dim, conv kernel)."""
        a = self.args
        h, d = a.linear_num_heads, a.linear_head_dim
        return len(a.kda_layer_ids), h, d, d, 3 * h * d, a.linear_conv_kernel_dim

    def memory_line(self) -> str:
        mode = self.state_mode
        mem = spec_state_memory(mode, *self._kda_dims, self.k, self.conv_dtype_bytes)
        return (f"spec decode ({self.method}, K={self.k}, KDA state {mode}): "
                f"{mem.state_bytes / 2**20:.2f} MiB state + {mem.record_bytes / 2**20:.2f} MiB "
                f"verify records per request")

    # -----------------------------------------------------------------------------------------
    # Forward
    # -----------------------------------------------------------------------------------------

    def split_exports(self, internal: KDACheckpointRequest | None, is_spec: list[bool]
                      ) -> tuple[KDACheckpointRequest | None, list[tuple[int, int]]]:
        """Internal checkpoint exports -> (those of non-spec rows, [(batch row, dst slot)] of
        spec rows). A spec row's only known-token position is its first window token."""
        if internal is None:
            return None, []
        keep, spec = KDACheckpointRequest([], [], []), []
        for i, offset, dst in zip(internal.req_index, internal.offsets, internal.dst_slots):
            if not is_spec[i]:
                keep.req_index.append(i)
                keep.offsets.append(offset)
                keep.dst_slots.append(dst)
            elif offset == 1:
                spec.append((i, dst))
            else:
                raise RuntimeError(f"KDA checkpoint at offset {offset} of a spec row (only "
                                   "the first window token is a known token)")
        return (keep if keep.req_index else None), spec

    def build_step(self, md: AttentionMetadata, is_spec: list[bool], slots: list[int],
                   spec_exports: list[tuple[int, int]]) -> SpecStep:
        """Attach md.spec for this step's forward; the commit needs it after sampling."""
        own = [s for s, f in zip(slots, is_spec) if f]
        if self.per_position:
            base = self.scratch_base
            rows = [[s] + list(range(base + s * self.k, base + (s + 1) * self.k)) for s in own]
        else:
            rows = own
        idx = torch.tensor(rows, dtype=torch.int32).to(self.device, non_blocking=True)
        md.spec = build_spec_step(md, is_spec, idx, self.layout, self.per_position)
        row_of = {b: j for j, b in enumerate(i for i, f in enumerate(is_spec) if f)}
        self._pending = _PendingCommit(md.spec, own,
                                       [(row_of[i], dst) for i, dst in spec_exports])
        return md.spec

    # -----------------------------------------------------------------------------------------
    # Sampling and commit
    # -----------------------------------------------------------------------------------------

    def sampling_metadata(self, states, drafts: list[list[int]],
                          generators: dict[str, torch.Generator], eos_ids: set[int],
                          penalties: PenaltyCache) -> tuple[SpecDecodeMetadata, SamplingMetadata]:
        """The rejection sampler's inputs for the sampling rows (states, in batch order); built
        before the forward so their host->device copies do not wait behind it."""
        params = [s.sampling_params for s in states]
        gens = {j: generators[s.req_id] for j, s in enumerate(states)
                if s.req_id in generators}
        stops = [p.all_stop_token_ids if p.ignore_eos else eos_ids | p.all_stop_token_ids
                 for p in params]
        # min_tokens bans: not for structured outputs (see min_tokens_banned_ids)
        banned = spec_banned_ids([p.min_tokens if p.structured_outputs is None else 0
                                  for p in params],
                                 [len(s.token_ids) - s.num_prompt_tokens for s in states],
                                 stops, [len(d) for d in drafts])
        # placeholders (drafts still on the device) stand as 0: sample_tokens reads the real ids
        spec_md = SpecDecodeMetadata.make([[max(t, 0) for t in d] for d in drafts], self.device,
                                          banned)
        md = SamplingMetadata.build(params, gens, None, self.device)
        md.processing = self._logits_processing(states, drafts, penalties)
        return spec_md, md

    def sample(self, logits: torch.Tensor, states, drafts: list[list[int]],
               prepared: tuple[SpecDecodeMetadata, SamplingMetadata]):
        """logits: [sum(1 + K_i), V] for the sampling rows (states, in batch order); prepared:
        sampling_metadata(states, drafts, ...). Returns (emitted tokens per row, logprobs per
        row: list of {token: Logprob} or None)."""
        out = self.sample_tokens(logits, states, drafts, prepared)
        return self.emitted_tokens(out, prepared[0], states, drafts, out.parse_output())

    def sample_graphed(self, states, drafts: list[list[int]],
                       prepared: tuple[SpecDecodeMetadata, SamplingMetadata],
                       grammar=None) -> RejectionSamplerOutput | None:
        """After a verification graph's replay: the LM head and the rejection sampler as one
        graph replay, the emitted counts left in the commit graph's input (the `commit` that
        follows only replays it). Returns the output as sample_tokens does (on the device), or
        None where no sampling graph covers the step (then the caller samples eagerly)."""
        sg, p = self.sample_graphs, self._pending
        if sg is None or grammar is not None or p is None or p.graph_commit is None:
            return None
        spec_md, md = prepared
        if spec_md.banned_token_ids is not None:
            return None
        key = sg.key(p.pad_to, md, len(p.own_slots), drafts)
        if key is None:
            return None
        q_rows = None
        if sg.q is not None:
            q_rows = [self.draft_probs.get(s.req_id) for s in states]
            if any(q is None or q.shape[0] < self.k for q in q_rows):
                return None
            q_rows = [q[:self.k] for q in q_rows]
        out = sg.run(p.pad_to, key, [s.sampling_params for s in states], q_rows)
        vg, bs, step = self.verify_graphs, p.pad_to, p.step
        p.graph_commit = lambda _num_accepted: vg.commit_written(bs, step)
        return out

    def sample_tokens(self, logits: torch.Tensor, states, drafts: list[list[int]],
                      prepared: tuple[SpecDecodeMetadata, SamplingMetadata],
                      draft_ids: torch.Tensor | None = None) -> RejectionSamplerOutput:
        """The rejection sampler's output, left on the device (no host sync). draft_ids: [D]
        the drafts as the forward saw them (device), instead of the host lists."""
        spec_md, md = prepared
        if draft_ids is not None:
            spec_md.draft_token_ids = draft_ids
        # synthetic acceptance reads no q: skip gathering [D, V] of draft probabilities
        q = None if self.sampler.is_synthetic else self._draft_probs(
            states, drafts, logits, spec_md.draft_token_ids)
        return self.sampler(logits, spec_md, md, q)

    def emitted_tokens(self, out: RejectionSamplerOutput, spec_md: SpecDecodeMetadata, states,
                       drafts: list[list[int]], emitted: list[list[int]]):
        """After sample_tokens, once the output is on the host: emitted (out.parse_output())
        goes into the stats; returns (emitted, logprobs per row as `sample`)."""
        params = [s.sampling_params for s in states]
        self.stats.observe_batch([len(d) for d in drafts], [len(e) - 1 for e in emitted])
        self.stats.kda_state_bytes_written += sum(
            spec_state_bytes_written(self.state_mode, *self._kda_dims, 1 + len(d), len(e),
                                     self.conv_dtype_bytes)
            for d, e in zip(drafts, emitted) if d)
        lps = spec_logprob_dicts(out, spec_md, [p.logprobs for p in params])
        logprobs = [None if per_tok is None else
                    [{t: Logprob(v, rk[t]) for t, v in lp.items()} for lp, rk in per_tok]
                    for per_tok in lps]
        return emitted, logprobs

    def _logits_processing(self, states, drafts: list[list[int]], penalties: PenaltyCache):
        """Penalties / logit_bias rows: such requests are never drafted for (propose), so each
        has exactly one logits row."""
        if not any(s.sampling_params.processes_logits for s in states):
            return None
        starts = np.cumsum([0] + [1 + len(d) for d in drafts[:-1]]).tolist()
        for s, d in zip(states, drafts):
            if d and s.sampling_params.processes_logits:
                raise RuntimeError(f"request {s.req_id!r} uses penalties or logit_bias but "
                                   "has drafts")
        return logits_processing(starts, states, penalties)

    def _draft_probs(self, states, drafts, logits, draft_ids: torch.Tensor
                     ) -> torch.Tensor | None:
        """[D, V] q of every draft; draft_ids [D]: the drafts on the device."""
        if not self.probabilistic:
            return None
        rows, start = [], 0
        for s, d in zip(states, drafts):
            if not d:
                continue
            q = self.draft_probs.get(s.req_id)
            if q is None or q.shape[0] < len(d):   # not from the drafter: one-hot
                q = torch.nn.functional.one_hot(draft_ids[start:start + len(d)],
                                                logits.shape[1]).float()
            rows.append(q[:len(d)])
            start += len(d)
        return torch.cat(rows) if rows else None

    def commit(self, caches: ModelCaches, num_accepted: list[int] | torch.Tensor) -> None:
        """num_accepted: per spec row, tokens emitted (= accepted drafts + 1): a host list, or
        an int64 device tensor (async scheduling: no host sync)."""
        p, self._pending = self._pending, None
        if p.graph_commit is not None:
            p.graph_commit(num_accepted if torch.is_tensor(num_accepted) else list(num_accepted))
            return
        if torch.is_tensor(num_accepted):
            n = torch.zeros(max(p.pad_to, num_accepted.shape[0]), dtype=torch.int64,
                            device=self.device)
            n[:num_accepted.shape[0]] = num_accepted
        else:
            num_accepted = list(num_accepted) + [0] * max(0, p.pad_to - len(num_accepted))
            n = torch.tensor(num_accepted, dtype=torch.int64).to(self.device, non_blocking=True)
        if p.exports:
            self._export_first_token(caches, p)
        kda_spec.commit(p.step, caches.kda_recurrent, caches.kda_conv, n)

    def _export_first_token(self, caches: ModelCaches, p: _PendingCommit) -> None:
        """Checkpoint slots <- the state after the row's first window token."""
        if self.per_position:   # the own slot (column 0) holds exactly that state now
            for j, dst in p.exports:
                caches.copy_state(p.own_slots[j], dst)
            return
        slots = list(p.own_slots)
        n = [0] * len(slots)    # n = 0 rewrites a row's own state unchanged
        for j, dst in p.exports:
            caches.copy_state(p.own_slots[j], dst)
            slots[j], n[j] = dst, 1
        kda_spec.commit(p.step, caches.kda_recurrent, caches.kda_conv,
                        torch.tensor(n, dtype=torch.int64).to(self.device, non_blocking=True),
                        torch.tensor(slots, dtype=torch.int32).to(self.device, non_blocking=True))

    # -----------------------------------------------------------------------------------------
    # Drafts
    # -----------------------------------------------------------------------------------------

    def propose(self, states, num_reqs: int | None = None) -> dict[str, list[int]]:
        """Drafts for requests that just sampled (they decode next), capped so that verifying
        them cannot pass max_tokens or max_model_len. num_reqs: the step's request count; none
        are proposed when it reaches disable_by_batch_size (a draft model catches up on the
        skipped tokens at its next proposal)."""
        for s in states:
            self.draft_probs.pop(s.req_id, None)
        limit = self.disable_by_batch_size
        if limit is not None and (num_reqs if num_reqs is not None else len(states)) >= limit:
            return {}
        reqs, caps = [], []
        for s in states:
            cap = min(self.k, self.max_model_len - len(s.token_ids) - 1)
            if s.sampling_params.processes_logits:
                cap = 0   # penalties / logit_bias depend on each accepted token: not drafted
            max_tokens = s.sampling_params.max_tokens
            if max_tokens is not None:
                cap = min(cap, max_tokens - (len(s.token_ids) - s.num_prompt_tokens) - 1)
            if cap > 0:
                reqs.append(s)
                caps.append(cap)
        if not reqs:
            return {}
        tokens = [s.token_ids for s in reqs]
        if isinstance(self.proposer, NgramProposer):
            drafts = self.proposer.propose(tokens, caps)
        else:
            temps = [0.0 if s.sampling_params.greedy else s.sampling_params.temperature
                     for s in reqs]
            prop = self.proposer.propose([s.req_id for s in reqs], tokens, temps, caps)
            drafts = prop.draft_token_ids
            if prop.draft_probs is not None:
                start = 0
                for s, d in zip(reqs, drafts):
                    self.draft_probs[s.req_id] = prop.draft_probs[start:start + len(d)]
                    start += len(d)
        return {s.req_id: d for s, d in zip(reqs, drafts) if d}

    def propose_device(self, batch: "StepBatch", states, start: torch.Tensor,
                       verified: torch.Tensor, input_ids: torch.Tensor, emitted: torch.Tensor,
                       num_emitted: torch.Tensor) -> tuple[list[int], torch.Tensor | None]:
        """device_drafts: the drafter takes this step's verified positions and drafts K tokens
        for the sampling rows, all on the device. Batch rows i (states, in batch order): host
        batch.num_computed[i] (an upper bound of the true start while a step is in flight);
        start [N] int64 the true starts, verified [N] int64 the tokens whose target state is
        final (query_lens, 1 + accepted drafts on a spec row); input_ids [T]; emitted [S, W] /
        num_emitted [S] what each sampling row (batch.sample_rows) emitted. Returns (the
        sampling rows, as indices into sample_rows, that were drafted for; their drafts
        [S', K] int64 on the device)."""
        req_ids, sample_rows = batch.req_ids, batch.sample_rows
        drafted = [not s.sampling_params.processes_logits for s in states]
        props = [j for j, i in enumerate(sample_rows) if drafted[i]]
        for i in sample_rows:
            self.draft_probs.pop(req_ids[i], None)
        rows = [sample_rows[j] for j in props]
        idx = torch.tensor(props, dtype=torch.long).to(emitted.device, non_blocking=True)
        step = DeviceStep(
            [r if d else None for r, d in zip(req_ids, drafted)], [s.token_ids for s in states],
            batch.num_computed, batch.query_lens, start, verified, self._step_aux, rows,
            emitted.index_select(0, idx), num_emitted.index_select(0, idx),
            [0.0 if states[i].sampling_params.greedy else states[i].sampling_params.temperature
             for i in rows], input_ids, [bool(d) for d in batch.drafts], self._verify_size)
        self._step_aux, self._verify_size = None, None
        drafts, probs = self.proposer.propose_device(step)
        if probs is not None:
            for j, i in enumerate(rows):
                self.draft_probs[req_ids[i]] = probs[j]
        return props, drafts

    def keep_aux(self, aux: torch.Tensor) -> None:
        """device_drafts: the step's hidden / aux rows [T, W] for propose_device."""
        self._step_aux = aux

    def free(self, req_id: str) -> None:
        """A request finished, was aborted or preempted."""
        self.draft_probs.pop(req_id, None)
        if not isinstance(self.proposer, NgramProposer):
            self.proposer.free(req_id)
