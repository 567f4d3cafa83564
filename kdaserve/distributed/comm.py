"""The communication interface the layers and the worker call: collectives over one process
group (NCCL on CUDA, gloo on the CPU).

A size-1 `GroupComm` is a no-op that never touches torch.distributed: the TP=1 path runs no
collective, copies nothing and needs no process group. Collectives work in place where the
operation allows it (all_reduce), so that CUDA-graph capture records them on the buffers the
graph owns.
"""

from __future__ import annotations

import pickle
from typing import Any

import torch


class GroupComm:
    """Collectives over `group` (a torch.distributed ProcessGroup) of `size` ranks, this one
    being `rank` in it; group None means size 1."""

    def __init__(self, group: Any = None, rank: int = 0, size: int = 1) -> None:
        if size > 1 and group is None:
            raise ValueError(f"a group of {size} ranks needs a process group")
        self.group, self.rank, self.size = group, rank, size

    @classmethod
    def single(cls) -> "GroupComm":
        """The size-1 group: every collective returns its input."""
        return cls()

    def __repr__(self) -> str:
        return f"GroupComm(rank={self.rank}, size={self.size})"

    # Tensors ---------------------------------------------------------------------------------

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum of x over the ranks, in place; returns x (every rank gets the same values)."""
        if self.size == 1:
            return x
        import torch.distributed as dist

        dist.all_reduce(x, group=self.group)
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """x [..., n, ...] -> [..., size * n, ...]: the ranks' x concatenated along dim in rank
        order."""
        if self.size == 1:
            return x
        import torch.distributed as dist

        x = x.contiguous()
        out = x.new_empty((self.size * x.shape[0],) + tuple(x.shape[1:]))   # [size * n0, ...]
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        gather(out, x, group=self.group)     # all_gather_single: the name from torch 2.13 on
        dim = dim % x.dim()
        if dim == 0:
            return out
        return torch.cat(out.view((self.size,) + tuple(x.shape)).unbind(0), dim=dim)

    def all_to_all(self, x: torch.Tensor) -> torch.Tensor:
        """x [size, ...]: x[j] goes to rank j; returns [size, ...] whose row j came from rank
        j (one all_to_all_single)."""
        if self.size == 1:
            return x
        import torch.distributed as dist

        x = x.contiguous()
        out = torch.empty_like(x)
        dist.all_to_all_single(out, x, group=self.group)
        return out

    def broadcast(self, x: torch.Tensor, src: int = 0) -> torch.Tensor:
        """x from rank src into every rank's x (in place); returns x."""
        if self.size == 1:
            return x
        import torch.distributed as dist

        dist.broadcast(x, src=self._global(src), group=self.group)
        return x

    def all_reduce_min(self, values: list[int]) -> list[int]:
        """Element-wise minimum of integer lists over the ranks (start-up sizing)."""
        if self.size == 1:
            return list(values)
        import torch.distributed as dist

        t = torch.tensor(values, dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.group)
        return t.tolist()

    # Python objects --------------------------------------------------------------------------

    def broadcast_object(self, obj: Any = None, src: int = 0) -> Any:
        """Rank src's obj (pickled) on every rank; the others pass None. Two broadcasts: the
        length, then the bytes (the group must be a CPU group: gloo)."""
        if self.size == 1:
            return obj
        import torch.distributed as dist

        if self.rank == src:
            data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
            length = torch.tensor([len(data)], dtype=torch.int64)
            dist.broadcast(length, src=self._global(src), group=self.group)
            buf = torch.frombuffer(bytearray(data), dtype=torch.uint8)
            dist.broadcast(buf, src=self._global(src), group=self.group)
            return obj
        length = torch.empty(1, dtype=torch.int64)
        dist.broadcast(length, src=self._global(src), group=self.group)
        buf = torch.empty(int(length.item()), dtype=torch.uint8)
        dist.broadcast(buf, src=self._global(src), group=self.group)
        return pickle.loads(buf.numpy().tobytes())

    def all_gather_object(self, obj: Any) -> list[Any]:
        """Every rank's obj (pickled), in rank order (the group must be a CPU group: gloo)."""
        if self.size == 1:
            return [obj]
        import torch.distributed as dist

        out: list[Any] = [None] * self.size
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def _global(self, group_rank: int) -> int:
        import torch.distributed as dist

        return dist.get_global_rank(self.group, group_rank)
