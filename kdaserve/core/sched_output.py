"""What the scheduler hands the worker each step, and what the worker hands back.

Pure data (picklable, no torch) so it can cross a process boundary. The worker keeps a persistent
copy of each running request (token ids, block ids, state slot) keyed by req_id; each step sends
only what changed (vLLM's "new vs cached" split).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kdaserve.sampling_params import SamplingParams

DRAFT_PLACEHOLDER = -1
"""A scheduled draft token the host does not know yet (async scheduling under speculation):
the worker takes it from the previous step's proposal on the device."""


@dataclass
class NewRequestData:
    """A request the worker has not seen yet (first schedule, or resumed after preemption)."""

    req_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    """Tokens already generated (non-empty only when resumed after preemption by recompute)."""
    sampling_params: SamplingParams
    block_ids: list[int]
    """MLA latent-KV blocks, in order; block i holds positions [i*block_size, (i+1)*block_size)."""
    state_slot: int
    """KDA state slot (recurrent + conv state of every KDA layer)."""
    num_computed_tokens: int
    """Tokens whose KV/state are already valid (prefix-cache hit), before this step."""
    sample_seed_offset: int = 0
    """How many tokens of this request were sampled before (seeded sampling resumes from it)."""


@dataclass
class CachedRequestData:
    """Running requests the worker already holds; parallel lists."""

    req_ids: list[str] = field(default_factory=list)
    new_block_ids: list[list[int]] = field(default_factory=list)
    """Blocks appended to the request's block list since the previous step."""
    num_computed_tokens: list[int] = field(default_factory=list)


@dataclass
class KDAStateCopy:
    """Copy every KDA layer's recurrent + conv state from slot src to slot dst before the forward
    (n > 1 forks, prefix-checkpoint restore)."""

    src_slot: int
    dst_slot: int


@dataclass
class KDACheckpointExport:
    """Write the request's KDA state after its first `num_tokens` tokens (every KDA layer's
    recurrent + conv state) into checkpoint slot `dst_slot` during this step's forward.

    `num_tokens` lies in (num_computed_tokens, num_computed_tokens + num_scheduled_tokens]: at
    the chunk end it is the request's final state (a slot copy after the forward); inside the
    chunk the KDA layers export it from the same kernel call (internal checkpoint)."""

    req_id: str
    num_tokens: int
    dst_slot: int


@dataclass
class OffloadCopy:
    """One entry's copy between the device caches and a host slot of the offload tier:
    kind "kv" moves MLA block `device_idx` (every MLA layer), kind "state" KDA state slot
    `device_idx` (every KDA layer's recurrent + conv state)."""

    kind: str
    device_idx: int
    host_idx: int


@dataclass
class DiskJob:
    """A file job of the offload tier's disk level, run on every rank's writer thread in
    job_id order: "write" host slot -> file, "read" file -> host slot, "delete" the file
    (host_idx -1)."""

    job_id: int
    op: str
    kind: str
    key: str
    """The entry's key, hex."""
    host_idx: int = -1


@dataclass
class OffloadOps:
    """The offload tier's work for one step (kdaserve.core.offload)."""

    stores: list[OffloadCopy] = field(default_factory=list)
    """Device -> host, before everything else of the step (their sources may be reused by
    this step's copies, loads and forward)."""
    loads: list[OffloadCopy] = field(default_factory=list)
    """Host -> device, after the block and state copies (a load's destination slot may be
    the source of a leading checkpoint-export copy)."""
    disk_jobs: list[DiskJob] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not (self.stores or self.loads or self.disk_jobs)


@dataclass
class OffloadOutput:
    """Disk jobs finished on every rank since the last report (job ids)."""

    done: list[int] = field(default_factory=list)
    failed: list[int] = field(default_factory=list)
    """Failed on at least one rank (and finished on all)."""
    seconds: float = 0.0
    """Rank 0's time in these jobs (file I/O, from the job's start on the writer thread)."""


@dataclass
class SchedulerOutput:
    scheduled_new_reqs: list[NewRequestData] = field(default_factory=list)
    scheduled_cached_reqs: CachedRequestData = field(default_factory=CachedRequestData)
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    """req_id -> tokens to compute this step (prompt chunk, 1 decode token, or 1 + drafts)."""
    total_num_scheduled_tokens: int = 0
    scheduled_spec_decode_tokens: dict[str, list[int]] = field(default_factory=dict)
    """req_id -> draft tokens scheduled for verification (filled by speculative decoding);
    DRAFT_PLACEHOLDER entries: drafts of a step still in flight, read on the device."""
    finished_req_ids: set[str] = field(default_factory=set)
    """Requests finished or aborted since the last step: the worker drops their state."""
    preempted_req_ids: set[str] = field(default_factory=set)
    sampling_req_ids: set[str] = field(default_factory=set)
    """Requests whose scheduled tokens reach the end of what is known (the worker samples for
    them this step)."""
    state_copies: list[KDAStateCopy] = field(default_factory=list)
    """Applied in list order before the forward (checkpoint exports of requests that finished
    last step come first: their source slot may be a later copy's destination)."""
    kda_checkpoint_exports: list[KDACheckpointExport] = field(default_factory=list)
    """KDA prefix checkpoints to export during this step's forward."""
    block_copies: list[tuple[int, int]] = field(default_factory=list)
    """(src_block, dst_block) MLA latent-KV block copies to do before the forward (copy-on-write of
    a partially filled block when n > 1 samples fork from one prompt)."""
    structured_output_request_ids: list[str] = field(default_factory=list)
    """Sampling requests whose output follows a grammar, in grammar_bitmask row order (filled by
    the engine core's structured-output manager after schedule())."""
    grammar_bitmask: Any = None
    """[rows, ceil(vocab_size / 32)] int32 host array (bit t of a row: token t allowed), 1 + its
    scheduled drafts rows per structured_output_request_ids entry; None when no structured
    request samples this step."""
    kv_connector_metadata: Any = None
    """The KV connector's per-step metadata for the workers (loads to start, finished
    requests held for remote readers, releases); None without a connector."""
    kv_connector_poll: bool = False
    """Transfers are outstanding (loads in flight, holds): under tensor parallelism the
    ranks agree at this step's collect on what their connectors finished."""
    offload: OffloadOps | None = None
    """The offload tier's copies and disk jobs for this step (None: nothing to do)."""

    @property
    def is_empty(self) -> bool:
        return self.total_num_scheduled_tokens == 0

    def _prefill_rows(self):
        spec = self.scheduled_spec_decode_tokens
        return (rid for rid, n in self.num_scheduled_tokens.items()
                if n > 1 + len(spec.get(rid, ())))

    def prefill_req_ids(self) -> list[str]:
        """Requests that compute more than their next token and its drafts this step: a prompt
        chunk, or the recompute of a preempted request (a verification row is not one)."""
        return list(self._prefill_rows())

    def has_prefill(self) -> bool:
        """Whether prefill_req_ids() is non-empty, without building it (once a step)."""
        return any(True for _ in self._prefill_rows())


@dataclass
class KVConnectorOutput:
    """What the worker's KV connector reports after a step (request ids of the scheduler)."""

    finished_sending: set[str] = field(default_factory=set)
    """Producer: held requests whose pulls are all acknowledged (or released by their
    consumer): their blocks and state slot may be freed."""
    finished_recving: set[str] = field(default_factory=set)
    """Consumer: requests whose KV blocks and KDA state have fully arrived."""
    failed_recving: set[str] = field(default_factory=set)
    """Consumer: requests whose load failed or timed out (recomputed; their blocks and slot
    hold nothing valid)."""
    num_bytes_recved: int = 0
    """Bytes of the loads finished this step."""
    recv_seconds: float = 0.0
    """Sum of the finished loads' latencies (start of the pull to its completion)."""

    @property
    def is_empty(self) -> bool:
        return not (self.finished_sending or self.finished_recving or self.failed_recving)


@dataclass
class ModelRunnerOutput:
    req_ids: list[str] = field(default_factory=list)
    sampled_token_ids: list[list[int]] = field(default_factory=list)
    """Per request: the tokens accepted this step ([] while its prompt is still being prefilled;
    one token for plain decode; up to 1 + drafts with speculative decoding)."""
    logprobs: list[list[dict[int, float]] | None] = field(default_factory=list)
    """Per request, per sampled token: {token_id: logprob} for the top-k plus the sampled one."""
    draft_token_ids: dict[str, list[int]] = field(default_factory=dict)
    """Speculative decoding: req_id -> drafts to verify next step (for the scheduler's
    update_draft_token_ids; requests that finished meanwhile are ignored)."""
    kv_connector_output: KVConnectorOutput | None = None
    """The KV connector's report for this step (None without a connector)."""
    offload_output: OffloadOutput | None = None
    """The offload tier's finished disk jobs (None when none finished)."""
