"""What the scheduler reports to the engine after each step, per request."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class EngineCoreOutput:
    req_id: str
    new_token_ids: list[int]
    """Tokens appended this step (a stop token that finished the request included)."""
    new_logprobs: list[dict[int, float]] | None = None
    """Per new token: {token_id: logprob}, when the request asked for logprobs."""
    finish_reason: str | None = None
    """'stop' | 'length' | 'abort', or None while the request runs on."""
    stop_reason: int | str | None = None
    """The stop token id that finished the request (None for EOS or length)."""
    num_cached_tokens: int = 0
    parent_req_id: str | None = None
    """For an n > 1 sample: the request the engine added; `sample_index` is its position."""
    sample_index: int = 0
    kv_transfer_params: dict | None = None
    """On a finished request's last output: what a consumer needs to pull its KV blocks and
    KDA state (prefill/decode disaggregation), returned to the client."""

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class SchedulerStats:
    """The engine's one stats record (the server's /metrics reads it). The scheduler fills the
    queue and cache fields; the engine core adds speculative decoding and the step floor; the
    front adds the token counters (it alone knows which tokens reached an output: a stop string
    drops the tokens the core produced after it). Counters are totals since start-up."""

    num_running_reqs: int = 0
    num_waiting_reqs: int = 0
    kv_cache_usage: float = 0.0
    num_free_blocks: int = 0
    num_total_blocks: int = 0
    num_total_kv_tokens: int = 0
    """MLA KV capacity in tokens: blocks x tokens per scheduler block (with decode context
    parallelism, dcp ranks x one rank's block_size)."""
    num_free_state_slots: int = 0
    num_total_state_slots: int = 0
    num_preemptions: int = 0
    prefix_cache_queries: int = 0
    """Tokens of admitted requests looked up in the prefix cache."""
    prefix_cache_hits: int = 0
    """Tokens served from the prefix cache: KV blocks + KDA checkpoint."""
    num_kda_checkpoints: int = 0
    """Ready KDA checkpoints now."""
    num_total_kda_checkpoint_slots: int = 0
    num_kda_checkpoint_exports: int = 0
    """KDA checkpoints written."""
    num_prompt_tokens: int = 0
    """Prompt tokens of admitted requests."""
    num_generation_tokens: int = 0
    """Tokens in the requests' outputs."""
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_kda_state_bytes_written: int = 0
    step_floor_ratio: float | None = None
    """Last decode step's time over its byte floor."""
    kv_transfer_loads: int = 0
    """Requests whose KV blocks and KDA state were pulled from a remote prefill."""
    kv_transfer_bytes: int = 0
    """Bytes pulled by those loads."""
    kv_transfer_seconds: float = 0.0
    """Sum of their latencies (pull start to completion)."""
    kv_transfer_failures: int = 0
    """Loads that failed or timed out (their requests recomputed the prompt)."""
    kv_transfer_sends: int = 0
    """Held requests whose consumer acknowledged or released them."""
    kv_transfer_expired: int = 0
    """Held requests freed by the hold timeout (no consumer came)."""
    num_kv_transfer_held: int = 0
    """Finished requests whose blocks and state slot are held for a remote reader now."""
    num_kv_transfer_loading: int = 0
    """Requests waiting for their remote KV blocks and KDA state now."""
    offload_host_hit_tokens: int = 0
    """Prompt tokens of prefix hits that loaded entries from the offload tier's host memory."""
    offload_disk_hit_tokens: int = 0
    """Prompt tokens of prefix hits that used entries read back from the offload tier's disk."""
    offload_bytes_stored: int = 0
    """Device -> host bytes of the offload tier (one rank's)."""
    offload_bytes_loaded: int = 0
    """Host -> device bytes of the offload tier (one rank's)."""
    offload_bytes_written: int = 0
    """Host -> disk bytes of the offload tier (one rank's)."""
    offload_bytes_read: int = 0
    """Disk -> host bytes of the offload tier (one rank's)."""
    offload_dropped_stores: int = 0
    """Device evictions the offload tier had no free host slot for."""
    offload_failures: int = 0
    """Offload file jobs that failed on some rank."""
    offload_disk_seconds: float = 0.0
    """Time in the offload tier's finished file writes and reads (rank 0's)."""
    offload_disk_jobs: int = 0
    """Those file writes and reads."""
    num_offload_host_entries: int = 0
    """Entries in the offload tier's host memory now."""
    num_offload_disk_entries: int = 0
    """Entries on the offload tier's disk now."""
    offload_disk_bytes: int = 0
    """Bytes on the offload tier's disk now (one rank's)."""
