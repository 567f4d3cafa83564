"""Speculative decoding counters (vLLM's spec_decode metric names), mergeable across steps."""

from __future__ import annotations

from dataclasses import dataclass, field

from kdaserve.config.synthetic import SYNTHETIC_LABEL


@dataclass
class SpecDecodingStats:
    num_spec_tokens: int
    """K: the most drafts one request verifies in a step (sizes the per-position counts)."""
    num_drafts: int = 0
    """Verify steps of requests that had at least one draft."""
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)
    synthetic: bool = False
    """True when acceptance came from the synthetic model, not from rejection sampling."""
    kda_state_bytes_written: int = 0
    """KDA state bytes the verify steps and their commits wrote (spec rows only, counted from
    what each state mode's kernels store: spec_state_bytes_written)."""

    def __post_init__(self) -> None:
        if self.num_spec_tokens < 0:
            raise ValueError(f"num_spec_tokens must be >= 0, got {self.num_spec_tokens}")
        if not self.num_accepted_tokens_per_pos:
            self.num_accepted_tokens_per_pos = [0] * self.num_spec_tokens
        elif len(self.num_accepted_tokens_per_pos) != self.num_spec_tokens:
            raise ValueError(f"num_accepted_tokens_per_pos needs {self.num_spec_tokens} "
                             f"entries, got {len(self.num_accepted_tokens_per_pos)}")

    def observe(self, num_draft_tokens: int, num_accepted_tokens: int) -> None:
        """One request's verify step: it had num_draft_tokens drafts and accepted the first
        num_accepted_tokens of them."""
        if num_draft_tokens == 0:
            return
        if not 0 <= num_accepted_tokens <= num_draft_tokens <= self.num_spec_tokens:
            raise ValueError(f"need 0 <= accepted ({num_accepted_tokens}) <= drafts "
                             f"({num_draft_tokens}) <= K ({self.num_spec_tokens})")
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted_tokens
        for j in range(num_accepted_tokens):
            self.num_accepted_tokens_per_pos[j] += 1

    def observe_batch(self, num_draft_tokens: list[int], num_accepted: list[int]) -> None:
        for d, a in zip(num_draft_tokens, num_accepted, strict=True):
            self.observe(d, a)

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens emitted per verify step, the target's own token included (1.0 if none)."""
        return 1.0 + (self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0)

    @property
    def draft_acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    def as_dict(self) -> dict:
        d = {
            "num_drafts": self.num_drafts,
            "num_draft_tokens": self.num_draft_tokens,
            "num_accepted_tokens": self.num_accepted_tokens,
            "num_accepted_tokens_per_pos": list(self.num_accepted_tokens_per_pos),
            "mean_acceptance_length": self.mean_acceptance_length,
            "draft_acceptance_rate": self.draft_acceptance_rate,
            "acceptance_mode": "synthetic" if self.synthetic else "rejection_sampling",
            "kda_state_bytes_written": self.kda_state_bytes_written,
        }
        if self.synthetic:
            d["note"] = SYNTHETIC_LABEL
        return d
