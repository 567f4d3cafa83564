"""What one rank registered for transfers: where each cache tensor lives and how an item (an
MLA block, a KDA state slot) is laid out, so a peer can address items and refuse a layout that
would not fit its own."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch


class HandshakeError(RuntimeError):
    """Two instances whose caches cannot exchange state (different TP sizes, model or cache
    layout)."""


@dataclass(frozen=True)
class CacheRegion:
    """One kind of cache over its layers: tensors [num_items, *item_shape], contiguous."""

    bases: tuple[int, ...]
    """Base address of each layer's tensor."""
    item_shape: tuple[int, ...]
    dtype: str
    item_bytes: int
    num_items: int

    @classmethod
    def of(cls, tensors: list[torch.Tensor], num_items: int | None = None) -> "CacheRegion":
        if not tensors:
            return cls((), (), "", 0, 0)
        t0 = tensors[0]
        for t in tensors:
            if not t.is_contiguous() or t.shape != t0.shape or t.dtype != t0.dtype:
                raise ValueError("cache tensors of one kind must be contiguous and alike")
        return cls(tuple(t.data_ptr() for t in tensors), tuple(t0.shape[1:]), str(t0.dtype),
                   t0[0].numel() * t0.element_size(),
                   t0.shape[0] if num_items is None else num_items)

    def address(self, layer: int, item: int) -> int:
        if not 0 <= item < self.num_items:
            raise IndexError(f"item {item} outside [0, {self.num_items})")
        return self.bases[layer] + item * self.item_bytes


@dataclass(frozen=True)
class CacheLayout:
    engine_id: str
    tp_rank: int
    tp_size: int
    mem_type: str
    """NIXL memory type: DRAM (CPU tensors) or VRAM (CUDA tensors)."""
    device_id: int
    block_size: int
    mla: CacheRegion
    """Per MLA layer, items = KV blocks."""
    kda_recurrent: CacheRegion
    """Per KDA layer, items = request state slots."""
    kda_conv: CacheRegion
    staged: bool = False
    """Transfers go through host buffers (KVTransferConfig.kv_buffer_device "cpu"): a peer
    asks this rank to stage a request and reads the staged extent, not the caches."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "CacheLayout":
        regions = {k: CacheRegion(**{f: tuple(v) if isinstance(v, list) else v
                                     for f, v in d[k].items()})
                   for k in ("mla", "kda_recurrent", "kda_conv")}
        return cls(d["engine_id"], d["tp_rank"], d["tp_size"], d["mem_type"], d["device_id"],
                   d["block_size"], **regions, staged=bool(d.get("staged", False)))

    def check_compatible(self, remote: "CacheLayout") -> None:
        """HandshakeError naming the first difference that forbids a transfer."""
        if remote.tp_size != self.tp_size:
            raise HandshakeError(
                f"engine {remote.engine_id!r} runs tensor_parallel_size={remote.tp_size}, this "
                f"one {self.tp_size}: transfers between different TP sizes are not supported "
                "(run both sides with the same --tensor-parallel-size)")
        if remote.staged != self.staged:
            mode = {True: "'cpu' (host buffers)", False: "'cuda' (the caches)"}
            raise HandshakeError(f"engine {remote.engine_id!r} transfers through "
                                 f"kv_buffer_device={mode[remote.staged]}, this one through "
                                 f"{mode[self.staged]}: give both the same kv_buffer_device")
        if remote.block_size != self.block_size:
            raise HandshakeError(f"engine {remote.engine_id!r} has block_size="
                                 f"{remote.block_size}, this one {self.block_size}")
        for name in ("mla", "kda_recurrent", "kda_conv"):
            a, b = getattr(self, name), getattr(remote, name)
            if (len(a.bases), a.item_shape, a.dtype) != (len(b.bases), b.item_shape, b.dtype):
                raise HandshakeError(
                    f"engine {remote.engine_id!r}: its {name} cache is {len(b.bases)} layers of "
                    f"{b.item_shape} {b.dtype}, this one's {len(a.bases)} layers of "
                    f"{a.item_shape} {a.dtype} (another model, dtype or TP sharding)")
