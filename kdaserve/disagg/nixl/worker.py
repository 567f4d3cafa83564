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

With host staging (kv_buffer_device "cpu", staging.py) a consumer rank first asks the producer
rank over the side channel to stage what it will read; the producer copies it into an extent
of its registered host buffer (on the side channel's thread, on a stream of its own: the held
blocks and slot are written already and nothing writes them while held) and answers with the
extent's address and a token. The READ lands in an extent of the consumer's host buffer, which
the consumer copies into its caches on the engine's stream before reporting the load; its
notification carries the token, which frees the producer's extent (a release or an expired
hold frees the request's extents as well, and any extent older than the hold timeout goes:
a stage answered after its consumer gave up).
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import importlib
import itertools
import logging
import threading
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
from kdaserve.disagg.nixl import side_channel, staging
from kdaserve.disagg.nixl.metadata import LoadSpec, NixlConnectorMetadata
from kdaserve.disagg.params import RemoteRef

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

ACK_PREFIX = b"kdaserve-ack:"
TOKEN_SEP = "\x1f"
"""Between the request id and the staged extent's token in an acknowledgement."""
STAGE_RETRY_S = 0.02
"""A stage answered "buffer full" (either side) is asked again after this long."""
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
    staged: dict[int, Any] = field(default_factory=dict)
    """Host staging: producer rank -> its stage answer, or the Future of the request for it."""
    extents: dict[int, int] = field(default_factory=dict)
    """Host staging: producer rank -> offset of the local extent its READ lands in."""
    retry_at: float = 0.0


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
        self._caches: tuple[list, list, list] = ([], [], [])
        self._buf: torch.Tensor | None = None
        """Host staging: the registered host buffer, its extents and the producer's copy
        stream; extents the producer staged (token -> (request id, offset, time)) and the
        consumer's extents waiting for their copies into the caches ((event, offsets))."""
        self._extents: staging.ExtentPool | None = None
        self._stage_stream = None
        self._staged_out: dict[int, tuple[str, int, float]] = {}
        self._staged_lock = threading.Lock()
        self._tokens = itertools.count(1)
        self._unloading: list[tuple[Any, list[int]]] = []
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
        self._caches = (list(mla_kv), list(kda_recurrent), list(kda_conv))
        if self.config.staged:
            import torch

            self.layout = dataclasses.replace(self.layout, mem_type="DRAM", device_id=0,
                                              staged=True)
            on_cuda = dev.type == "cuda"
            self._buf = staging.host_buffer(int(self.config.kv_buffer_size), pin=on_cuda)
            self._extents = staging.ExtentPool(self._buf.numel())
            if on_cuda:
                self._stage_stream = torch.cuda.Stream(dev)
            tensors = [self._buf]
        self._tensors = tensors   # registered: they must outlive the registration
        self._reg = self.agent.register_memory(tensors)
        if self.config.is_producer:
            port = self.config.kv_port + self.tp_rank if self.config.kv_port else 0
            self.side_channel = side_channel.SideChannelServer(
                self.config.kv_ip, port, {"layout": self.layout.to_dict(),
                                          "agent_metadata": self.agent.get_agent_metadata()},
                stage=self._stage if self.config.staged else None)
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
            if self._staged_out:
                self._free_staged(rid=rid)
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
        if self._unloading:
            self._free_unloaded()
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
                if self.config.staged:
                    self._post_staged(load, r, remote)
                    if load.error is not None:
                        break
                else:
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
                for off in load.extents.values():
                    self._extents.free(off)
                self._out.failed_recving.add(rid)
                self._release(load.spec.remote.ref)
            return
        if len(states) == len(load.ranks) and all(s == "DONE" for s in states.values()):
            for handle in load.posted.values():
                _release_handle(handle)
            if load.extents:
                self._unstage(load)
            del self._loads[rid]
            self._out.finished_recving.add(rid)
            self._out.num_bytes_recved += load.nbytes
            self._out.recv_seconds += self.clock() - load.started

    # ------------------------------------------------------------------ host staging
    def _parts(self, r: int, block_ids, state_slot) -> list[staging.Part]:
        """What this side's extent for producer rank r holds: the MLA blocks from rank 0,
        the state slot from this rank's peer."""
        mla, rec, conv = self._caches
        return staging.extent_parts(mla, rec, conv, list(block_ids) if r == 0 else None,
                                    state_slot if r == self.tp_rank else None)

    def _post_staged(self, load: _Load, r: int, remote: _Remote) -> None:
        """Ask producer rank r to stage (once its answer is in), then READ its extent into a
        local one; a full buffer on either side is asked again shortly."""
        spec = load.spec
        if self.clock() < load.retry_at:
            return
        answer = load.staged.get(r)
        if answer is None:
            msg = {"rid": spec.remote.ref.request_id,
                   "blocks": list(spec.remote.block_ids) if r == 0 else None,
                   "slot": spec.remote.state_slot if r == self.tp_rank else None}
            load.staged[r] = self._pool.submit(side_channel.request_stage, spec.remote.ref.host,
                                               spec.remote.ref.ports[r], msg,
                                               self.handshake_timeout_s)
            return
        if isinstance(answer, Future):
            if not answer.done():
                return
            try:
                answer = load.staged[r] = answer.result()
            except Exception as e:  # noqa: BLE001 - a gone producer
                self._fail(load, f"staging at the producer failed: {e}")
                return
        if "error" in answer:
            if answer.get("retry"):
                del load.staged[r]
                load.retry_at = self.clock() + STAGE_RETRY_S
            else:
                self._fail(load, f"the producer could not stage the request: {answer['error']}")
            return
        parts = self._parts(r, spec.block_ids, spec.state_slot)
        nbytes = staging.extent_bytes(parts)
        if nbytes != answer["nbytes"]:
            self._fail(load, f"the producer staged {answer['nbytes']} bytes, this side expects "
                             f"{nbytes}")
            return
        off = load.extents.get(r)
        if off is None:
            off = self._extents.alloc(nbytes)
            if off is None:
                if nbytes > self._extents.nbytes:
                    self._fail(load, f"its state needs {nbytes} bytes, more than "
                                     f"kv_buffer_size ({self._extents.nbytes})")
                else:
                    load.retry_at = self.clock() + STAGE_RETRY_S
                return
            load.extents[r] = off
        self._read(load, r, remote, [(self._buf.data_ptr() + off, nbytes)],
                   [(answer["addr"], nbytes)], (0, "DRAM"), (0, "DRAM"),
                   f"{TOKEN_SEP}{answer['token']}")

    def _unstage(self, load: _Load) -> None:
        """Copy a finished load's extents into the caches on the current stream; the extents
        are freed once the copies are done (at once on the CPU)."""
        for r, off in load.extents.items():
            staging.scatter(self._parts(r, load.spec.block_ids, load.spec.state_slot),
                            self._buf, off)
        event = None
        if self._stage_stream is not None:
            import torch

            event = torch.cuda.Event()
            event.record()
        self._unloading.append((event, list(load.extents.values())))
        load.extents = {}
        self._free_unloaded()

    def _free_unloaded(self) -> None:
        keep = []
        for event, offs in self._unloading:
            if event is None or event.query():
                for off in offs:
                    self._extents.free(off)
            else:
                keep.append((event, offs))
        self._unloading = keep

    def _stage(self, msg: dict[str, Any]) -> dict[str, Any]:
        """Producer, on the side channel's thread: copy what a consumer rank will read into
        an extent of the host buffer."""
        try:
            rid = str(msg["rid"])
            blocks, slot = msg.get("blocks"), msg.get("slot")
            lay = self.layout
            if blocks is not None and not all(
                    isinstance(b, int) and 0 <= b < lay.mla.num_items for b in blocks):
                return {"error": f"block ids outside [0, {lay.mla.num_items})"}
            if slot is not None and not (isinstance(slot, int)
                                         and 0 <= slot < lay.kda_recurrent.num_items):
                return {"error": f"state slot outside [0, {lay.kda_recurrent.num_items})"}
            mla, rec, conv = self._caches
            parts = staging.extent_parts(mla, rec, conv, blocks, slot)
            nbytes = staging.extent_bytes(parts)
            if nbytes > self._extents.nbytes:
                return {"error": f"the request's state is {nbytes} bytes, more than "
                                 f"kv_buffer_size ({self._extents.nbytes})"}
            off = self._extents.alloc(nbytes)
            if off is None:
                return {"error": "the host buffer is full", "retry": True}
            if self._stage_stream is not None:
                import torch

                with torch.cuda.stream(self._stage_stream):
                    staging.gather(parts, self._buf, off)
                self._stage_stream.synchronize()
            else:
                staging.gather(parts, self._buf, off)
            token = next(self._tokens)
            with self._staged_lock:
                self._staged_out[token] = (rid, off, self.clock())
            return {"addr": self._buf.data_ptr() + off, "nbytes": nbytes, "token": token}
        except Exception as e:  # noqa: BLE001 - answered, not raised, on the channel's thread
            logger.exception("staging a request for a consumer failed")
            return {"error": f"staging failed: {e}"}

    def _free_staged(self, token: int | None = None, rid: str | None = None,
                     older_than: float | None = None) -> None:
        """Free the producer's extents: one token's, a request's, or those staged before a
        time (their consumer is gone)."""
        with self._staged_lock:
            doomed = [t for t, (r, _, at) in self._staged_out.items()
                      if t == token or r == rid or (older_than is not None and at < older_than)]
            offs = [self._staged_out.pop(t)[1] for t in doomed]
        for off in offs:
            self._extents.free(off)

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
        self._read(load, r, remote, rows_l, rows_r, (local.device_id, local.mem_type),
                   (rl.device_id, rl.mem_type))

    def _read(self, load: _Load, r: int, remote: _Remote, rows_l: list[tuple[int, int]],
              rows_r: list[tuple[int, int]], where_l: tuple[int, str],
              where_r: tuple[int, str], ack_suffix: str = "") -> None:
        """Post one READ of (address, length) rows from producer rank r, (device id, memory
        type) on each side; its notification acknowledges the request (+ ack_suffix)."""
        spec = load.spec
        try:
            descs_l, descs_r = _desc_pair(rows_l, rows_r, where_l[0], where_r[0])
            local_descs = self.agent.get_xfer_descs(descs_l, where_l[1])
            remote_descs = self.agent.get_xfer_descs(descs_r, where_r[1])
            notif = ACK_PREFIX + (spec.remote.ref.request_id + ack_suffix).encode()
            with self._timed("initialize_xfer", spec.req_id, len(rows_l)):
                handle = self.agent.initialize_xfer("READ", local_descs, remote_descs,
                                                    remote.agent_name, notif)
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
                    rid, _, token = msg[len(ACK_PREFIX):].decode(errors="replace").partition(
                        TOKEN_SEP)
                    if token.isdigit():
                        self._free_staged(token=int(token))
                    self._ack(rid)
        for rid in self.side_channel.take_released():
            self._free_staged(rid=rid)
            self._ack(rid, release=True)
        now = self.clock()
        for rid in [r for r, (deadline, _) in self._serving.items() if deadline <= now]:
            del self._serving[rid]   # the scheduler's hold expired as well
            self._free_staged(rid=rid)
        for rid in [r for r, (seen, _, _) in self._early.items() if seen + self.hold_s <= now]:
            del self._early[rid]
        if self._staged_out:
            self._free_staged(older_than=now - self.hold_s)

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
