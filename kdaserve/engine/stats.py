"""Engine-level counters exported by the server's /metrics."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class EngineStats:
    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0
    num_free_blocks: int = 0
    num_total_blocks: int = 0
    num_free_state_slots: int = 0
    num_total_state_slots: int = 0
    prompt_tokens_total: int = 0
    generation_tokens_total: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_kda_checkpoints: int = 0
    num_total_kda_checkpoint_slots: int = 0
    num_kda_checkpoint_exports: int = 0
    num_preemptions_total: int = 0
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_kda_state_bytes_written: int = 0
    step_floor_ratio: float | None = None
    """Last decode step's time over its byte floor (set when the roofline gauge is on)."""
