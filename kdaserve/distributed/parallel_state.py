"""This rank's place in the parallel layout: ranks, sizes and the process groups.

Created once when a worker process starts (init_world, then init_parallel_state) and passed
explicitly to whatever needs it (the worker, the model, its layers); there is no module-level
state. Groups:

- world: every rank, gloo on any device, with a long timeout (the rendezvous itself is bounded
  by ParallelConfig.dist_timeout). It carries start-up exchanges
  (the engine config, the cache sizes) and each step's scheduler output from rank 0 to the
  others, which wait on it while the engine is idle.
- tp: the tensor-parallel ranks (today the whole world), NCCL on CUDA and gloo on the CPU,
  with the collective timeout (ParallelConfig.dist_timeout): the layers' all-reduces and
  all-gathers.
- dcp: decode context parallelism's group (ParallelConfig.decode_context_parallel_size):
  consecutive TP ranks, tp_size / dcp_size groups of dcp_size (vLLM's layout), on the TP
  group's backend; dcp_rank = tp_rank % dcp_size. Its ranks each store 1/dcp of MLA's latent
  KV (attention/dcp.py); size 1 = no group.

A single-rank run never initialises torch.distributed: ParallelState.single() has size-1
groups whose collectives are no-ops.
"""

from __future__ import annotations

import datetime
import logging
from dataclasses import dataclass, field

from kdaserve.config import ParallelConfig
from kdaserve.distributed.comm import GroupComm

logger = logging.getLogger(__name__)

WORLD_TIMEOUT = datetime.timedelta(days=30)
"""The world (gloo) group's timeout: ranks > 0 wait on it for the next step while the engine
is idle, so it must outlast any idle period; a dead peer still ends the wait at once (its
socket closes)."""


@dataclass(frozen=True)
class ParallelState:
    world_rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    """The rank's index on its node (its CUDA device)."""
    tp_rank: int = 0
    tp_size: int = 1
    dcp_rank: int = 0
    dcp_size: int = 1
    world: GroupComm = field(default_factory=GroupComm.single)
    tp: GroupComm = field(default_factory=GroupComm.single)
    dcp: GroupComm = field(default_factory=GroupComm.single)

    @classmethod
    def single(cls) -> "ParallelState":
        """One rank: no process group, every collective a no-op."""
        return cls()

    @property
    def is_driver(self) -> bool:
        """Rank 0: the one beside the scheduler; it samples for the engine."""
        return self.world_rank == 0


def init_world(pc: ParallelConfig, rank: int, master_port: int) -> GroupComm:
    """Join torch.distributed (gloo, tcp://master_addr:master_port rendezvous; it fails when not
    every rank of pc.world_size has joined within pc.dist_timeout) and return the world group
    (gloo, WORLD_TIMEOUT)."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://{pc.master_addr}:{master_port}",
                            world_size=pc.world_size, rank=rank,
                            timeout=datetime.timedelta(seconds=pc.dist_timeout))
    group = dist.new_group(list(range(pc.world_size)), backend="gloo", timeout=WORLD_TIMEOUT)
    return GroupComm(group, rank, pc.world_size)


def init_parallel_state(pc: ParallelConfig, world: GroupComm, local_rank: int,
                        device_type: str) -> ParallelState:
    """The groups above the world group; every rank calls it in the same order (group creation
    is collective). device_type: "cuda" (NCCL TP group) or "cpu" (gloo)."""
    import torch.distributed as dist

    if pc.world_size == 1:
        return ParallelState.single()
    timeout = datetime.timedelta(seconds=pc.dist_timeout)
    ranks = list(range(pc.tensor_parallel_size))
    backend = "nccl" if device_type == "cuda" else "gloo"
    tp_group = dist.new_group(ranks, backend=backend, timeout=timeout)
    tp_rank = ranks.index(world.rank)
    dcp_size = pc.decode_context_parallel_size
    dcp = GroupComm.single()
    if dcp_size > 1:   # every rank creates every group (new_group is collective)
        for first in range(0, len(ranks), dcp_size):
            members = ranks[first:first + dcp_size]
            group = dist.new_group(members, backend=backend, timeout=timeout)
            if world.rank in members:
                dcp = GroupComm(group, members.index(world.rank), dcp_size)
    logger.info("rank %d/%d: tp rank %d/%d (%s), dcp rank %d/%d, local rank %d", world.rank,
                world.size, tp_rank, len(ranks), backend, dcp.rank, dcp.size, local_rank)
    return ParallelState(world_rank=world.rank, world_size=world.size, local_rank=local_rank,
                         tp_rank=tp_rank, tp_size=len(ranks), dcp_rank=dcp.rank,
                         dcp_size=dcp.size, world=world,
                         tp=GroupComm(tp_group, tp_rank, len(ranks)), dcp=dcp)


def destroy_process_groups() -> None:
    """Tear down torch.distributed if this process initialised it."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
