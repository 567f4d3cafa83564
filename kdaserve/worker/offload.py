"""The offload tier's worker side (one rank's): host slots mirroring the device caches, and the
disk files (kdaserve/core/offload.py is the scheduler's side, which decides everything).

Host memory, pinned on CUDA: per MLA layer [num_kv_slots, block_size, kv_dim]; per KDA layer
recurrent [num_state_slots, H / tp, K, V] fp32 and conv [num_state_slots, 3 H / tp K, W - 1]:
the device caches' rows. A store or a load moves rows per layer, issued on the current stream
(non_blocking between pinned memory and the device), ordered with the step's forward. Host
slots of a prefix are mostly consecutive (taken in order from the free list) while its device
blocks are scattered, so the rows cross the bus once per run of consecutive host slots, through
a device staging buffer that one gather (store) or scatter (load) kernel per layer fills from or
empties into the scattered device rows; copies whose device rows run on with their host slots
skip the staging.

Files: one per entry and rank (<folder>/rank<r>/<kind>-<key>.bin), every layer's row back to
back as raw bytes, written and read by one thread in job order. A job first waits for the device
work issued before it was submitted (a CUDA event), so that a write reads a finished store and a
read never overwrites a slot that a load in flight still reads.

Completion: a job is done when every rank has finished it. The ranks get the same jobs in the
same steps, so their lists of jobs in flight are equal; one all-reduce (MIN) over the world group
of the jobs' states (0 running, 1 failed, 2 done) makes them agree on which are finished, and
every rank drops the same ones.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from dataclasses import dataclass

import torch

from kdaserve.attention.metadata import ModelCaches
from kdaserve.core.offload_index import entry_filename
from kdaserve.core.sched_output import DiskJob, OffloadCopy, OffloadOutput
from kdaserve.distributed.comm import GroupComm

logger = logging.getLogger(__name__)

_RUNNING, _FAILED, _DONE = 0, 1, 2


class OffloadWorker:
    def __init__(self, caches: ModelCaches, num_slots: dict[str, int], folder: str | None,
                 rank: int = 0, world: GroupComm | None = None,
                 device: torch.device | str = "cpu") -> None:
        """num_slots: host slots per kind ("kv", "state"); folder: the disk level's folder (the
        layout fingerprint's), None without one; world: the group the ranks agree over."""
        self.device = torch.device(device)
        pin = self.device.type == "cuda"

        def host_like(t: torch.Tensor, n: int) -> torch.Tensor:
            return torch.empty((n,) + tuple(t.shape[1:]), dtype=t.dtype, pin_memory=pin)

        self.device_rows = {"kv": list(caches.mla_kv),
                            "state": list(caches.kda_recurrent) + list(caches.kda_conv)}
        self.host = {kind: [host_like(t, num_slots[kind]) for t in tensors]
                     for kind, tensors in self.device_rows.items()}
        self.world = world or GroupComm.single()
        self.folder = os.path.join(folder, f"rank{rank}") if folder is not None else None
        if self.folder is not None:
            os.makedirs(self.folder, exist_ok=True)
        self._in_flight: list[int] = []
        """File jobs submitted and not yet reported finished (same list on every rank)."""
        self._state: dict[int, tuple[int, float]] = {}
        """job id -> (state, seconds) once this rank's thread ran it."""
        self._lock = threading.Lock()
        self._queue: queue.Queue = queue.Queue()
        self._thread: threading.Thread | None = None

    @property
    def nbytes(self) -> dict[str, int]:
        """Host bytes of one entry of each kind."""
        return {kind: sum(t[0].numel() * t.element_size() for t in ts)
                for kind, ts in self.host.items()}

    # ---- copies (the model runner calls these around the step's block and state copies) ----
    def store(self, copies: list[OffloadCopy]) -> None:
        """Device rows -> host slots."""
        for plan in _plans(copies):
            self._copy(plan, to_host=True)

    def load(self, copies: list[OffloadCopy]) -> None:
        """Host slots -> device rows."""
        for plan in _plans(copies):
            self._copy(plan, to_host=False)

    def _copy(self, plan: _Plan, to_host: bool) -> None:
        pairs = zip(self.host[plan.kind], self.device_rows[plan.kind])
        if plan.direct:
            for host, dev in pairs:
                for (h, n), d in zip(plan.host_runs, plan.dev_starts):
                    if to_host:
                        host[h:h + n].copy_(dev[d:d + n], non_blocking=True)
                    else:
                        dev[d:d + n].copy_(host[h:h + n], non_blocking=True)
            return
        # staged from pageable memory without waiting for the device (as attention/builder.py)
        ids = torch.tensor(plan.dev_ids, dtype=torch.long).to(self.device, non_blocking=True)
        staging: dict[tuple, torch.Tensor] = {}   # one buffer per row shape, reused by layers
        chunks: dict[int, list] = {}
        for host, dev in pairs:
            step = max(1, STAGING_BYTES // (dev[0].numel() * dev.element_size()))
            key = (tuple(dev.shape[1:]), dev.dtype)
            if key not in staging:   # stream-ordered reuse: the next layer's copies queue behind
                staging[key] = torch.empty((min(step, len(plan.dev_ids)),) + key[0],
                                           dtype=dev.dtype, device=dev.device)
            if step not in chunks:
                chunks[step] = plan.chunks(step)
            for c0, c1, runs in chunks[step]:
                staged = staging[key][:c1 - c0]                      # [c1 - c0, *row]
                if to_host:
                    torch.index_select(dev, 0, ids[c0:c1], out=staged)
                    for h, lo, hi in runs:
                        host[h:h + hi - lo].copy_(staged[lo - c0:hi - c0], non_blocking=True)
                else:
                    for h, lo, hi in runs:
                        staged[lo - c0:hi - c0].copy_(host[h:h + hi - lo], non_blocking=True)
                    dev.index_copy_(0, ids[c0:c1], staged)

    # ---- file jobs ----
    def submit(self, jobs: list[DiskJob]) -> None:
        """Queue the step's file jobs (after its copies and forward were issued)."""
        if not jobs:
            return
        if self.folder is None:
            raise RuntimeError("offload: file jobs without a disk folder")
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="kdaserve-offload-io",
                                            daemon=True)
            self._thread.start()
        event = None
        if self.device.type == "cuda":
            event = torch.cuda.Event()
            event.record()
        for job in jobs:
            if job.op != "delete":
                self._in_flight.append(job.job_id)
            self._queue.put((job, event))

    def get_finished(self) -> OffloadOutput | None:
        """The jobs every rank has finished since the last call (a collective over the world
        group whenever jobs are in flight: every rank calls it at the same points)."""
        if not self._in_flight:
            return None
        with self._lock:
            mine = [self._state.get(j, (_RUNNING, 0.0)) for j in self._in_flight]
        states = self.world.all_reduce_min([state for state, _ in mine])
        out = OffloadOutput()
        still = []
        for job_id, state, (_, seconds) in zip(self._in_flight, states, mine):
            if state == _RUNNING:
                still.append(job_id)
                continue
            (out.done if state == _DONE else out.failed).append(job_id)
            out.seconds += seconds
            with self._lock:
                self._state.pop(job_id, None)
        self._in_flight = still
        return out if out.done or out.failed else None

    def shutdown(self, timeout: float = 30.0) -> None:
        """Finish the queued jobs, then stop the thread."""
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join(timeout)
            self._thread = None

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            job, event = item
            if event is not None:
                event.synchronize()
            t0 = time.perf_counter()
            try:
                self._do(job)
                state = _DONE
            except Exception as exc:   # reported as failed; the scheduler drops the entry
                logger.warning("offload: %s of %s entry %s failed: %s", job.op, job.kind,
                               job.key[:12], exc)
                state = _FAILED
            if job.op != "delete":
                with self._lock:
                    self._state[job.job_id] = (state, time.perf_counter() - t0)

    def _do(self, job: DiskJob) -> None:
        path = os.path.join(self.folder, entry_filename(job.kind, job.key))
        if job.op == "delete":
            try:
                os.remove(path)
            except FileNotFoundError:
                pass
            return
        rows = [t[job.host_idx] for t in self.host[job.kind]]
        if job.op == "write":
            self._write_file(path, rows)
        elif job.op == "read":
            self._read_file(path, rows)
        else:
            raise ValueError(f"unknown offload file job {job.op!r}")

    @staticmethod
    def _write_file(path: str, rows: list[torch.Tensor]) -> None:
        tmp = path + ".tmp"
        with open(tmp, "wb") as f:
            for row in rows:
                f.write(row.view(torch.uint8).numpy().data)
        os.replace(tmp, path)

    @staticmethod
    def _read_file(path: str, rows: list[torch.Tensor]) -> None:
        with open(path, "rb") as f:
            for row in rows:
                buf = row.view(torch.uint8).numpy().reshape(-1)
                if f.readinto(buf.data) != buf.nbytes:
                    raise OSError(f"{path} is shorter than its entry")
            if f.read(1):
                raise OSError(f"{path} is longer than its entry")


STAGING_BYTES = 64 << 20
"""Rows staged on the device per chunk of a layer's gather or scatter."""


@dataclass
class _Plan:
    """One kind's copies of a step in host-slot order: runs of consecutive host slots, and the
    device row of each copy in the same order."""

    kind: str
    host_runs: list[tuple[int, int]]
    """(first host slot, length), ascending."""
    dev_ids: list[int]
    dev_starts: list[int]
    """Per host run, its first device row (meaningful when `direct`)."""
    direct: bool
    """Every host run's device rows run on by one too: each run is one copy, no staging."""

    def chunks(self, step: int) -> list[tuple[int, int, list[tuple[int, int, int]]]]:
        """The copies cut into chunks of at most `step`: (c0, c1, runs_in(c0, c1))."""
        n = len(self.dev_ids)
        return [(c0, min(c0 + step, n), self.runs_in(c0, min(c0 + step, n)))
                for c0 in range(0, n, step)]

    def runs_in(self, c0: int, c1: int) -> list[tuple[int, int, int]]:
        """The host runs' parts inside copies [c0, c1) of the plan's order, as (host slot,
        lo, hi): copies lo..hi-1 go to or come from host slots h..h + hi - lo - 1."""
        out, pos = [], 0
        for h, n in self.host_runs:
            lo, hi = max(pos, c0), min(pos + n, c1)
            if lo < hi:
                out.append((h + lo - pos, lo, hi))
            pos += n
            if pos >= c1:
                break
        return out


def _plans(copies: list[OffloadCopy]) -> list[_Plan]:
    """Per kind, the copies sorted by host slot and cut into runs of consecutive slots."""
    by_kind: dict[str, list[tuple[int, int]]] = {}
    for c in copies:
        by_kind.setdefault(c.kind, []).append((c.host_idx, c.device_idx))
    plans = []
    for kind, pairs in by_kind.items():
        pairs.sort()
        runs: list[list[int]] = []
        starts: list[int] = []
        direct = True
        for i, (h, d) in enumerate(pairs):
            if runs and h == runs[-1][0] + runs[-1][1]:
                direct = direct and d == pairs[i - 1][1] + 1
                runs[-1][1] += 1
            else:
                runs.append([h, 1])
                starts.append(d)
        plans.append(_Plan(kind, [tuple(r) for r in runs], [d for _, d in pairs], starts,
                           direct))
    return plans
