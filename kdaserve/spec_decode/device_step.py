"""What a drafter that proposes on the device (async scheduling) gets from one target step.

The host knows the step's layout (rows, query lengths, an upper bound of each row's start:
while a previous step is in flight the scheduler counts its drafts as accepted) but not what
the rejection sampler accepted; the device knows the rest. A drafter's `propose_device(step)`
consumes the positions the step verified and returns K drafts per sampling row, on the device,
with fixed shapes (no host read of a device value).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class DeviceStep:
    req_ids: list[str | None]
    """Batch rows' requests (None: not drafted for, e.g. penalties: nothing is kept)."""
    token_ids: list[list[int]]
    """Per batch row, the tokens the host knows (prompt + collected outputs)."""
    num_computed: list[int]
    """Per batch row, the host's start: exact, or an upper bound while a step is in flight."""
    query_lens: list[int]
    start: torch.Tensor
    """[N] int64 (device): the true starts."""
    verified: torch.Tensor
    """[N] int64 (device): leading tokens of each row whose target state is final (the query
    length; 1 + accepted drafts on a spec row)."""
    aux: torch.Tensor | None
    """[T, W] the target's hidden / aux rows of the step (hidden-conditioned drafters)."""
    sample_rows: list[int]
    """Batch rows to draft for (S of them)."""
    emitted: torch.Tensor
    """[S, W'] int64 (device): the tokens each emitted this step, left-aligned (garbage past
    num_emitted)."""
    num_emitted: torch.Tensor
    """[S] int64 (device), >= 1."""
    temperatures: list[float]
    """[S] the rows' temperatures (0: greedy)."""
    input_ids: torch.Tensor | None = None
    """[T] int64 (device): the step's input ids."""
    is_spec: list[bool] | None = None
    """Per batch row: it verified drafts (its verified count is known on the device only)."""
    verify_size: int | None = None
    """The capture size of the verification graph the step replayed (None: no replay); aux
    is then that graph's static output."""

    @property
    def last(self) -> torch.Tensor:
        """[S] each sampling row's last emitted token (the next window's first)."""
        return self.emitted.gather(1, (self.num_emitted - 1)[:, None]).squeeze(1)
