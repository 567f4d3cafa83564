"""The communication interface: size-1 groups are no-ops, and the gloo collectives of two CPU
ranks give the sums, concatenations and objects they promise."""

from __future__ import annotations

import socket

import pytest
import torch
import torch.multiprocessing as mp

from kdaserve.config import ParallelConfig
from kdaserve.distributed.comm import GroupComm
from kdaserve.distributed.parallel_state import ParallelState

pytestmark = pytest.mark.timeout(120)


def test_single_group_is_a_no_op():
    import torch.distributed as dist

    c = GroupComm.single()
    x = torch.arange(6.0).view(2, 3)
    assert c.all_reduce(x) is x and c.all_gather(x, dim=0) is x and c.broadcast(x) is x
    assert c.broadcast_object({"a": 1}) == {"a": 1}
    assert c.all_reduce_min([3, 4]) == [3, 4]
    ps = ParallelState.single()
    assert ps.tp.size == ps.dcp.size == ps.world.size == 1 and ps.is_driver
    assert not dist.is_initialized()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank: int, port: int, results) -> None:
    from kdaserve.distributed.parallel_state import (destroy_process_groups, init_parallel_state,
                                                     init_world)

    pc = ParallelConfig(tensor_parallel_size=2, master_port=port)
    world = init_world(pc, rank, port)
    ps = init_parallel_state(pc, world, rank, "cpu")
    x = torch.full((2, 3), float(rank + 1))
    summed = ps.tp.all_reduce(x.clone())
    gathered = ps.tp.all_gather(torch.full((2, 1), float(rank)), dim=-1)     # [2, 2]
    rows = ps.tp.all_gather(torch.full((1, 3), float(rank)), dim=0)          # [2, 3]
    obj = ps.world.broadcast_object({"step": 7, "ids": [1, 2]} if rank == 0 else None)
    low = ps.world.all_reduce_min([10 - rank, 5 + rank])
    results[rank] = (summed.tolist(), gathered.tolist(), rows.tolist(), obj, low, ps.tp_rank)
    destroy_process_groups()


def test_two_gloo_ranks():
    port = _free_port()
    results = mp.Manager().dict()
    mp.spawn(_rank_main, args=(port, results), nprocs=2, join=True)
    for rank in (0, 1):
        summed, gathered, rows, obj, low, tp_rank = results[rank]
        assert summed == [[3.0] * 3] * 2
        assert gathered == [[0.0, 1.0]] * 2
        assert rows == [[0.0] * 3, [1.0] * 3]
        assert obj == {"step": 7, "ids": [1, 2]}
        assert low == [9, 5] and tp_rank == rank
