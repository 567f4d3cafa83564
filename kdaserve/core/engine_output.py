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

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class SchedulerStats:
    num_running_reqs: int = 0
    num_waiting_reqs: int = 0
    kv_cache_usage: float = 0.0
    num_free_blocks: int = 0
    num_total_blocks: int = 0
    num_free_state_slots: int = 0
    num_total_state_slots: int = 0
    num_preemptions: int = 0
    """Total since the scheduler was created."""
    prefix_cache_queries: int = 0
    """Tokens of admitted requests looked up in the prefix cache (total)."""
    prefix_cache_hits: int = 0
    """Tokens served from the prefix cache: KV blocks + KDA checkpoint (total)."""
    num_kda_checkpoints: int = 0
    """Ready KDA checkpoints now."""
    num_total_kda_checkpoint_slots: int = 0
    num_kda_checkpoint_exports: int = 0
    """KDA checkpoints written (total)."""
