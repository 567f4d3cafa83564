"""The NIXL connector's scheduler side (pure Python: no NIXL here).

Consumer (decode): a request whose kv_transfer_params come from a remote prefill gets that
prefill's first token appended, then waits for its prompt's KV blocks and KDA state (one load,
started by the worker); if anything about the transfer cannot work (another prompt, n > 1,
logprobs, a grammar, an expired hold) it computes the prompt itself and the producer is told to
release its hold. A load's deadline is the consumer's load_timeout_s, capped at half the
producer's hold (measured from the request's arrival here), so a pull never reads blocks the
producer has freed for its timeout.

Producer (prefill): a request with do_remote_decode that finished after its one token keeps its
blocks and state slot until its consumer acknowledges the pull (a NIXL notification) or
releases it (side channel), or until hold_timeout_s passes.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from kdaserve.config import KVTransferConfig
from kdaserve.core.sched_output import KVConnectorOutput
from kdaserve.disagg.base import ConnectorScheduler
from kdaserve.disagg.nixl.metadata import LoadSpec, NixlConnectorMetadata
from kdaserve.disagg.params import RemotePrefill, prompt_hash

if TYPE_CHECKING:
    from kdaserve.request import Request

logger = logging.getLogger(__name__)

_HOLD_REASONS = ("stop", "length")
"""Finish reasons after which a request's state is worth holding (not an abort)."""


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class NixlConnectorScheduler(ConnectorScheduler):
    def __init__(self, config: KVTransferConfig, block_size: int, host: str,
                 ports: list[int], tp_size: int = 1,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self.block_size = block_size
        self.engine_id = config.engine_id
        self.host, self.ports, self.tp_size = host, list(ports), tp_size
        self.hold_s = float(config.extra("hold_timeout_s"))
        self.load_timeout_s = float(config.extra("load_timeout_s"))
        self.clock = clock
        self._remote: dict[str, tuple[RemotePrefill, float]] = {}
        """Consumer: requests that will load -> (params, load deadline)."""
        self._holds: dict[str, float] = {}
        """Producer: held request -> hold deadline."""
        self._meta = NixlConnectorMetadata()
        self._stats = {"kv_transfer_loads": 0, "kv_transfer_bytes": 0,
                       "kv_transfer_seconds": 0.0, "kv_transfer_failures": 0,
                       "kv_transfer_sends": 0, "kv_transfer_expired": 0}

    # ---------------------------------------------------------------- consumer
    def on_new_request(self, request: Request) -> int | None:
        params = request.kv_transfer_params
        if not (self.config.is_consumer and params and params.get("do_remote_prefill")):
            return None
        try:
            remote = RemotePrefill.from_params(params)
        except ValueError as e:
            logger.warning("request %s: ignoring its kv_transfer_params (%s); computing the "
                           "prompt here", request.req_id, e)
            return None
        reason = self._cannot_load(request, remote)
        if reason is not None:
            logger.info("request %s: computing the prompt here instead of pulling it (%s)",
                        request.req_id, reason)
            self._meta.releases.append(remote.ref)
            return None
        wait = min(self.load_timeout_s, remote.expires_in_s / 2)
        self._remote[request.req_id] = (remote, self.clock() + wait)
        return remote.first_token_id

    def _cannot_load(self, request: Request, remote: RemotePrefill) -> str | None:
        sp = request.sampling_params
        if remote.num_prompt_tokens != request.num_prompt_tokens:
            return (f"the prefill saw {remote.num_prompt_tokens} prompt tokens, this instance "
                    f"{request.num_prompt_tokens}")
        if remote.prompt_hash != prompt_hash(request.prompt_token_ids):
            return "the prefill tokenized another prompt"
        if len(remote.block_ids) != _cdiv(remote.num_prompt_tokens, self.block_size):
            return (f"{len(remote.block_ids)} remote blocks for {remote.num_prompt_tokens} "
                    f"tokens of block_size {self.block_size}")
        if request.num_samples != 1:
            return f"n={request.num_samples}"
        if sp.logprobs is not None:
            return "logprobs of the first token are not transferred"
        if sp.structured_outputs is not None:
            return "structured outputs"
        return None

    def get_num_new_matched_tokens(self, request: Request) -> int:
        entry = self._remote.get(request.req_id)
        if entry is None or request.num_computed_tokens:
            return 0
        remote, deadline = entry
        if self.clock() >= deadline:
            logger.warning("request %s: its remote prefill's hold is too old to pull; "
                           "computing the prompt here", request.req_id)
            del self._remote[request.req_id]
            self._meta.releases.append(remote.ref)
            self._stats["kv_transfer_failures"] += 1
            return 0
        return remote.num_prompt_tokens

    def update_state_after_alloc(self, request: Request, block_ids: list[int], state_slot: int,
                                 num_external_tokens: int) -> None:
        remote, deadline = self._remote.pop(request.req_id)
        n = len(remote.block_ids)
        if num_external_tokens != remote.num_prompt_tokens or len(block_ids) < n:
            raise RuntimeError(f"request {request.req_id!r}: {len(block_ids)} blocks for a "
                               f"load of {remote.num_prompt_tokens} tokens")
        self._meta.loads.append(LoadSpec(request.req_id, remote, list(block_ids[:n]),
                                         state_slot, deadline))

    # ---------------------------------------------------------------- producer
    def request_finished(self, request: Request, block_ids: list[int],
                         state_slot: int | None) -> tuple[bool, dict[str, Any] | None]:
        entry = self._remote.pop(request.req_id, None)
        if entry is not None:   # finished before its load began: the producer may free
            self._meta.releases.append(entry[0].ref)
        params = request.kv_transfer_params
        if not (self.config.is_producer and params and params.get("do_remote_decode")):
            return False, None
        if (request.finish_reason not in _HOLD_REASONS or request.num_samples != 1
                or request.num_output_tokens != 1 or state_slot is None
                or request.num_computed_tokens != request.num_prompt_tokens
                or len(block_ids) < _cdiv(request.num_prompt_tokens, self.block_size)):
            return False, None
        deadline = self.clock() + self.hold_s
        self._holds[request.req_id] = deadline
        self._meta.holds[request.req_id] = deadline
        n = _cdiv(request.num_prompt_tokens, self.block_size)
        return True, {
            "do_remote_prefill": True, "do_remote_decode": False,
            "remote_engine_id": self.engine_id, "remote_host": self.host,
            "remote_ports": list(self.ports), "remote_tp_size": self.tp_size,
            "remote_request_id": request.req_id, "remote_block_ids": list(block_ids[:n]),
            "remote_state_slot": state_slot, "num_prompt_tokens": request.num_prompt_tokens,
            "prompt_hash": prompt_hash(request.prompt_token_ids),
            "first_token_id": request.output_token_ids[0], "expires_in_s": self.hold_s}

    def take_expired(self) -> list[str]:
        now = self.clock()
        expired = [rid for rid, deadline in self._holds.items() if deadline <= now]
        for rid in expired:
            del self._holds[rid]
            logger.warning("request %s: no consumer pulled it in %.1f s; freeing its blocks "
                           "and state slot", rid, self.hold_s)
        self._meta.unholds.extend(expired)
        self._stats["kv_transfer_expired"] += len(expired)
        return expired

    # ---------------------------------------------------------------- both
    def build_connector_meta(self) -> NixlConnectorMetadata:
        meta, self._meta = self._meta, NixlConnectorMetadata()
        return meta

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        sent = [rid for rid in output.finished_sending if self._holds.pop(rid, None)]
        st = self._stats
        st["kv_transfer_sends"] += len(sent)
        st["kv_transfer_loads"] += len(output.finished_recving)
        st["kv_transfer_failures"] += len(output.failed_recving)
        st["kv_transfer_bytes"] += output.num_bytes_recved
        st["kv_transfer_seconds"] += output.recv_seconds

    def stats(self) -> dict[str, int | float]:
        return dict(self._stats)
