"""The NIXL connector's worker side: one NIXL agent per rank over this rank's cache tensors.

Consumer: each load pulls (READ) the request's MLA blocks from the producer's rank 0 (latent KV
is replicated across TP ranks: one rank is its source) and the request's KDA recurrent + conv
state slot from the producer rank of the same index (KDA state is sharded by head). The first
contact with a producer rank is a handshake over its side channel (agent metadata and cache
layout, fetched off the step in a thread; layouts that cannot exchange state are refused with a
HandshakeError naming the difference). A READ carries a notification to the producer when it
completes. A load that fails, or is not done by its deadline, is cancelled and reported failed
(the request recomputes), and the producer is told to release its hold.

Producer: the scheduler tells this side which finished requests it holds; a held request is
done here when every consumer rank that reads from this rank has acknowledged (one per rank for
rank 0, the MLA source, else one), or its consumer released it over the side channel.
Acknowledgements may arrive before this side learns of the hold: they wait in `_early`.
"""

from __future__ import annotations

import atexit
import contextlib
import importlib
import logging
import time
import uuid
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from kdaserve.config import KVTransferConfig
from kdaserve.core.sched_output import KVConnectorOutput
from kdaserve.disagg.base import ConnectorWorker
from kdaserve.disagg.layout import CacheLayout, CacheRegion, HandshakeError
from kdaserve.disagg.nixl import side_channel
from kdaserve.disagg.nixl.metadata import LoadSpec, NixlConnectorMetadata
from kdaserve.disagg.params import RemoteRef

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

ACK_PREFIX = b"kdaserve-ack:"
SLOW_CALL_S = 0.25
"""A NIXL call on the step's thread taking this long is logged (_timed)."""
_NIXL_MODULES = ("nixl._api", "nixl_cu13", "nixl_cu12")


def import_nixl():
    """The NIXL Python API, whichever wheel provides it."""
    for name in _NIXL_MODULES:
        try:
            return importlib.import_module(name)
        except ImportError:
            continue
    raise RuntimeError("kv_connector NixlConnector needs NIXL: pip install nixl-cu12 (or "
                       "nixl-cu13 for CUDA 13)")


@dataclass
class _Remote:
    """One producer rank: its handshake, then its agent name and layout."""

    future: Future | None
    agent_name: Any = None
    layout: CacheLayout | None = None
    error: str | None = None


@dataclass
class _Load:
    spec: LoadSpec
    started: float
    ranks: list[int]
    """Producer ranks this rank reads from (0 for the MLA blocks; its own index for the state)."""
    posted: dict[int, Any] = field(default_factory=dict)
    """Producer rank -> the NIXL transfer handle of the READ from it."""
    nbytes: int = 0
    error: str | None = None
    """Set once failed; the load is reported when no transfer of it is left in flight."""


class NixlConnectorWorker(ConnectorWorker):
    def __init__(self, config: KVTransferConfig, block_size: int, tp_rank: int = 0,
                 tp_size: int = 1, clock: Callable[[], float] = time.monotonic) -> None:
        nixl = import_nixl()
        self.config = config
        self.block_size = block_size
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.clock = clock
        self.handshake_timeout_s = float(config.extra("handshake_timeout_s"))
        self.hold_s = float(config.extra("hold_timeout_s"))
        self.agent_name = f"{config.engine_id}-rank{tp_rank}-{uuid.uuid4().hex[:8]}"
        self.agent = nixl.nixl_agent(self.agent_name, nixl.nixl_agent_config(
            backends=list(config.extra("backends"))))
        self.layout: CacheLayout | None = None
        self.side_channel: side_channel.SideChannelServer | None = None
        self._pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="kdaserve-kv")
        self._remotes: dict[tuple[str, int], _Remote] = {}
        self._loads: dict[str, _Load] = {}
        self._serving: dict[str, list] = {}
        """Producer: held req id -> [hold deadline, acknowledgements still expected]."""
        self._early: dict[str, list] = {}
        """Producer: req id -> [first seen, acks, released] for news of a hold not known yet."""
        self._out = KVConnectorOutput()
        self._tensors: list[torch.Tensor] = []
        self._reg = None
        # NIXL crashes when an agent outlives the memory it registered (interpreter exit
        # frees in any order): tear down first.
        atexit.register(self.shutdown)

    # ------------------------------------------------------------------ set-up
    def register_caches(self, mla_kv: list[torch.Tensor], kda_recurrent: list[torch.Tensor],
                        kda_conv: list[torch.Tensor], num_blocks: int,
                        num_state_slots: int) -> None:
        tensors = list(mla_kv) + list(kda_recurrent) + list(kda_conv)
        dev = tensors[0].device
        self.layout = CacheLayout(
            self.config.engine_id, self.tp_rank, self.tp_size,
            "VRAM" if dev.type == "cuda" else "DRAM", dev.index or 0, self.block_size,
            CacheRegion.of(mla_kv, num_blocks), CacheRegion.of(kda_recurrent, num_state_slots),
            CacheRegion.of(kda_conv, num_state_slots))
        self._tensors = tensors   # registered: they must outlive the registration
        self._reg = self.agent.register_memory(tensors)
        if self.config.is_producer:
            port = self.config.kv_port + self.tp_rank if self.config.kv_port else 0
            self.side_channel = side_channel.SideChannelServer(
                self.config.kv_ip, port, {"layout": self.layout.to_dict(),
                                          "agent_metadata": self.agent.get_agent_metadata()})
            logger.info("KV side channel of rank %d on %s:%d (engine %s)", self.tp_rank,
                        self.config.kv_ip, self.side_channel.port, self.config.engine_id)

    @property
    def side_channel_port(self) -> int | None:
        return self.side_channel.port if self.side_channel is not None else None

    # ------------------------------------------------------------------ per step
    def start_step(self, metadata: NixlConnectorMetadata | None) -> None:
        if metadata is None:
            return
        for rid, deadline in metadata.holds.items():
            self._serving[rid] = [deadline, self.tp_size if self.tp_rank == 0 else 1]
            early = self._early.pop(rid, None)
            if early is not None:
                for _ in range(early[1]):
                    self._ack(rid)
                if early[2]:
                    self._ack(rid, release=True)
        for rid in metadata.unholds:
            self._serving.pop(rid, None)
        for ref in metadata.releases:
            self._release(ref)
        for spec in metadata.loads:
            self._begin_load(spec)

    def get_finished(self) -> KVConnectorOutput:
        self._poll()
        out, self._out = self._out, KVConnectorOutput()
        return out

    def wait_for_loads(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while self._loads:
            if time.monotonic() > deadline:
                return False
            self._poll()
            time.sleep(0.001)
        return True

    def shutdown(self) -> None:
        """In order: the side channel, the transfers, the peers, the registration, the agent
        (while the registered tensors are still alive)."""
        if self.agent is None:
            return
        if self.side_channel is not None:
            self.side_channel.close()
        for load in self._loads.values():
            for handle in load.posted.values():
                _release_handle(handle)
        self._loads.clear()
        self._pool.shutdown(wait=False, cancel_futures=True)
        for remote in self._remotes.values():
            if remote.layout is not None:
                try:
                    self.agent.remove_remote_agent(remote.agent_name)
                except Exception:  # noqa: BLE001 - already gone
                    pass
        self._remotes.clear()
        if self._reg is not None:
            self.agent.deregister_memory(self._reg)
            self._reg = None
        self.agent = None
        self._tensors = []

    # ------------------------------------------------------------------ consumer
    def _begin_load(self, spec: LoadSpec) -> None:
        ranks = sorted({0, self.tp_rank})
        load = _Load(spec, self.clock(), ranks)
        self._loads[spec.req_id] = load
        if spec.remote.tp_size != self.tp_size:
            self._fail(load, str(HandshakeError(
                f"engine {spec.remote.ref.engine_id!r} runs tensor_parallel_size="
                f"{spec.remote.tp_size}, this one {self.tp_size}: transfers between different "
                "TP sizes are not supported")))
            return
        for r in ranks:
            key = (spec.remote.ref.engine_id, r)
            remote = self._remotes.get(key)
            if remote is None or (remote.error is not None and remote.layout is None):
                ref = spec.remote.ref
                self._remotes[key] = _Remote(self._pool.submit(
                    side_channel.fetch_metadata, ref.host, ref.ports[r],
                    self.handshake_timeout_s))

    def _poll(self) -> None:
        for key, remote in self._remotes.items():
            if remote.future is not None and remote.future.done():
                self._finish_handshake(key, remote)
        for load in list(self._loads.values()):
            self._advance(load)
        if self.side_channel is not None:
            self._poll_notifications()

    def _finish_handshake(self, key: tuple[str, int], remote: _Remote) -> None:
        future, remote.future = remote.future, None
        try:
            meta = future.result()
            layout = CacheLayout.from_dict(meta["layout"])
            if layout.engine_id != key[0] or layout.tp_rank != key[1]:
                raise HandshakeError(f"the side channel of engine {key[0]!r} rank {key[1]} "
                                     f"answered as engine {layout.engine_id!r} rank "
                                     f"{layout.tp_rank}")
            self.layout.check_compatible(layout)
            remote.agent_name = self.agent.add_remote_agent(meta["agent_metadata"])
            remote.layout = layout
        except HandshakeError as e:
            remote.error = str(e)
            remote.layout = None
            logger.error("KV transfer handshake refused: %s", e)
        except Exception as e:  # noqa: BLE001 - unreachable producer: its loads recompute
            remote.error = f"handshake with engine {key[0]!r} rank {key[1]} failed: {e}"
            logger.warning("%s", remote.error)

    def _advance(self, load: _Load) -> None:
        rid = load.spec.req_id
        if load.error is None:
            for r in load.ranks:
                if r in load.posted:
                    continue
                remote = self._remotes[(load.spec.remote.ref.engine_id, r)]
                if remote.future is not None:
                    continue    # handshake in flight
                if remote.error is not None:
                    self._fail(load, remote.error)
                    break
                self._post(load, r, remote)
        states = {}
        for r, handle in load.posted.items():
            try:
                with self._timed("check_xfer_state", rid):
                    states[r] = self.agent.check_xfer_state(handle)
            except Exception as e:  # noqa: BLE001
                states[r] = "ERR"
                logger.warning("request %s: transfer state check failed: %s", rid, e)
        if load.error is None:
            if "ERR" in states.values():
                for r in load.ranks:
                    self._forget_remote(load.spec.remote.ref.engine_id, r)
                self._fail(load, "the transfer failed (producer gone?)")
            elif self.clock() >= load.spec.deadline:
                self._fail(load, "the transfer did not finish before its deadline")
        if load.error is not None:
            # cancel what is in flight; report once nothing can land in the blocks anymore
            for r, handle in list(load.posted.items()):
                if _release_handle(handle) or states.get(r) == "ERR":
                    del load.posted[r]
            if not load.posted:
                del self._loads[rid]
                self._out.failed_recving.add(rid)
                self._release(load.spec.remote.ref)
            return
        if len(states) == len(load.ranks) and all(s == "DONE" for s in states.values()):
            for handle in load.posted.values():
                _release_handle(handle)
            del self._loads[rid]
            self._out.finished_recving.add(rid)
            self._out.num_bytes_recved += load.nbytes
            self._out.recv_seconds += self.clock() - load.started

    def _post(self, load: _Load, r: int, remote: _Remote) -> None:
        spec = load.spec
        local, rl = self.layout, remote.layout
        rows_l, rows_r = [], []
        if r == 0:   # the MLA blocks: replicated, read from rank 0
            for layer in range(len(local.mla.bases)):
                for lb, rb in zip(spec.block_ids, spec.remote.block_ids):
                    rows_l.append((local.mla.address(layer, lb), local.mla.item_bytes))
                    rows_r.append((rl.mla.address(layer, rb), rl.mla.item_bytes))
        if r == self.tp_rank:   # this rank's shard of the KDA state
            for region, rregion in ((local.kda_recurrent, rl.kda_recurrent),
                                    (local.kda_conv, rl.kda_conv)):
                for layer in range(len(region.bases)):
                    rows_l.append((region.address(layer, spec.state_slot), region.item_bytes))
                    rows_r.append((rregion.address(layer, spec.remote.state_slot),
                                   rregion.item_bytes))
        try:
            descs_l, descs_r = _desc_pair(rows_l, rows_r, local.device_id, rl.device_id)
            local_descs = self.agent.get_xfer_descs(descs_l, local.mem_type)
            remote_descs = self.agent.get_xfer_descs(descs_r, rl.mem_type)
            with self._timed("initialize_xfer", spec.req_id, len(rows_l)):
                handle = self.agent.initialize_xfer(
                    "READ", local_descs, remote_descs, remote.agent_name,
                    ACK_PREFIX + spec.remote.ref.request_id.encode())
            load.posted[r] = handle
            with self._timed("transfer", spec.req_id, len(rows_l)):
                posted = self.agent.transfer(handle)
            if posted == "ERR":
                raise RuntimeError("posting the READ failed")
        except Exception as e:  # noqa: BLE001 - a gone producer raises here
            self._forget_remote(spec.remote.ref.engine_id, r)
            self._fail(load, f"the transfer could not start: {e}")
            return
        load.nbytes += sum(n for _, n in rows_l)

    @contextlib.contextmanager
    def _timed(self, call: str, req_id: str, num_descs: int | None = None):
        """Warn when one NIXL call holds the engine's step (they run on its thread): a READ
        the transport cannot serve by copy engine is progressed inside these calls."""
        t0 = time.monotonic()
        yield
        dt = time.monotonic() - t0
        if dt >= SLOW_CALL_S:
            logger.warning("request %s: NIXL %s took %.2f s%s", req_id, call, dt,
                           f" ({num_descs} descriptors)" if num_descs is not None else "")

    def _fail(self, load: _Load, reason: str) -> None:
        if load.error is None:
            load.error = reason
            logger.warning("request %s: loading its prompt state from engine %r failed (%s); "
                           "it recomputes the prompt", load.spec.req_id,
                           load.spec.remote.ref.engine_id, reason)

    def _forget_remote(self, engine_id: str, r: int) -> None:
        """Drop a producer rank whose transfers fail: the next load handshakes again."""
        remote = self._remotes.get((engine_id, r))
        if remote is None or remote.future is not None or remote.layout is None:
            return
        del self._remotes[(engine_id, r)]
        try:
            self.agent.remove_remote_agent(remote.agent_name)
        except Exception:  # noqa: BLE001 - already disconnected
            pass

    def _release(self, ref: RemoteRef) -> None:
        """Tell a producer (this rank's peer) it may free a held request; fire and forget."""
        if self.tp_rank >= len(ref.ports):
            return
        future = self._pool.submit(side_channel.send_release, ref.host,
                                   ref.ports[self.tp_rank], [ref.request_id],
                                   self.handshake_timeout_s)
        future.add_done_callback(lambda f: f.exception() and logger.info(
            "could not release request %s at engine %r: %s", ref.request_id, ref.engine_id,
            f.exception()))

    # ------------------------------------------------------------------ producer
    def _poll_notifications(self) -> None:
        for msgs in self.agent.get_new_notifs().values():
            for msg in msgs:
                if msg.startswith(ACK_PREFIX):
                    self._ack(msg[len(ACK_PREFIX):].decode(errors="replace"))
        for rid in self.side_channel.take_released():
            self._ack(rid, release=True)
        now = self.clock()
        for rid in [r for r, (deadline, _) in self._serving.items() if deadline <= now]:
            del self._serving[rid]   # the scheduler's hold expired as well
        for rid in [r for r, (seen, _, _) in self._early.items() if seen + self.hold_s <= now]:
            del self._early[rid]

    def _ack(self, rid: str, release: bool = False) -> None:
        entry = self._serving.get(rid)
        if entry is None:
            early = self._early.setdefault(rid, [self.clock(), 0, False])
            if release:
                early[2] = True
            else:
                early[1] += 1
            return
        entry[1] = 0 if release else entry[1] - 1
        if entry[1] <= 0:
            del self._serving[rid]
            self._out.finished_sending.add(rid)


def _desc_pair(local: list[tuple[int, int]], remote: list[tuple[int, int]], local_dev: int,
               remote_dev: int) -> tuple[np.ndarray, np.ndarray]:
    """Paired [N, 3] uint64 (address, length, device id) descriptor rows; a pair is merged into
    the previous one where both sides continue it (consecutive blocks on both ends)."""
    merged: list[list[int]] = []   # [local addr, remote addr, length]
    for (la, n), (ra, rn) in zip(local, remote, strict=True):
        if n != rn:
            raise HandshakeError(f"item sizes differ: {n} bytes here, {rn} remote")
        last = merged[-1] if merged else None
        if last is not None and last[0] + last[2] == la and last[1] + last[2] == ra:
            last[2] += n
        else:
            merged.append([la, ra, n])
    arr = np.array(merged, dtype=np.uint64).reshape(-1, 3)
    descs_l = np.stack([arr[:, 0], arr[:, 2], np.full(len(arr), local_dev, np.uint64)], 1)
    descs_r = np.stack([arr[:, 1], arr[:, 2], np.full(len(arr), remote_dev, np.uint64)], 1)
    return descs_l, descs_r


def _release_handle(handle: Any) -> bool:
    """Release a transfer handle (cancelling it if in flight); False if NIXL refused."""
    try:
        handle.release()
        return True
    except Exception:  # noqa: BLE001
        return False
