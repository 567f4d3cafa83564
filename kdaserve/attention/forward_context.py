"""The forward context every layer gets, and its step plan: how one forward runs, decided once
per step by the model runner.

A plan fixes the execution mode (eager, one of the CUDA-graph families, or an eager step that
mixes prefill chunks with decode rows), whether the Triton kernels launch with programmatic
dependent launch, and the padded batch descriptor a graph is keyed by. Layers read the plan from
the ForwardContext; none of them decides the step's mode on its own or keeps a flag that changes
between steps.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from kdaserve.attention.metadata import AttentionMetadata, ModelCaches


def capture_sizes(max_num_seqs: int) -> list[int]:
    """The request counts CUDA graphs are captured at; a batch pads to the next one."""
    sizes = [1, 2, 4, 8] + list(range(16, 257, 16)) + list(range(288, 513, 32))
    return [s for s in sizes if s <= max_num_seqs] or [1]


class ExecMode(enum.Enum):
    EAGER = "eager"
    """Launched op by op: prefill-only steps, and steps no captured graph covers."""
    MIXED = "mixed"
    """Eager, prefill chunks next to decode or verification rows in one batch."""
    DECODE_GRAPH = "decode_graph"
    """A captured decode step: every row one token on its state."""
    VERIFY_GRAPH = "verify_graph"
    """A captured verification step: every row 1 + K tokens (last token + K drafts)."""
    DRAFT_GRAPH = "draft_graph"
    """A captured step of the draft model (one-token drafts, or the K+1-row catch-up)."""


@dataclass(frozen=True)
class BatchDescriptor:
    """The padded shape one CUDA graph is captured for, and the key it is found by."""

    mode: ExecMode
    num_reqs: int
    """Requests of the captured batch (the capture size the real batch is padded to)."""
    tokens_per_req: int = 1
    """1 for decode rows; 1 + K for verification and draft catch-up windows."""
    stage: str = "forward"
    """What the graph covers: "forward", or "commit" (a verification step's KDA state commit
    after sampling)."""

    @property
    def num_tokens(self) -> int:
        return self.num_reqs * self.tokens_per_req


@dataclass(frozen=True)
class StepPlan:
    mode: ExecMode
    pdl: bool = False
    """The Triton kernels launch with programmatic dependent launch (inside graphs only: each
    eager prefill shape would compile its own PDL variants, for no gain against eager launch
    overhead)."""
    decode_only: bool = False
    """Every row is one token on a non-empty state, with no verification rows and no prefix
    checkpoint exports: the one-launch KDA decode applies."""
    batch: BatchDescriptor | None = None
    """The padded batch of a graph mode (None for eager steps)."""

    @classmethod
    def eager(cls, md: AttentionMetadata) -> StepPlan:
        """The plan of an eager forward over `md`."""
        num_spec = md.spec.num_spec_reqs if md.spec is not None else 0
        return cls.eager_for(md.num_decodes, num_spec, md.num_reqs - md.num_decodes - num_spec,
                             md.kda_checkpoints is not None)

    @classmethod
    def eager_for(cls, num_decodes: int, num_spec: int, num_prefills: int,
                  exports: bool) -> StepPlan:
        """An eager step of num_decodes decode rows, num_spec verification rows and
        num_prefills prefill chunks; exports: KDA checkpoints are exported inside the pass."""
        kinds = (num_decodes > 0) + (num_spec > 0) + (num_prefills > 0)
        decode_only = num_decodes > 0 and kinds == 1 and not exports
        return cls(ExecMode.MIXED if kinds > 1 else ExecMode.EAGER, decode_only=decode_only)

    @classmethod
    def graph(cls, batch: BatchDescriptor, pdl: bool) -> StepPlan:
        """The plan a graph of `batch` is captured with (decode rows: the one-launch KDA
        decode applies)."""
        return cls(batch.mode, pdl=pdl, decode_only=batch.tokens_per_req == 1, batch=batch)


@dataclass
class ForwardContext:
    """Everything a layer needs besides its input: passed explicitly down the model."""

    attn: AttentionMetadata
    caches: ModelCaches
    plan: StepPlan | None = None
    """How this forward runs; None = the eager plan of `attn`."""

    def __post_init__(self) -> None:
        if self.plan is None:
            self.plan = StepPlan.eager(self.attn)
