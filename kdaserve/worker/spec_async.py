"""Async scheduling under speculative decoding: the next step's inputs built on the device.

With async scheduling the engine schedules and launches step N+1 before step N's output is
processed (engine/core.py). Under speculation step N+1's inputs depend on step N's results,
which stay on the device until then:

- the scheduler gives every request that samples in step N K placeholder drafts and counts
  its step-N tokens at their worst case (1 + drafts), so it schedules step N+1's window
  [last token] + K drafts with `num_computed_tokens` ahead of the truth by step N's rejected
  drafts (core/scheduler.py). Blocks are allocated for that worst case;
- step N, on the device, after rejection sampling, the KDA commit and the drafter's proposal,
  writes into `SpecCarry`, per request state slot: the window of the next step (its last
  emitted token, the bonus or recovered one, then the K new drafts) and the drafts it rejected;
- step N+1's launch copies each carry row's window from there into its input ids (one index
  copy) and subtracts the rejected count from the host's (optimistic) positions on the device:
  seq_lens, slot_mapping (from the block table), the absorbed MLA rows' seq_lens; the verify
  graph's buffers get the same patch after their host fill. The drafts the rejection sampler
  checks are read back from the step's input ids;
- when step N is collected the host appends its tokens; the scheduler rolls its
  num_computed_tokens back by the rejected drafts (the rejected positions' KV is simply
  overwritten later, their KDA state never committed) and a stop found there frees the request
  (its step N+1 output is dropped, the KV it wrote lies past every cached token).

Rows are "carry rows" when the scheduler gave them placeholder drafts, or when their window
starts past the tokens the host knows while a launched step that sampled for them is not
collected yet (near max_tokens, a lone pending token). A request passed over for a step keeps
its placeholders after its step is collected: the carry still holds exactly that proposal,
and its positions need no fix. Everything here is fixed-shape index arithmetic on tensors
(capturable); no value goes from the device to the host.

Which steps overlap: those of drafters with `propose_device` (DSpark, MTP, the draft model
with its window catch-up), as long as no running request has penalties / logit_bias, a
grammar, or fewer outputs than its min_tokens (engine/core.py `_can_overlap`); ngram (host
token lists), the draft model's varlen catch-up and disable_by_batch_size keep every step one
at a time, as without async scheduling.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch

from kdaserve.attention.metadata import AttentionMetadata
from kdaserve.core.sched_output import ModelRunnerOutput
from kdaserve.outputs import Logprob
from kdaserve.sample.grammar_mask import apply_grammar_bitmask
from kdaserve.sample.sampler import SamplerOutput, to_logprob_dicts
from kdaserve.spec_decode.rejection_sampler import PLACEHOLDER_TOKEN_ID, RejectionSamplerOutput
from kdaserve.worker.input_batch import DeviceSpecStep, LaunchedStep

if TYPE_CHECKING:
    from kdaserve.worker.model_runner import ModelRunner


def to_device(values, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A host list / array as a device tensor, copied without waiting for the device."""
    t = torch.as_tensor(np.asarray(values), dtype=dtype)
    return t.to(device, non_blocking=True)


@dataclass
class CarryRows:
    """The carry rows of one step (host): where their tokens sit and whose slot feeds them."""

    token_pos: list[int] = field(default_factory=list)
    """Position in the step's input ids of each carry token."""
    src_slot: list[int] = field(default_factory=list)
    """Its request's state slot..."""
    src_col: list[int] = field(default_factory=list)
    """...and its column in the carried window (0: the last token, j: draft j)."""
    fix_rows: list[int] = field(default_factory=list)
    """Carry rows whose step in flight verified drafts: the host runs ahead of their true
    start by the drafts it rejected, fixed on the device (the decode graphs, which take host
    positions, cannot run such a step)..."""
    fix_slots: list[int] = field(default_factory=list)
    """...and their state slots."""

    @property
    def corrected(self) -> bool:
        return bool(self.fix_rows)

    def __bool__(self) -> bool:
        return bool(self.token_pos)


class SpecCarry:
    """Per request state slot, on the device: the next window and the rejected count."""

    def __init__(self, num_slots: int, k: int, device: torch.device) -> None:
        self.device = device
        self.window = torch.zeros(num_slots, 1 + k, dtype=torch.long, device=device)
        """[slots, 1 + K]: the last emitted token, then the drafts of the next step."""
        self.rejected = torch.zeros(num_slots, dtype=torch.long, device=device)
        """[slots]: drafts the slot's last sampling step rejected (0 without drafts)."""

    def record(self, slots: torch.Tensor, last: torch.Tensor, rejected: torch.Tensor) -> None:
        """After sampling: slots [S] of the sampling rows, their last emitted tokens [S] and
        rejected drafts [S]."""
        self.window[slots, 0] = last
        self.rejected[slots] = rejected

    def record_drafts(self, slots: torch.Tensor, drafts: torch.Tensor) -> None:
        """The proposal for the next step: drafts [S', K] of slots [S']."""
        self.window[slots, 1:] = drafts

    # ---- the next step ----
    def patch_ids(self, ids: torch.Tensor, carry: CarryRows) -> None:
        """ids [T] (device): the carry tokens from the windows."""
        if not carry:
            return
        pos = to_device(carry.token_pos, torch.long, self.device)
        src = to_device([carry.src_slot, carry.src_col], torch.long, self.device)
        ids.index_copy_(0, pos, self.window[src[0], src[1]])

    def fix(self, num_rows: int, carry: CarryRows) -> torch.Tensor:
        """[num_rows] int64: how far each batch row's host start runs ahead of the truth."""
        fix = torch.zeros(num_rows, dtype=torch.long, device=self.device)
        if carry.corrected:
            rows = to_device(carry.fix_rows, torch.long, self.device)
            slots = to_device(carry.fix_slots, torch.long, self.device)
            fix.index_copy_(0, rows, self.rejected.index_select(0, slots))
        return fix


def host_positions(query_lens: list[int], num_computed: list[int]) -> tuple[np.ndarray,
                                                                             np.ndarray]:
    """(request row, host position) of every token of a step, batch order."""
    q = np.asarray(query_lens, dtype=np.int64)
    c = np.asarray(num_computed, dtype=np.int64)
    row = np.repeat(np.arange(len(q)), q)
    start = np.cumsum(q) - q
    return row, np.arange(int(q.sum()), dtype=np.int64) - start[row] + c[row]


def fixed_slots(block_table: torch.Tensor, row: torch.Tensor, pos: torch.Tensor,
                block_size: int) -> torch.Tensor:
    """Flat latent-KV slot of each token (block tables [N, W] on the device)."""
    col = (pos // block_size).clamp(max=block_table.shape[1] - 1)
    return (block_table[row, col].long() * block_size + pos % block_size)


def correct_metadata(md: AttentionMetadata, fix: torch.Tensor, query_lens: list[int],
                     num_computed: list[int], block_size: int) -> torch.Tensor:
    """Before build_spec_step: move the rows' seq_lens and slot_mapping back by fix [N] (in
    place, so sliced views follow). Returns the per-token fix [T]."""
    row_np, pos_np = host_positions(query_lens, num_computed)
    row = to_device(row_np, torch.long, md.seq_lens.device)
    fix_tok = fix.index_select(0, row)                                        # [T]
    pos = to_device(pos_np, torch.long, md.seq_lens.device) - fix_tok
    md.seq_lens.sub_(fix.to(md.seq_lens.dtype))
    md.slot_mapping.copy_(fixed_slots(md.block_table, row, pos, block_size))
    return fix_tok


def correct_spec_rows(md: AttentionMetadata, fix: torch.Tensor, fix_tok: torch.Tensor,
                      is_spec: list[bool]) -> None:
    """After build_spec_step: the absorbed MLA rows' seq_lens, and the gathered non-spec
    metadata's seq_lens (the gather layout copies them from the host)."""
    rows = md.mla_absorbed
    if rows is not None:
        rows.seq_lens.sub_(fix_tok[rows.rows()].to(rows.seq_lens.dtype))
    spec = md.spec
    if spec is not None and spec.layout == "gather" and spec.md_non is not None:
        non = to_device([i for i, s in enumerate(is_spec) if not s], torch.long, fix.device)
        spec.md_non.seq_lens.copy_(md.seq_lens.index_select(0, non))


def correct_window(vg, fix: torch.Tensor, num_computed: list[int], block_size: int) -> None:
    """The verify graph's buffers after fill (n rows of k1 tokens): seq_lens and
    slot_mapping moved back by fix [n]."""
    n, k1 = fix.shape[0], vg.k1
    row_np, pos_np = host_positions([k1] * n, num_computed)
    dev = fix.device
    row = to_device(row_np, torch.long, dev)
    pos = to_device(pos_np, torch.long, dev) - fix.index_select(0, row)
    vg.seq_lens[:n].sub_(fix.to(vg.seq_lens.dtype))
    vg.slot_mapping[:n * k1].copy_(fixed_slots(vg.block_table[:n], row, pos, block_size))


# ---- one step of the runner (ModelRunner.launch / collect with device drafts) ----

def launch_step(runner: "ModelRunner", step: LaunchedStep, hidden: torch.Tensor,
                sample_states: list, sampling, grammar) -> None:
    """Sample (the rejection sampler when some row verifies drafts), commit, record each
    sampling row's next window in the carry and propose, all queued on the device; the
    results go to pinned host memory for `collect_step`. No host sync."""
    batch, dev, spec = step.batch, runner.device, runner.spec
    verified = to_device(batch.query_lens, torch.long, dev)                    # [N]
    rows = batch.sample_rows
    if not rows:   # the drafter still takes the positions this step computed
        none = verified[:0]
        spec.propose_device(batch, step.states, runner._step_start, verified,
                            runner._step_ids, none[:, None], none)
        step.output = ModelRunnerOutput(req_ids=batch.req_ids,
                                        sampled_token_ids=[[] for _ in batch.req_ids],
                                        logprobs=[None] * len(batch.req_ids))
        return
    drafts = [batch.drafts[i] for i in rows]
    res = step.spec = DeviceSpecStep(drafts=drafts)
    spec_rows = [j for j, d in enumerate(drafts) if d]
    out = (spec.sample_graphed(sample_states, drafts, sampling, grammar) if spec_rows
           else None)
    if out is None:
        logits = runner.model.compute_logits(hidden)                           # [R, V]
        if grammar is not None:
            apply_grammar_bitmask(logits, grammar)
    if spec_rows:
        if out is None:
            qsl = np.cumsum([0] + batch.query_lens)
            pos = [t for i, d in zip(rows, drafts)
                   for t in range(qsl[i] + 1, qsl[i] + 1 + len(d))]
            draft_ids = runner._step_ids.index_select(0, to_device(pos, torch.long, dev))
            out = spec.sample_tokens(logits, sample_states, drafts, sampling, draft_ids)
        emitted = out.num_accepted.index_select(0, to_device(spec_rows, torch.long, dev)) + 1
        spec.commit(runner.caches, emitted)
        tokens, num_emitted = out.output_token_ids, out.num_accepted + 1        # [S, *], [S]
        last = tokens.gather(1, out.num_accepted[:, None]).squeeze(1)            # [S]
        rejected = to_device([len(d) for d in drafts], torch.long, dev) - out.num_accepted
        verified.index_copy_(0, to_device([rows[j] for j in spec_rows], torch.long, dev),
                             emitted)
        lp = out.row_logprobs
        host = to_host(SamplerOutput(out.output_token_ids,
                                     *((lp.logprob_token_ids, lp.logprobs, lp.ranks)
                                       if lp is not None else (None, None, None))))
        res.output_token_ids = host.sampled_token_ids
        res.sampler_out = RejectionSamplerOutput(
            out.output_token_ids, out.num_accepted, out.accepted_per_position,
            None if lp is None else SamplerOutput(lp.sampled_token_ids, host.logprob_token_ids,
                                                  host.logprobs, host.ranks))
        res.spec_md = sampling[0]
    else:
        out = runner.sampler(logits, sampling)
        last = out.sampled_token_ids                                          # [S]
        tokens, num_emitted = last[:, None], torch.ones_like(last)
        rejected = torch.zeros_like(last)
        step.host = to_host(out)
    slots = to_device([s.state_slot for s in sample_states], torch.long, dev)
    runner.carry.record(slots, last, rejected)
    props, proposal = spec.propose_device(batch, step.states, runner._step_start, verified,
                                          runner._step_ids, tokens, num_emitted)
    if props:
        runner.carry.record_drafts(slots.index_select(0, to_device(props, torch.long, dev)),
                                   proposal)
        res.proposed_rows = props
        res.proposal = to_host(SamplerOutput(proposal)).sampled_token_ids
    for s, d in zip(sample_states, drafts):
        s.num_pending += 1
        s.last_num_drafts = len(d)
    if last.is_cuda:
        step.done = torch.cuda.Event()
        step.done.record()


def collect_step(runner: "ModelRunner", step: LaunchedStep):
    """A launch_step step whose results are in host memory: emitted tokens, logprobs, stats
    and the proposal (used when the engine processes this step before the next schedule)."""
    batch, res = step.batch, step.spec
    sample_states = [step.states[i] for i in batch.sample_rows]
    if res.output_token_ids is not None:
        emitted = [[t for t in row if t != PLACEHOLDER_TOKEN_ID]
                   for row in res.output_token_ids.tolist()]
        emitted, logprobs = runner.spec.emitted_tokens(res.sampler_out, res.spec_md,
                                                       sample_states, res.drafts, emitted)
    else:
        emitted = [[t] for t in step.host.sampled_token_ids.tolist()]
        lp_dicts, rank_dicts = to_logprob_dicts(
            step.host, [s.sampling_params.logprobs for s in sample_states])
        logprobs = [None if lp is None else [{t: Logprob(v, rk[t]) for t, v in lp.items()}]
                    for lp, rk in zip(lp_dicts, rank_dicts)]
    for s in sample_states:
        s.num_pending -= 1
    proposal = res.proposal.tolist() if res.proposal is not None else []
    drafts = {sample_states[j].req_id: d for j, d in zip(res.proposed_rows, proposal)}
    return runner._finish(batch, step.states, emitted, logprobs, drafts)


def to_host(out: SamplerOutput) -> SamplerOutput:
    """Queue the copies of a sampler output into pinned host memory (no wait)."""
    def copy(t: torch.Tensor | None) -> torch.Tensor | None:
        if t is None or t.device.type == "cpu":
            return t
        host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        return host.copy_(t, non_blocking=True)
    return SamplerOutput(copy(out.sampled_token_ids), copy(out.logprob_token_ids),
                         copy(out.logprobs), copy(out.ranks))
