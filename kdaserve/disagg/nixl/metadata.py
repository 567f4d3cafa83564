"""The NIXL connector's per-step metadata, scheduler side -> worker side (same process)."""

from __future__ import annotations

from dataclasses import dataclass, field

from kdaserve.disagg.params import RemotePrefill, RemoteRef


@dataclass
class LoadSpec:
    """Pull one request's prompt state into local blocks and a local state slot."""

    req_id: str
    remote: RemotePrefill
    block_ids: list[int]
    """Local blocks for the remote's, pairwise (cdiv(num_prompt_tokens, block_size) of them)."""
    state_slot: int
    deadline: float
    """time.monotonic() after which the load is given up (and the prompt recomputed)."""


@dataclass
class NixlConnectorMetadata:
    loads: list[LoadSpec] = field(default_factory=list)
    holds: dict[str, float] = field(default_factory=dict)
    """Producer: requests now held for a remote reader -> their hold deadline (monotonic)."""
    unholds: list[str] = field(default_factory=list)
    """Producer: holds that expired (the scheduler freed them)."""
    releases: list[RemoteRef] = field(default_factory=list)
    """Consumer: remote holds this instance will never pull (tell the producer to free)."""

    @property
    def is_empty(self) -> bool:
        return not (self.loads or self.holds or self.unholds or self.releases)
