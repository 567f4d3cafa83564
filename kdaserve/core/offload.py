"""The offload tier of the hybrid prefix cache, the scheduler's side: host memory, then disk.

What spills. A cached MLA block that the device pool hands out again (block_pool.py) and a ready
KDA checkpoint that the device pool evicts or loses with its blocks (checkpoint_pool.py) are
copied into a host slot (`OffloadOps.stores`: first thing of the step on the worker, so the copy
reads them before the step's copies, loads and forward reuse them). With a disk level every host
entry is then written to a file (write-through, once its host copy is done), so a host entry can
be dropped as soon as its file is written. Each level evicts least recently used first; a
full host level drops the store (the device cache behaves as without the tier).

Keys are the device caches' own: the chained block hash of a full block, the partial key of a
checkpoint (and of the KV of a position inside a block). On disk the files sit in a folder named
by the fingerprint of the model and the cache layout (offload_index.py).

Hits (KVCacheManager.find_prefix_hit): each leading block comes from the device, else from a
level here; the checkpoint at the hit position likewise; the hit is the deepest position that has
both (KV without a checkpoint is a miss). Entries only on disk are first read back into host slots
(`promote`: file jobs, the request waits outside the step); host entries are copied into the
request's new blocks and its state slot (`OffloadOps.loads`, after the step's block and state
copies, whose leading checkpoint exports may read a slot a load then overwrites).

Lifetimes. A host entry is *pending* from the step that stores it until the scheduler processes
that step's output (end_step): the device work is stream-ordered, so the next step may load it.
It is *pinned* while a file job reads or writes its slot: the job runs on every rank's writer
thread, and is done when every rank reports it (OffloadOutput, agreed over the ranks by the
workers); only then does a written entry enter the disk index (and its manifest) and the slot
become evictable. Entries a step loads from are locked until end_step. Only ready, unpinned,
unlocked entries are evicted.
"""

from __future__ import annotations

import heapq
import itertools
from collections import OrderedDict
from dataclasses import dataclass, field

from kdaserve.core.block_pool import BlockHash
from kdaserve.core.offload_index import CheckpointMeta, DiskEntry, DiskIndex
from kdaserve.core.sched_output import DiskJob, OffloadCopy, OffloadOps, OffloadOutput

KINDS = ("kv", "state")
"""Entry kinds: one MLA block over every MLA layer; one KDA state over every KDA layer."""


def host_tier_slots(size_bytes: int, kv_bytes: int, state_bytes: int,
                    blocks_per_checkpoint: int) -> dict[str, int]:
    """Host slots of each kind in size_bytes (one rank's bytes per entry), split the way the
    prefix cache produces them: one checkpoint per checkpoint interval of blocks."""
    unit = state_bytes + blocks_per_checkpoint * kv_bytes
    num_state = size_bytes // unit
    if num_state == 0:
        if size_bytes < state_bytes + kv_bytes:
            raise ValueError(f"kv_offload_size of {size_bytes} bytes per rank holds no KDA "
                             f"state ({state_bytes} bytes) and block ({kv_bytes} bytes)")
        num_state = 1
    return {"kv": (size_bytes - num_state * state_bytes) // kv_bytes, "state": num_state}


@dataclass
class TierEntry:
    kind: str
    key: BlockHash
    meta: CheckpointMeta | None = None
    """Where a checkpoint sits (kind "state")."""
    host_idx: int | None = None
    host_ready: bool = False
    """The host slot holds the bytes (False while its store or its file read is in flight)."""
    storing: bool = False
    """Its device -> host copy is in a step in flight."""
    pins: int = 0
    """File jobs in flight on the host slot."""
    from_disk: bool = False
    """The host copy was read back from disk (hits count as disk hits)."""
    dropped: bool = False
    """Left the index (reset) while pending or pinned: the slot frees when that ends."""


@dataclass
class OffloadStats:
    host_hit_tokens: int = 0
    """Prompt tokens of hits that used host entries (none read back from disk)."""
    disk_hit_tokens: int = 0
    """Prompt tokens of hits that used entries read back from disk."""
    bytes_stored: int = 0
    """Device -> host bytes (one rank's)."""
    bytes_loaded: int = 0
    """Host -> device bytes (one rank's)."""
    bytes_written: int = 0
    """Host -> disk bytes (one rank's)."""
    bytes_read: int = 0
    """Disk -> host bytes (one rank's)."""
    num_dropped_stores: int = 0
    """Evictions the host level had no free slot for (lost, as without the tier)."""
    num_failures: int = 0
    """File jobs that failed on some rank (a failed read drops the entry: a miss)."""
    disk_seconds: float = 0.0
    """Time in the finished file jobs (rank 0's writer thread)."""
    num_disk_jobs: int = 0
    """Writes and reads finished (over disk_seconds: the mean file job latency)."""


@dataclass
class _Job:
    job: DiskJob
    entry: TierEntry


class OffloadManager:
    def __init__(self, num_host_slots: dict[str, int], entry_bytes: dict[str, int],
                 disk_folder: str | None = None, disk_size: int = 0,
                 layout: dict | None = None) -> None:
        """num_host_slots / entry_bytes: per kind (one rank's bytes of one entry). disk_folder
        (the fingerprint's folder) and disk_size (bytes per rank): the disk level, if any."""
        self.entry_bytes = dict(entry_bytes)
        self.num_host_slots = dict(num_host_slots)
        self._free = {k: list(range(num_host_slots[k])) for k in KINDS}   # min-heaps
        self._host: dict[str, OrderedDict[BlockHash, TierEntry]] = {
            k: OrderedDict() for k in KINDS}
        """Entries holding a host slot, least recently used first."""
        self.disk = DiskIndex(disk_folder, layout or {}) if disk_folder else None
        self.disk_size = disk_size
        self._by_anchor: dict[BlockHash, set[BlockHash]] = {}
        """anchor -> checkpoint keys held here (host or disk)."""
        if self.disk is not None:
            for (kind, key), e in self.disk.entries.items():
                if kind == "state" and e.meta is not None:
                    self._by_anchor.setdefault(e.meta.anchor, set()).add(key)
            self._fit_disk()
        self._ops = OffloadOps()
        self._stored: list[TierEntry] = []
        """Host copies of the steps in flight (ready at end_step)."""
        self._jobs: dict[int, _Job] = {}
        self._job_ids = itertools.count()
        self._locked: set[tuple[str, BlockHash]] = set()
        self.stats = OffloadStats()

    # ---- lookup ----
    def source(self, kind: str, key: BlockHash) -> str | None:
        """"host" (loadable now), "disk" (a read back first), or None."""
        e = self._host[kind].get(key)
        if e is not None and e.host_ready:
            return "host"
        if self.disk is not None and self.disk.get(kind, key) is not None:
            return "disk"
        return None

    def checkpoint_meta(self, key: BlockHash) -> CheckpointMeta | None:
        e = self._host["state"].get(key)
        if e is not None:
            return e.meta
        d = self.disk.get("state", key) if self.disk is not None else None
        return d.meta if d is not None else None

    def partial_offsets(self, anchor: BlockHash) -> set[int]:
        """In-block offsets (> 0) of the checkpoints held here on this anchor."""
        offsets = set()
        for key in self._by_anchor.get(anchor, ()):
            meta = self.checkpoint_meta(key)
            if meta is not None and meta.offset and self.source("state", key) is not None:
                offsets.add(meta.offset)
        return offsets

    def from_disk(self, kind: str, key: BlockHash) -> bool:
        e = self._host[kind].get(key)
        return e is not None and e.from_disk

    # ---- device -> host ----
    def store(self, kind: str, key: BlockHash, device_idx: int,
              meta: CheckpointMeta | None = None) -> None:
        """The device is about to reuse block / slot device_idx that holds this entry: copy it
        to a host slot first, unless a level holds it already."""
        e = self._host[kind].get(key)
        if e is not None:
            self._host[kind].move_to_end(key)
            return
        if self.disk is not None and self.disk.get(kind, key) is not None:
            self.disk.touch(kind, key)
            return
        slot = self._take_slot(kind)
        if slot is None:
            self.stats.num_dropped_stores += 1
            return
        e = TierEntry(kind, key, meta, host_idx=slot, storing=True)
        self._host[kind][key] = e
        if meta is not None:
            self._by_anchor.setdefault(meta.anchor, set()).add(key)
        self._ops.stores.append(OffloadCopy(kind, device_idx, slot))
        self._stored.append(e)
        self.stats.bytes_stored += self.entry_bytes[kind]

    # ---- host -> device ----
    def lock(self, kind: str, key: BlockHash) -> None:
        """Keep a host entry until end_step (a load of this step reads it)."""
        if self.source(kind, key) != "host":
            raise RuntimeError(f"offload: cannot lock {kind} entry {key.hex()[:12]}: not in "
                               f"host memory")
        self._locked.add((kind, key))
        self._host[kind].move_to_end(key)
        if self.disk is not None:
            self.disk.touch(kind, key)

    def load(self, kind: str, key: BlockHash, device_idx: int) -> None:
        """Copy a (locked) host entry into device block / slot device_idx this step."""
        if (kind, key) not in self._locked:
            raise RuntimeError("offload: lock an entry before loading it")
        self._ops.loads.append(OffloadCopy(kind, device_idx, self._host[kind][key].host_idx))
        self.stats.bytes_loaded += self.entry_bytes[kind]

    def record_hit(self, num_tokens: int, used_disk: bool) -> None:
        if used_disk:
            self.stats.disk_hit_tokens += num_tokens
        else:
            self.stats.host_hit_tokens += num_tokens

    # ---- disk -> host ----
    def promote(self, items: list[tuple[str, BlockHash]]) -> bool:
        """Read entries held only on disk back into host slots (asynchronously). True when
        every item is in host memory or on its way; False when host slots ran out (the reads
        started stay in flight)."""
        for kind, key in items:
            e = self._host[kind].get(key)
            if e is not None:
                continue   # ready, or its store or read is in flight
            d = self.disk.get(kind, key) if self.disk is not None else None
            if d is None:
                continue   # gone meanwhile: the next lookup will not find it
            slot = self._take_slot(kind)
            if slot is None:
                return False
            e = TierEntry(kind, key, d.meta, host_idx=slot)
            self._host[kind][key] = e
            self._job("read", e)
        return True

    # ---- step boundaries ----
    def take_ops(self) -> OffloadOps | None:
        """This step's copies and file jobs (None when there are none)."""
        ops, self._ops = self._ops, OffloadOps()
        return None if ops.is_empty else ops

    def end_step(self) -> None:
        """A step's output was processed: its host copies are ready (and, with a disk level,
        written through), its load locks go."""
        stored, self._stored = self._stored, []
        for e in stored:
            e.storing = False
            if e.dropped:
                self._release(e)
                continue
            e.host_ready = True
            if self.disk is not None and self.disk.get(e.kind, e.key) is None:
                self._job("write", e)
        self._locked.clear()

    def update(self, output: OffloadOutput) -> None:
        """File jobs done (or failed) on every rank."""
        failed = set(output.failed)
        self.stats.disk_seconds += output.seconds
        self.stats.num_disk_jobs += len(output.done) + len(output.failed)
        for job_id in list(output.done) + list(output.failed):
            item = self._jobs.pop(job_id, None)
            if item is None:
                continue
            job, e = item.job, item.entry
            e.pins -= 1
            ok = job_id not in failed
            nbytes = self.entry_bytes[job.kind]
            if not ok:
                self.stats.num_failures += 1
            if job.op == "write":
                if ok:
                    self.stats.bytes_written += nbytes
                    if e.dropped:
                        self._delete_file(e.kind, e.key)
                    else:
                        self.disk.add(e.kind, e.key, DiskEntry(nbytes, e.meta))
                        self._fit_disk()
            elif job.op == "read":
                if ok and not e.dropped:
                    self.stats.bytes_read += nbytes
                    e.host_ready, e.from_disk = True, True
                    self._host[e.kind].move_to_end(e.key)
                elif not e.dropped:
                    # A file that cannot be read is dropped: the lookup misses from now on.
                    self._host[e.kind].pop(e.key, None)
                    e.dropped = True
                    self._drop_disk(e.kind, e.key)
                    self._forget_if_gone(e.kind, e.key, e.meta)
            if e.dropped:
                self._release(e)

    def stats_dict(self) -> dict:
        """The SchedulerStats fields of the tier."""
        st = self.stats
        return dict(
            offload_host_hit_tokens=st.host_hit_tokens,
            offload_disk_hit_tokens=st.disk_hit_tokens,
            offload_bytes_stored=st.bytes_stored, offload_bytes_loaded=st.bytes_loaded,
            offload_bytes_written=st.bytes_written, offload_bytes_read=st.bytes_read,
            offload_dropped_stores=st.num_dropped_stores, offload_failures=st.num_failures,
            offload_disk_seconds=st.disk_seconds, offload_disk_jobs=st.num_disk_jobs,
            num_offload_host_entries=sum(len(d) for d in self._host.values()),
            num_offload_disk_entries=len(self.disk.entries) if self.disk is not None else 0,
            offload_disk_bytes=self.disk.nbytes if self.disk is not None else 0)

    @property
    def busy(self) -> bool:
        """Ops to send or file jobs in flight: the engine keeps stepping for them."""
        return bool(self._jobs) or bool(self._stored) or not self._ops.is_empty

    def reset(self) -> None:
        """Forget every entry of both levels (their files are deleted)."""
        for kind in KINDS:
            for e in self._host[kind].values():
                e.dropped = True
                self._release(e)
            self._host[kind].clear()
        self._locked.clear()
        self._by_anchor.clear()
        if self.disk is not None:
            for kind, key in list(self.disk.entries):
                self._drop_disk(kind, key)

    def close(self) -> None:
        if self.disk is not None:
            self.disk.close()

    # ---- internals ----
    def _take_slot(self, kind: str) -> int | None:
        if self._free[kind]:
            return heapq.heappop(self._free[kind])
        for key, e in self._host[kind].items():
            if e.host_ready and e.pins == 0 and (kind, key) not in self._locked:
                del self._host[kind][key]
                self._forget_if_gone(kind, key, e.meta)
                return e.host_idx
        return None

    def _release(self, e: TierEntry) -> None:
        """Free a dropped entry's host slot once nothing is in flight on it."""
        if e.host_idx is not None and e.pins == 0 and not e.storing:
            heapq.heappush(self._free[e.kind], e.host_idx)
            e.host_idx = None

    def _job(self, op: str, e: TierEntry) -> None:
        job = DiskJob(next(self._job_ids), op, e.kind, e.key.hex(), e.host_idx)
        self._ops.disk_jobs.append(job)
        e.pins += 1
        self._jobs[job.job_id] = _Job(job, e)

    def _delete_file(self, kind: str, key: BlockHash) -> None:
        self._ops.disk_jobs.append(DiskJob(next(self._job_ids), "delete", kind, key.hex()))

    def _drop_disk(self, kind: str, key: BlockHash) -> None:
        d = self.disk.remove(kind, key)
        if d is not None:
            self._delete_file(kind, key)
            self._forget_if_gone(kind, key, d.meta)

    def _fit_disk(self) -> None:
        while self.disk.nbytes > self.disk_size and (oldest := self.disk.oldest()) is not None:
            self._drop_disk(*oldest)

    def _forget_if_gone(self, kind: str, key: BlockHash, meta: CheckpointMeta | None) -> None:
        """Unlist a checkpoint that neither level holds any more."""
        if kind != "state" or meta is None or key in self._host["state"]:
            return
        if self.disk is not None and self.disk.get("state", key) is not None:
            return
        keys = self._by_anchor.get(meta.anchor)
        if keys is not None:
            keys.discard(key)
            if not keys:
                del self._by_anchor[meta.anchor]
