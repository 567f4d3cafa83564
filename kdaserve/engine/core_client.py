# SPDX-License-Identifier: Apache-2.0
"""The wire protocol between the front (API server process) and the engine-core process
(ZMQ PUSH/PULL + msgspec).

The core sends token-level progress only: per request and step the new token ids, their
logprobs and the scheduler's finish reason. Text, stop strings and the cumulative outputs are
the front's (OutputProcessor), so no message grows with the output length and the core never
detokenizes.

Front (API server process)                     Core process
  AddRequest / AbortRequests / GetStats  --->  PULL  (input_addr)
  PULL (output_addr)                     <---  Ready / StartupFailed / Outputs / RequestFailed /
                                               Stats / CoreFailed
"""

from __future__ import annotations

import dataclasses
from typing import Any

import msgspec

from kdaserve.outputs import Logprob
from kdaserve.sampling_params import SamplingParams

# ----------------------------------------------------------------------------- front -> core


class AddRequest(msgspec.Struct, tag=True):
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: dict[str, Any]
    """core_sampling_params(params): without the front's text fields."""
    arrival_time: float
    eos_token_ids: list[int]
    """The model's EOS ids and the front's tokenizer's (the core has no tokenizer)."""
    cache_salt: str | None = None
    kv_transfer_params: dict[str, Any] | None = None
    """The client's KV-transfer request (prefill/decode disaggregation)."""


class AbortRequests(msgspec.Struct, tag=True):
    request_ids: list[str]
    """Requests the front added, or (stopped) the core ids of samples a stop string ended."""
    stopped: bool = False
    """A stop string finished them: the core finishes them as stopped, not aborted (a
    turn-end prefix checkpoint then keeps their final state)."""


class GetStats(msgspec.Struct, tag=True):
    nonce: int


class Shutdown(msgspec.Struct, tag=True):
    pass


InputMessage = AddRequest | AbortRequests | GetStats | Shutdown


_FRONT_ONLY_PARAMS = ("stop", "include_stop_str_in_output", "skip_special_tokens")


def core_sampling_params(params: SamplingParams) -> dict[str, Any]:
    """SamplingParams as the core needs them: stop strings and detokenization stay in front."""
    return {k: v for k, v in dataclasses.asdict(params).items() if k not in _FRONT_ONLY_PARAMS}


# ----------------------------------------------------------------------------- core -> front


class CoreOutput(msgspec.Struct, array_like=True):
    """kdaserve.core.engine_output.EngineCoreOutput on the wire (the same fields and meaning;
    typed here so that logprobs decode as Logprob)."""

    req_id: str
    new_token_ids: list[int]
    new_logprobs: list[dict[int, Logprob]] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    parent_req_id: str | None = None
    sample_index: int = 0
    kv_transfer_params: dict[str, Any] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class Ready(msgspec.Struct, tag=True):
    info: dict[str, Any]


class StartupFailed(msgspec.Struct, tag=True):
    message: str


class Outputs(msgspec.Struct, tag=True):
    outputs: list[CoreOutput]


class RequestFailed(msgspec.Struct, tag=True):
    request_id: str
    message: str
    bad_request: bool
    """True for a ValueError from add_request (the client's fault: HTTP 400)."""


class Stats(msgspec.Struct, tag=True):
    nonce: int
    stats: dict[str, Any]


class CoreFailed(msgspec.Struct, tag=True):
    message: str
    request_ids: list[str]


OutputMessage = Ready | StartupFailed | Outputs | RequestFailed | Stats | CoreFailed
