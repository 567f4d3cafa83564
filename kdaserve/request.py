"""Request: one sequence as the scheduler sees it (tokens, progress, status)."""

from __future__ import annotations

import enum
import time
from collections.abc import Iterable

from kdaserve.sampling_params import SamplingParams


class RequestStatus(enum.IntEnum):
    WAITING = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    # Everything after PREEMPTED is a finished state.
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH_CAPPED = enum.auto()
    FINISHED_ABORTED = enum.auto()

    @staticmethod
    def is_finished(status: RequestStatus) -> bool:
        return status > RequestStatus.PREEMPTED


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH_CAPPED: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
}


class Request:
    """A sequence to generate: prompt + outputs so far + draft tokens awaiting verification.

    Progress is a single number, `num_computed_tokens`: tokens whose MLA KV and KDA state are
    valid. The scheduler gives a request `num_tokens_with_spec - num_computed_tokens` new tokens
    (capped by budgets) each step; there are no prefill/decode phases.

    n > 1: a request whose `sampling_params.n > 1` is a *fork parent*: it only prefills
    `prompt_len - 1` tokens, then the scheduler forks it into n child requests
    (`req_id = f"{parent_req_id}-{i}"`, `parent_req_id` / `sample_index` set) that share its KV.

    Block ids live in the KVCacheManager; `state_slot` mirrors the manager's slot for this
    request (None while it holds none) and is written only by the manager.
    """

    def __init__(
        self,
        req_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        eos_token_ids: Iterable[int] | int | None = None,
        arrival_time: float | None = None,
        parent_req_id: str | None = None,
        sample_index: int = 0,
        cache_salt: str | None = None,
        kv_transfer_params: dict | None = None,
    ) -> None:
        if not isinstance(req_id, str) or not req_id:
            raise ValueError(f"req_id must be a non-empty string, got {req_id!r}")
        prompt_token_ids = list(prompt_token_ids)
        if not prompt_token_ids:
            raise ValueError(f"request {req_id!r}: prompt_token_ids must not be empty")
        for tok in prompt_token_ids:
            if not isinstance(tok, int) or isinstance(tok, bool) or tok < 0:
                raise ValueError(
                    f"request {req_id!r}: prompt token ids must be ints >= 0, got {tok!r}")
        if not isinstance(sampling_params, SamplingParams):
            raise TypeError(
                f"request {req_id!r}: sampling_params must be SamplingParams, "
                f"got {type(sampling_params).__name__}")
        if cache_salt is not None and not isinstance(cache_salt, str):
            raise TypeError(f"request {req_id!r}: cache_salt must be a string, "
                            f"got {type(cache_salt).__name__}")

        self.req_id = req_id
        self.prompt_token_ids = prompt_token_ids
        self.sampling_params = sampling_params
        self.eos_token_ids: frozenset[int] = frozenset(
            [eos_token_ids] if isinstance(eos_token_ids, int) else eos_token_ids or ())
        self.arrival_time = time.time() if arrival_time is None else arrival_time
        self.parent_req_id = parent_req_id
        self.sample_index = sample_index
        self.cache_salt = cache_salt
        """Enters the first block's hash: requests with different salts never share a prefix."""
        self.kv_transfer_params = kv_transfer_params
        """The client's KV-transfer request (vLLM's kv_transfer_params): do_remote_decode on a
        prefill instance, the prefill's transfer parameters on a decode instance; read only
        by the KV connector."""
        self.block_hashes: list[bytes] = []
        """Chained hashes of the leading full blocks (extended by the KVCacheManager; tokens are
        only appended, so they stay valid across preemption)."""

        self.status = RequestStatus.WAITING
        self.output_token_ids: list[int] = []
        self._all_token_ids: list[int] = list(prompt_token_ids)
        self.spec_token_ids: list[int] = []
        """Draft tokens to verify next step (written by speculative decoding)."""
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0
        """Tokens served from the prefix cache at first schedule (KV and KDA state)."""
        self.state_slot: int | None = None
        self.stop_reason: int | str | None = None
        """The stop token id or stop string that finished the request (None for EOS/length)."""
        self.num_preemptions = 0
        self.num_output_placeholders = 0
        """Sampled tokens on their way from the worker (async scheduling: a step scheduled
        before the previous step's output arrived); each update_from_output that brings one
        takes one off."""

    # ---- sizes ----
    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self._all_token_ids)

    @property
    def num_tokens_with_spec(self) -> int:
        return len(self._all_token_ids) + len(self.spec_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        """Prompt + outputs (a live list: do not mutate)."""
        return self._all_token_ids

    @property
    def max_tokens(self) -> int | None:
        return self.sampling_params.max_tokens

    # ---- n > 1 ----
    @property
    def is_fork_parent(self) -> bool:
        return self.sampling_params.n > 1

    @property
    def num_samples(self) -> int:
        return self.sampling_params.n

    def child_req_id(self, index: int) -> str:
        return f"{self.req_id}-{index}"

    def make_child(self, index: int) -> Request:
        """Sample `index` of this parent: same prompt, n=1, seed + index when seeded."""
        params = self.sampling_params.clone()
        params.n = 1
        if params.seed is not None:
            params.seed += index
        return Request(self.child_req_id(index), self.prompt_token_ids, params,
                       eos_token_ids=self.eos_token_ids, arrival_time=self.arrival_time,
                       parent_req_id=self.req_id, sample_index=index,
                       cache_salt=self.cache_salt)

    # ---- status ----
    @property
    def finish_reason(self) -> str | None:
        """'stop', 'length', 'abort', or None while unfinished."""
        return _FINISH_REASONS.get(self.status)

    def append_output_token_ids(self, token_ids: int | list[int]) -> None:
        if isinstance(token_ids, int):
            token_ids = [token_ids]
        self.output_token_ids.extend(token_ids)
        self._all_token_ids.extend(token_ids)

    def __repr__(self) -> str:
        return (f"Request({self.req_id!r}, status={self.status.name}, "
                f"prompt={self.num_prompt_tokens}, output={self.num_output_tokens}, "
                f"computed={self.num_computed_tokens}, spec={len(self.spec_token_ids)})")
