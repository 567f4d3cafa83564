"""The runner's per-request state and one step's flattened batch, on the host."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch

from kdaserve.core.sched_output import ModelRunnerOutput
from kdaserve.sample.sampler import SamplerOutput
from kdaserve.sampling_params import SamplingParams

if TYPE_CHECKING:
    from kdaserve.worker.spec_async import CarryRows


@dataclass
class CachedRequestState:
    req_id: str
    token_ids: list[int]
    """Prompt + outputs known to the worker."""
    num_prompt_tokens: int
    sampling_params: SamplingParams
    block_ids: list[int]
    state_slot: int
    num_computed_tokens: int
    block_np: np.ndarray = field(default=None, repr=False)
    """block_ids as int32 with spare capacity: rows of the graph block table copy from it."""
    num_pending: int = 0
    """Tokens sampled by launched steps and not yet collected (not in token_ids yet); under
    speculation with device drafts: launched sampling steps not yet collected."""
    last_num_drafts: int = 0
    """Drafts the last launched sampling step verified for it (device drafts: a carry row
    of the next step needs its positions fixed on the device when this is > 0)."""

    def __post_init__(self) -> None:
        self.block_np = np.empty(max(16, 2 * len(self.block_ids)), dtype=np.int32)
        self.block_np[:len(self.block_ids)] = self.block_ids

    def add_blocks(self, new_blocks: list[int]) -> None:
        n = len(self.block_ids)
        self.block_ids.extend(new_blocks)
        if len(self.block_ids) > len(self.block_np):
            grown = np.empty(2 * len(self.block_ids), dtype=np.int32)
            grown[:n] = self.block_np[:n]
            self.block_np = grown
        self.block_np[n:len(self.block_ids)] = new_blocks


@dataclass
class StepBatch:
    """One step's flattened batch on the host, requests ordered decodes first."""

    req_ids: list[str]
    input_ids: list[int]
    query_lens: list[int]
    num_computed: list[int]
    sample_rows: list[int]
    """Indices (into req_ids) of requests that sample a token this step."""
    drafts: list[list[int]] = field(default_factory=list)
    """Per request, the draft tokens it verifies ([] for non-spec rows)."""
    pending_inputs: list[tuple[int, str]] = field(default_factory=list)
    """(position in input_ids, req_id) of decode inputs that the previous launched step sampled
    and the host has not seen yet: they are copied on the device from its sampled ids."""
    carry: "CarryRows | None" = None
    """Device drafts (worker/spec_async.py): rows whose window the step in flight makes."""

    @property
    def has_spec(self) -> bool:
        return any(self.drafts)


@dataclass
class LaunchedStep:
    """A step queued on the device; ModelRunner.collect turns it into its ModelRunnerOutput.

    Either `output` is already final (steps that need the host in the loop: speculative
    decoding, penalties, steps that sample nothing), or the sampled ids are on their way into
    pinned host memory and `done` fires when they are there."""

    output: ModelRunnerOutput | None = None
    batch: StepBatch | None = None
    states: list[CachedRequestState] = field(default_factory=list)
    host: SamplerOutput | None = None
    """The sampler's output in host memory (filled once `done` has fired)."""
    done: torch.cuda.Event | None = None
    spec: "DeviceSpecStep | None" = None
    """Device drafts: the rejection sampler's output and the proposal, on their way to the
    host (None: a plain sampling step, or one at a time)."""


@dataclass
class DeviceSpecStep:
    """A launched step's speculative results in host memory once `LaunchedStep.done` fired."""

    output_token_ids: torch.Tensor | None = None
    """[S, Kmax + 1] rejection sampler output (None: the plain sampler ran)."""
    sampler_out: object = None
    """The RejectionSamplerOutput with its host tensors (logprobs), or None."""
    spec_md: object = None
    drafts: list[list[int]] = field(default_factory=list)
    """Per sampling row, the drafts it verified (placeholders for carry rows)."""
    proposed_rows: list[int] = field(default_factory=list)
    """Sampling rows drafted for..."""
    proposal: torch.Tensor | None = None
    """...and their drafts [S', K] (host)."""
