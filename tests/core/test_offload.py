"""The offload tier's scheduler side (OffloadManager, DiskIndex) and its worker side
(OffloadWorker) on CPU tensors: pending / ready / pinned / locked lifetimes, LRU eviction per
level, write-through, reads back, failures, the manifest across restarts, and the agreement of
two ranks on finished file jobs (a slow writer on one rank keeps the entry pinned)."""

from __future__ import annotations

import os
import threading

import pytest
import torch

from kdaserve.attention.metadata import ModelCaches
from kdaserve.core.block_pool import hash_block_tokens
from kdaserve.core.offload import OffloadManager, host_tier_slots
from kdaserve.core.offload_index import (MANIFEST, CheckpointMeta, DiskEntry, DiskIndex,
                                         layout_fingerprint)
from kdaserve.core.sched_output import OffloadOutput
from kdaserve.distributed.comm import GroupComm
from kdaserve.worker.offload import OffloadWorker

BYTES = {"kv": 100, "state": 1000}


def _h(i: int) -> bytes:
    return hash_block_tokens(None, [i])


def _manager(kv=2, state=1, folder=None, disk_size=10**9) -> OffloadManager:
    return OffloadManager({"kv": kv, "state": state}, BYTES, folder, disk_size)


def _jobs(ops):
    return [(j.op, j.kind, bytes.fromhex(j.key)) for j in ops.disk_jobs]


def test_host_slots_split_like_the_prefix_cache():
    # one state per 4 blocks: 1000 + 4 * 100 = 1400 bytes per interval
    assert host_tier_slots(2800, 100, 1000, 4) == {"kv": 8, "state": 2}
    assert host_tier_slots(1200, 100, 1000, 4) == {"kv": 2, "state": 1}
    with pytest.raises(ValueError, match="kv_offload_size"):
        host_tier_slots(1050, 100, 1000, 4)


def test_store_is_pending_until_end_step_then_lru_evicts_unlocked():
    m = _manager(kv=2)
    m.store("kv", _h(1), device_idx=7)
    assert m.source("kv", _h(1)) is None                  # its copy is in a step in flight
    ops = m.take_ops()
    assert [(c.kind, c.device_idx, c.host_idx) for c in ops.stores] == [("kv", 7, 0)]
    m.end_step()
    assert m.source("kv", _h(1)) == "host"
    m.store("kv", _h(1), device_idx=9)                     # held already: no second copy
    assert m.take_ops() is None
    m.store("kv", _h(2), 8)
    m.take_ops()
    m.end_step()
    m.lock("kv", _h(1))                                    # a load of this step reads it
    m.store("kv", _h(3), 5)                                # full: evicts _h(2), not _h(1)
    assert m.source("kv", _h(2)) is None and m.source("kv", _h(1)) == "host"
    m.load("kv", _h(1), 4)
    ops = m.take_ops()
    assert [(c.device_idx, c.host_idx) for c in ops.loads] == [(4, 0)]
    assert [(c.device_idx, c.host_idx) for c in ops.stores] == [(5, 1)]
    m.store("kv", _h(4), 6)                                # _h(1) locked, _h(3) pending
    assert m.stats.num_dropped_stores == 1
    with pytest.raises(RuntimeError, match="lock"):
        m.load("kv", _h(3), 1)


def test_checkpoint_offsets_and_meta_follow_the_entries():
    m = _manager(state=1)
    m.store("state", _h(1), 3, CheckpointMeta(anchor=_h(0), offset=5, num_tokens=21))
    assert m.partial_offsets(_h(0)) == set()               # pending
    m.end_step()
    assert m.partial_offsets(_h(0)) == {5}
    assert m.checkpoint_meta(_h(1)).num_tokens == 21
    m.store("state", _h(2), 3, CheckpointMeta(_h(9), 0, 32))   # evicts _h(1): no disk level
    m.end_step()
    assert m.partial_offsets(_h(0)) == set() and m.checkpoint_meta(_h(1)) is None


def test_write_through_pins_the_slot_until_every_rank_wrote(tmp_path):
    m = _manager(kv=1, folder=str(tmp_path))
    m.store("kv", _h(1), 0)
    m.take_ops()
    m.end_step()                                           # ready: written through
    ops = m.take_ops()
    assert _jobs(ops) == [("write", "kv", _h(1))]
    assert m.source("kv", _h(1)) == "host" and m.disk.get("kv", _h(1)) is None
    m.store("kv", _h(2), 1)                                # its only slot is pinned
    assert m.stats.num_dropped_stores == 1 and m.busy
    m.update(OffloadOutput(done=[ops.disk_jobs[0].job_id]))
    assert m.disk.get("kv", _h(1)).nbytes == 100
    m.store("kv", _h(2), 1)                                # unpinned now: _h(1) leaves host
    assert m.source("kv", _h(1)) == "disk" and m.stats.bytes_written == 100


def test_failed_write_unpins_and_counts(tmp_path):
    m = _manager(kv=1, folder=str(tmp_path))
    m.store("kv", _h(1), 0)
    m.end_step()
    job = m.take_ops().disk_jobs[-1]
    m.update(OffloadOutput(failed=[job.job_id]))
    assert m.stats.num_failures == 1 and m.disk.get("kv", _h(1)) is None
    assert m.source("kv", _h(1)) == "host" and not m.busy


def test_disk_level_drops_its_oldest_files_beyond_its_size(tmp_path):
    m = _manager(kv=4, folder=str(tmp_path), disk_size=250)
    for i in range(3):
        m.store("kv", _h(i), i)
    m.end_step()
    writes = m.take_ops().disk_jobs
    m.update(OffloadOutput(done=[j.job_id for j in writes]))
    assert m.disk.nbytes == 200 and m.disk.get("kv", _h(0)) is None    # 300 > 250
    assert ("delete", "kv", _h(0)) in _jobs(m.take_ops())


def test_promote_reads_disk_entries_back_and_a_failed_read_is_a_miss(tmp_path):
    folder = str(tmp_path)
    m = _manager(kv=2, state=1, folder=folder)
    m.store("kv", _h(1), 0)
    m.store("state", _h(2), 1, CheckpointMeta(_h(1), 0, 16))
    m.end_step()
    m.update(OffloadOutput(done=[j.job_id for j in m.take_ops().disk_jobs]))
    m.close()

    again = _manager(kv=2, state=1, folder=folder)         # a restart: host memory empty
    assert again.source("kv", _h(1)) == "disk" and again.source("state", _h(2)) == "disk"
    assert again.checkpoint_meta(_h(2)) == CheckpointMeta(_h(1), 0, 16)
    assert again.promote([("kv", _h(1)), ("state", _h(2))])
    reads = again.take_ops().disk_jobs
    assert [(j.op, j.kind) for j in reads] == [("read", "kv"), ("read", "state")]
    assert again.source("kv", _h(1)) == "disk"             # still on its way
    assert again.promote([("kv", _h(1))]) and again.take_ops() is None   # not read twice
    again.update(OffloadOutput(done=[reads[0].job_id], failed=[reads[1].job_id]))
    assert again.source("kv", _h(1)) == "host" and again.from_disk("kv", _h(1))
    assert again.source("state", _h(2)) is None            # unreadable: dropped
    assert ("delete", "state", _h(2)) in _jobs(again.take_ops())
    assert again.stats.num_failures == 1


def test_reset_frees_slots_only_when_their_copies_end(tmp_path):
    m = _manager(kv=1, folder=str(tmp_path))
    m.store("kv", _h(1), 0)
    m.reset()                                              # its store is still in flight
    m.store("kv", _h(2), 0)
    assert m.stats.num_dropped_stores == 1                 # the slot is not free yet
    m.end_step()
    m.store("kv", _h(2), 0)
    assert m.source("kv", _h(1)) is None and m.stats.num_dropped_stores == 1


def test_manifest_survives_a_torn_line_and_names_its_layout(tmp_path):
    a, b = layout_fingerprint({"block_size": 16}), layout_fingerprint({"block_size": 32})
    assert a != b and a == layout_fingerprint({"block_size": 16})
    folder = os.path.join(str(tmp_path), a)
    index = DiskIndex(folder, {"block_size": 16})
    index.add("kv", _h(1), DiskEntry(7))
    index.close()
    with open(os.path.join(folder, MANIFEST), "a") as f:
        f.write('{"op": "add", "kind": "kv", "key": "ab')      # a crash mid-line
    again = DiskIndex(folder, {"block_size": 16})
    assert list(again.entries) == [("kv", _h(1))] and again.nbytes == 7


class _TwoRanks(GroupComm):
    """Two in-process ranks' all_reduce_min: each rank's call blocks until the other's."""

    def __init__(self, shared: dict, rank: int) -> None:
        super().__init__(group=object(), rank=rank, size=2)
        self.shared = shared

    def all_reduce_min(self, values):
        s = self.shared
        s[self.rank] = list(values)
        s["barrier"].wait()
        out = [min(a, b) for a, b in zip(s[0], s[1])]
        s["barrier"].wait()
        return out


def _caches() -> ModelCaches:
    return ModelCaches(mla_kv=[torch.randn(4, 2, 3) for _ in range(2)],
                       kda_recurrent=[torch.randn(3, 2, 2, 2)],
                       kda_conv=[torch.randn(3, 12, 3)])


def test_host_copies_and_files_round_trip(tmp_path):
    """Device row -> host slot -> file; after a restart, file -> host slot -> another row."""
    caches = _caches()
    index = str(tmp_path / "index")
    w = OffloadWorker(caches, {"kv": 2, "state": 1}, str(tmp_path))
    m = OffloadManager({"kv": 2, "state": 1}, w.nbytes, index, 10**9)
    kv1 = [t[1].clone() for t in caches.mla_kv]
    m.store("kv", _h(1), 1)
    w.store(m.take_ops().stores)
    m.end_step()
    w.submit(m.take_ops().disk_jobs)
    w.shutdown()                              # drains the writer thread
    m.update(w.get_finished())
    m.close()
    path = tmp_path / "rank0" / f"kv-{_h(1).hex()}.bin"
    assert path.stat().st_size == w.nbytes["kv"] == 2 * 2 * 3 * 4

    w2 = OffloadWorker(_caches(), {"kv": 2, "state": 1}, str(tmp_path))
    m2 = OffloadManager({"kv": 2, "state": 1}, w2.nbytes, index, 10**9)
    assert m2.promote([("kv", _h(1))])
    w2.submit(m2.take_ops().disk_jobs)
    w2.shutdown()
    m2.update(w2.get_finished())
    m2.lock("kv", _h(1))
    m2.load("kv", _h(1), 3)
    w2.load(m2.take_ops().loads)
    for t, ref in zip(w2.device_rows["kv"], kv1):
        assert torch.equal(t[3], ref)


def test_a_slow_writer_on_one_rank_keeps_the_entry_pinned(tmp_path, monkeypatch):
    """Rank 1's write is held back: neither rank reports the job, the scheduler keeps the
    host slot pinned and the entry off the disk index, until rank 1's write completes."""
    release = threading.Event()
    slow_write = OffloadWorker._write_file

    def write(path, rows):
        if os.sep + "rank1" + os.sep in path:
            assert release.wait(30)
        slow_write(path, rows)

    monkeypatch.setattr(OffloadWorker, "_write_file", staticmethod(write))
    shared = {"barrier": threading.Barrier(2)}
    ranks = [OffloadWorker(_caches(), {"kv": 1, "state": 1}, str(tmp_path), r,
                           _TwoRanks(shared, r)) for r in range(2)]
    m = OffloadManager({"kv": 1, "state": 1}, ranks[0].nbytes, str(tmp_path / "index"), 10**9)
    m.store("kv", _h(1), 2)
    stores = m.take_ops().stores
    for w in ranks:
        w.store(stores)
    m.end_step()
    jobs = m.take_ops().disk_jobs
    for w in ranks:
        w.submit(jobs)

    def finished_on_both():
        outs = [None, None]
        threads = [threading.Thread(target=lambda r=r: outs.__setitem__(
            r, ranks[r].get_finished())) for r in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        return outs

    ranks[0].shutdown()                       # rank 0's write is done
    assert (tmp_path / "rank0" / f"kv-{_h(1).hex()}.bin").exists()
    assert finished_on_both() == [None, None]
    m.store("kv", _h(2), 3)                   # the only host slot is still pinned
    assert m.stats.num_dropped_stores == 1 and m.disk.get("kv", _h(1)) is None

    release.set()
    ranks[1].shutdown()
    outs = finished_on_both()
    assert outs[0].done == outs[1].done == [jobs[0].job_id]   # the same decision on both
    assert outs[0].seconds > 0 and not outs[0].failed
    m.update(outs[0])
    assert m.disk.get("kv", _h(1)) is not None
    m.store("kv", _h(2), 3)                   # unpinned: the slot is reused
    assert m.stats.num_dropped_stores == 1 and m.source("kv", _h(1)) == "disk"


def test_copies_are_planned_in_runs_of_host_slots():
    from kdaserve.core.sched_output import OffloadCopy
    from kdaserve.worker.offload import _plans

    copies = [OffloadCopy("kv", d, h) for d, h in [(4, 0), (5, 1), (6, 2), (9, 3), (10, 4)]]
    copies += [OffloadCopy("state", 11, 5), OffloadCopy("kv", 12, 6)]
    kv, state = _plans(copies)
    assert kv.host_runs == [(0, 5), (6, 1)] and kv.dev_ids == [4, 5, 6, 9, 10, 12]
    assert not kv.direct                      # host slots 0-4 run on, their blocks do not
    assert state.host_runs == [(5, 1)] and state.direct and state.dev_starts == [11]
    # a prefix stored in reverse block order into ascending slots: one host run
    rev, = _plans([OffloadCopy("kv", d, h) for d, h in [(7, 2), (3, 0), (5, 1)]])
    assert rev.host_runs == [(0, 3)] and rev.dev_ids == [3, 5, 7] and not rev.direct
    assert rev.runs_in(1, 3) == [(1, 1, 3)]
    ok, = _plans([OffloadCopy("kv", d, h) for d, h in [(1, 0), (2, 1), (8, 5)]])
    assert ok.direct and ok.host_runs == [(0, 2), (5, 1)] and ok.dev_starts == [1, 8]


@pytest.mark.parametrize("staging_rows", [1, 2, 64])
def test_scattered_rows_round_trip_through_staging(monkeypatch, staging_rows):
    """Scattered device rows <-> host slots, staged in chunks that cut host runs apart."""
    from kdaserve.core.sched_output import OffloadCopy
    from kdaserve.worker import offload as worker_offload

    caches = ModelCaches(mla_kv=[torch.randn(9, 2, 3) for _ in range(2)],
                         kda_recurrent=[torch.randn(3, 2, 2, 2)],
                         kda_conv=[torch.randn(3, 12, 3)])
    monkeypatch.setattr(worker_offload, "STAGING_BYTES",
                        staging_rows * caches.mla_kv[0][0].numel() * 4)
    w = OffloadWorker(caches, {"kv": 8, "state": 2}, None)
    pairs = [(7, 1), (2, 2), (5, 3), (0, 4), (8, 6)]          # (device block, host slot)
    before = [t.clone() for t in caches.mla_kv]
    w.store([OffloadCopy("kv", d, h) for d, h in pairs] + [OffloadCopy("state", 2, 1)])
    for host, dev in zip(w.host["kv"], before):
        for d, h in pairs:
            assert torch.equal(host[h], dev[d])
    assert torch.equal(w.host["state"][0][1], caches.kda_recurrent[0][2])
    for t in caches.mla_kv:
        t.zero_()
    moved = [(3, 1), (1, 2), (6, 3), (4, 4), (0, 6)]          # load into other blocks
    w.load([OffloadCopy("kv", d, h) for d, h in moved])
    for t, dev in zip(caches.mla_kv, before):
        for (d, h), (d0, _) in zip(moved, pairs):
            assert torch.equal(t[d], dev[d0])
        untouched = sorted(set(range(9)) - {d for d, _ in moved})
        assert not t[untouched].any()


def test_one_engine_per_disk_folder(tmp_path):
    folder = str(tmp_path / "fp")
    first = DiskIndex(folder, {})
    with pytest.raises(ValueError, match="in use by another engine"):
        DiskIndex(folder, {})
    first.close()
    DiskIndex(folder, {}).close()          # free again once the first one closed
