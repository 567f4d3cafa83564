"""The disk level's index: which entries have a file on every rank, in LRU order, kept in a
manifest that survives restarts.

Folder layout under the disk path (`--additional-config '{"kv_offload_disk_path": ...}'`):

    <path>/<fingerprint>/index.jsonl          the manifest (written here, on node 0)
    <path>/<fingerprint>/layout.json          what the fingerprint was made of (for people)
    <path>/<fingerprint>/lock                 held (flock) by the one engine using the folder
    <path>/<fingerprint>/rank<r>/<kind>-<key>.bin   rank r's bytes (written by its worker)

The fingerprint (`layout_fingerprint`) hashes the model and the cache layout, so a folder is
only ever read back by an engine whose caches have the same shape and meaning. The manifest is
an append-only log of JSON lines, `{"op": "add", ...}` once every rank has written an entry and
`{"op": "del", ...}` when it is dropped; opening replays it and rewrites it compacted. An entry
is in the index only after every rank's write completed, so a crash between a write and its
manifest line leaves an orphan file, never an entry without its bytes.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
from collections import OrderedDict
from dataclasses import dataclass

from kdaserve.core.block_pool import BlockHash

MANIFEST = "index.jsonl"


def layout_fingerprint(layout: dict) -> str:
    """Hex digest of a JSON-able description of the model and the cache layout."""
    payload = json.dumps(layout, sort_keys=True, default=str).encode()
    return hashlib.sha256(payload).hexdigest()[:24]


def entry_filename(kind: str, key: BlockHash | str) -> str:
    """A rank's file of one entry, inside its rank<r> folder."""
    return f"{kind}-{key if isinstance(key, str) else key.hex()}.bin"


@dataclass(frozen=True)
class CheckpointMeta:
    """Where a KDA checkpoint sits (checkpoint_pool.Checkpoint without its slot)."""

    anchor: BlockHash
    offset: int
    num_tokens: int


@dataclass
class DiskEntry:
    nbytes: int
    meta: CheckpointMeta | None = None


class DiskIndex:
    """The entries on disk, keyed by (kind, key) with kind "kv" or "state", least recently
    used first, and the manifest that records them."""

    def __init__(self, folder: str, layout: dict) -> None:
        self.folder = folder
        os.makedirs(folder, exist_ok=True)
        self._lock = open(os.path.join(folder, "lock"), "a+")
        try:
            fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            self._lock.seek(0)
            holder = self._lock.read().strip() or "?"
            self._lock.close()
            raise ValueError(f"kv_offload_disk_path: {folder} is in use by another engine "
                             f"(pid {holder}); give each engine its own folder") from None
        self._lock.truncate(0)
        self._lock.write(str(os.getpid()))
        self._lock.flush()
        with open(os.path.join(folder, "layout.json"), "w") as f:
            json.dump(layout, f, sort_keys=True, indent=1, default=str)
        self.entries: OrderedDict[tuple[str, BlockHash], DiskEntry] = OrderedDict()
        self._replay()
        self._rewrite()
        self._log = open(os.path.join(folder, MANIFEST), "a")
        self.nbytes = sum(e.nbytes for e in self.entries.values())

    def get(self, kind: str, key: BlockHash) -> DiskEntry | None:
        return self.entries.get((kind, key))

    def touch(self, kind: str, key: BlockHash) -> None:
        if (kind, key) in self.entries:
            self.entries.move_to_end((kind, key))

    def add(self, kind: str, key: BlockHash, entry: DiskEntry) -> None:
        old = self.entries.pop((kind, key), None)
        self.nbytes += entry.nbytes - (old.nbytes if old is not None else 0)
        self.entries[(kind, key)] = entry
        self._append(_add_record(kind, key, entry))

    def remove(self, kind: str, key: BlockHash) -> DiskEntry | None:
        entry = self.entries.pop((kind, key), None)
        if entry is not None:
            self.nbytes -= entry.nbytes
            self._append({"op": "del", "kind": kind, "key": key.hex()})
        return entry

    def oldest(self) -> tuple[str, BlockHash] | None:
        return next(iter(self.entries), None)

    def close(self) -> None:
        self._log.close()
        self._lock.close()   # releases the flock

    # ---- manifest ----
    def _append(self, record: dict) -> None:
        self._log.write(json.dumps(record) + "\n")
        self._log.flush()

    def _replay(self) -> None:
        path = os.path.join(self.folder, MANIFEST)
        if not os.path.exists(path):
            return
        with open(path) as f:
            for line in f:
                try:
                    r = json.loads(line)
                    kind, key = r["kind"], bytes.fromhex(r["key"])
                    if kind not in ("kv", "state"):
                        continue
                    self.entries.pop((kind, key), None)
                    if r["op"] == "add":
                        meta = r.get("meta")
                        self.entries[(kind, key)] = DiskEntry(int(r["nbytes"]), CheckpointMeta(
                            bytes.fromhex(meta[0]), int(meta[1]), int(meta[2]))
                            if meta is not None else None)
                except (ValueError, KeyError, TypeError, IndexError):
                    continue   # a torn last line (crash mid-write): skip it

    def _rewrite(self) -> None:
        path = os.path.join(self.folder, MANIFEST)
        tmp = path + ".tmp"
        with open(tmp, "w") as f:
            for (kind, key), e in self.entries.items():
                f.write(json.dumps(_add_record(kind, key, e)) + "\n")
        os.replace(tmp, path)


def _add_record(kind: str, key: BlockHash, entry: DiskEntry) -> dict:
    record = {"op": "add", "kind": kind, "key": key.hex(), "nbytes": entry.nbytes}
    if entry.meta is not None:
        record["meta"] = [entry.meta.anchor.hex(), entry.meta.offset, entry.meta.num_tokens]
    return record
