"""The connector interface: a scheduler side and a worker side.

A request's state after its prompt is its KDA recurrent + conv state (one state slot, every KDA
layer) plus its MLA latent-KV blocks (every MLA layer). A connector moves exactly that.

Scheduler side (called by core/scheduler.py, in the scheduler's process):
- consumer: `on_new_request` (a request that arrives with a remote prefill's transfer
  parameters gets that prefill's first sampled token), `get_num_new_matched_tokens` (prompt
  tokens a remote source supplies, loaded asynchronously), `update_state_after_alloc` (the local
  blocks and state slot the load writes into);
- producer: `request_finished` (hold the blocks and slot for a remote reader? and the transfer
  parameters returned to the client), `take_expired` (holds past their timeout);
- both: `build_connector_meta` (the step's metadata for the workers, put into the
  SchedulerOutput) and `update_connector_output` (the workers' report, for the stats).

Worker side (one per rank, called by worker/worker.py): `register_caches` (this rank's cache
tensors), `start_step` (apply the step's metadata: start loads, note holds, send releases),
`get_finished` (finished sends, finished and failed loads), `wait_for_loads` (block until the
loads in flight end), `shutdown`.

A load completes before its request is scheduled (the scheduler only schedules it once the
worker reported it), so there are no per-layer load / save hooks: a pulling connector needs no
save step, and nothing waits inside a forward.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any

from kdaserve.core.sched_output import KVConnectorOutput

if TYPE_CHECKING:
    import torch

    from kdaserve.request import Request


class ConnectorScheduler(ABC):
    # ---- consumer ----
    @abstractmethod
    def on_new_request(self, request: Request) -> int | None:
        """A request was added. Returns the first token its remote prefill sampled when its
        prompt's state will be loaded (the scheduler appends it as the first output), else
        None (the request computes its prompt itself)."""

    @abstractmethod
    def get_num_new_matched_tokens(self, request: Request) -> int:
        """Prompt tokens a remote source can supply for a waiting request that holds nothing
        (0: none). They arrive asynchronously: the request waits until the worker reports its
        load (KVConnectorOutput.finished_recving / failed_recving)."""

    @abstractmethod
    def update_state_after_alloc(self, request: Request, block_ids: list[int], state_slot: int,
                                 num_external_tokens: int) -> None:
        """The blocks (covering the external tokens, in position order) and the state slot
        the load writes into; it goes out in the next build_connector_meta."""

    # ---- producer ----
    @abstractmethod
    def request_finished(self, request: Request, block_ids: list[int],
                         state_slot: int | None) -> tuple[bool, dict[str, Any] | None]:
        """A request finished (any reason). Returns (hold, kv_transfer_params): hold=True
        keeps its blocks and slot allocated until the workers report it in finished_sending or
        take_expired returns it; kv_transfer_params go back to the client."""

    @abstractmethod
    def take_expired(self) -> list[str]:
        """Held requests whose hold timed out (the scheduler frees them)."""

    # ---- both ----
    @abstractmethod
    def build_connector_meta(self) -> Any:
        """The step's metadata for the workers (SchedulerOutput.kv_connector_metadata)."""

    @abstractmethod
    def update_connector_output(self, output: KVConnectorOutput) -> None:
        """The workers' report of a step (after the scheduler applied it)."""

    @abstractmethod
    def stats(self) -> dict[str, int | float]:
        """Totals since start-up, by SchedulerStats field name (kv_transfer_*)."""


class ConnectorWorker(ABC):
    @abstractmethod
    def register_caches(self, mla_kv: list[torch.Tensor], kda_recurrent: list[torch.Tensor],
                        kda_conv: list[torch.Tensor], num_blocks: int,
                        num_state_slots: int) -> None:
        """This rank's caches: per MLA layer [num_blocks, block_size, kv_dim]; per KDA layer
        the recurrent [rows, H, K, V] and conv [rows, C, W - 1] state, whose first
        num_state_slots rows are the request slots."""

    @abstractmethod
    def start_step(self, metadata: Any) -> None:
        """Apply a step's metadata (before its forward): start its loads, note its holds."""

    @abstractmethod
    def get_finished(self) -> KVConnectorOutput:
        """What finished since the last call (polls the transfers; never blocks)."""

    @abstractmethod
    def wait_for_loads(self, timeout: float) -> bool:
        """Block until every load in flight has ended (True) or the timeout passed (False)."""

    @abstractmethod
    def shutdown(self) -> None:
        """Stop the side channel and release the transfer agent."""
