"""RequestOutput / CompletionOutput with vLLM's shapes."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None
    """1-based rank of the token in the distribution."""
    decoded_token: str | None = None


SampleLogprobs = list[dict[int, Logprob]]
"""One dict per generated token: token id -> Logprob (top-k plus the sampled token)."""


@dataclass
class CompletionOutput:
    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    cumulative_logprob: float | None = None
    logprobs: SampleLogprobs | None = None
    finish_reason: str | None = None
    """None while running; then "stop" (EOS, stop token or stop string), "length" or "abort"."""
    stop_reason: int | str | None = None
    """The stop token id or stop string that ended the sample, if any."""

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    """Prompt tokens served from the prefix cache."""
    metrics: RequestMetrics | None = None
    kv_transfer_params: dict | None = None
    """Set on a finished request whose KV blocks and KDA state a prefill instance holds for a
    decode instance to pull (prefill/decode disaggregation)."""
