"""Host staging of a request's prompt state (`kv_buffer_device: "cpu"`): the producer copies
the request's MLA blocks and KDA state slot into one extent of a host buffer, the consumer
READs that extent into an extent of its own host buffer and copies it into its caches.

Why: a transport that cannot reach device memory directly (UCX without a working cuda_ipc
moves VRAM over TCP with per-fragment staging copies; the H200 probe in
benchmarks/PERF_NOTES.md) is fast on host memory, and the device copies here are a few large
copy-engine transfers on a stream of their own instead of thousands of small ones inside the
transport. An extent holds the items in a fixed order that both sides compute from their
(compatible) cache layouts: every MLA layer's blocks in the request's order, then every KDA
layer's recurrent state, then every conv state; each layer's run starts 16-byte aligned.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import dataclass

import torch

ALIGN = 16


def _round_up(n: int, a: int = ALIGN) -> int:
    return (n + a - 1) // a * a


class ExtentPool:
    """First-fit allocation of byte extents in [0, nbytes), thread-safe (the producer
    allocates on its side-channel thread and frees on the engine's)."""

    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes
        self._free: list[tuple[int, int]] = [(0, nbytes)] if nbytes > 0 else []
        """Sorted, disjoint, non-adjacent (offset, size) holes."""
        self._used: dict[int, int] = {}
        self._lock = threading.Lock()

    def alloc(self, size: int) -> int | None:
        """Offset of a new extent of `size` bytes (16-byte aligned), None when no hole fits."""
        size = _round_up(max(size, 1))
        with self._lock:
            for i, (off, n) in enumerate(self._free):
                if n >= size:
                    if n == size:
                        del self._free[i]
                    else:
                        self._free[i] = (off + size, n - size)
                    self._used[off] = size
                    return off
        return None

    def free(self, off: int) -> None:
        with self._lock:
            size = self._used.pop(off)
            holes = self._free
            i = 0
            while i < len(holes) and holes[i][0] < off:
                i += 1
            holes.insert(i, (off, size))
            if i + 1 < len(holes) and off + size == holes[i + 1][0]:       # merge right
                holes[i] = (off, size + holes.pop(i + 1)[1])
            if i > 0 and holes[i - 1][0] + holes[i - 1][1] == off:          # merge left
                holes[i - 1] = (holes[i - 1][0], holes[i - 1][1] + holes.pop(i)[1])

    @property
    def used_bytes(self) -> int:
        with self._lock:
            return sum(self._used.values())


@dataclass(frozen=True)
class Part:
    """One layer's items of one cache kind: tensor [num_items, *item_shape] and the item
    indices to move, in extent order."""

    tensor: torch.Tensor
    items: tuple[int, ...]


def extent_parts(mla: list[torch.Tensor], recurrent: list[torch.Tensor],
                 conv: list[torch.Tensor], block_ids: list[int] | None,
                 state_slot: int | None) -> list[Part]:
    """The extent's parts in order: the MLA blocks (block_ids, None: none) of every MLA layer,
    then the state slot (None: none) of every recurrent and every conv tensor."""
    parts = [Part(t, tuple(block_ids)) for t in mla] if block_ids is not None else []
    if state_slot is not None:
        parts += [Part(t, (state_slot,)) for t in list(recurrent) + list(conv)]
    return parts


def _item_bytes(t: torch.Tensor) -> int:
    return t[0].numel() * t.element_size()


def extent_bytes(parts: list[Part]) -> int:
    return sum(_round_up(len(p.items) * _item_bytes(p.tensor)) for p in parts)


def _runs(items: tuple[int, ...]) -> Iterator[tuple[int, int, int]]:
    """(position in items, first item, count) of each maximal run of consecutive items."""
    i = 0
    while i < len(items):
        j = i + 1
        while j < len(items) and items[j] == items[j - 1] + 1:
            j += 1
        yield i, items[i], j - i
        i = j


def _pairs(parts: list[Part], buf: torch.Tensor, off: int
           ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """(cache view, staging view) per run of consecutive items; buf is a flat uint8 tensor."""
    for p in parts:
        t = p.tensor
        nb = _item_bytes(t)
        for pos, first, n in _runs(p.items):
            lo = off + pos * nb
            host = buf[lo:lo + n * nb].view(t.dtype).view((n,) + tuple(t.shape[1:]))
            yield t[first:first + n], host
        off += _round_up(len(p.items) * nb)


def gather(parts: list[Part], buf: torch.Tensor, off: int) -> None:
    """Copy the parts' items into buf[off:off + extent_bytes(parts)] (asynchronously from a
    device cache into pinned memory: the caller synchronizes its stream)."""
    for cache, host in _pairs(parts, buf, off):
        host.copy_(cache, non_blocking=True)


def scatter(parts: list[Part], buf: torch.Tensor, off: int) -> None:
    """Copy buf[off:...] into the parts' items, on the current stream (asynchronously into a
    device cache: keep the extent until the copies are done)."""
    for cache, host in _pairs(parts, buf, off):
        cache.copy_(host, non_blocking=True)


def host_buffer(nbytes: int, pin: bool) -> torch.Tensor:
    """[nbytes] uint8 host memory, page-locked when pin (device caches)."""
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)
