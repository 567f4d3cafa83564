"""Tensor-parallel execution: one worker process per rank, all driven by rank 0.

Rank 0's Worker lives where the single worker lives (the engine core's process), wrapped in a
`DriverWorker` that has the Worker's interface. The other ranks of node 0 are subprocesses it
starts (`python -m kdaserve.worker.rank`); worker nodes (`kdaserve serve --headless`) start
their own ranks with the same entry point (start_ranks). Every rank then:

1. joins the world group (gloo, tcp://master_addr:master_port) and receives the EngineConfig
   from rank 0 (a broadcast), then builds the TP group (NCCL on CUDA, gloo on the CPU);
2. builds its Worker: loads its shard, sizes its caches (the minimum over the ranks),
   allocates them, warms up and captures its CUDA graphs, the collectives inside;
3. loops over rank 0's commands, broadcast over the world group: ("launch", SchedulerOutput),
   ("collect",) (the oldest launched step), ("shutdown",). Each rank makes exactly rank 0's
   calls in rank 0's order (async scheduling included), so the collectives inside the forward
   meet and every rank's runner state (token ids, pending samples) stays identical; the
   sampling runs on every rank on the same gathered logits with identically seeded generators,
   and only rank 0's output goes to the scheduler.

A rank that dies: gloo ends a collective at once when a peer's socket closes, NCCL after the TP
group's timeout (ParallelConfig.dist_timeout); either way the step raises and DriverWorker turns
it into a RankDiedError naming the rank. A watchdog thread polls the local rank processes; where
the owner asks for it (the server's engine core: on_rank_death), a death that the main thread
has not reported within RANK_DEATH_GRACE_S ends the process, so that even a collective that
never returns cannot hang the server.
"""

from __future__ import annotations

import collections
import ctypes
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import weakref
from typing import Callable

from kdaserve.config import EngineConfig, ParallelConfig
from kdaserve.core.sched_output import ModelRunnerOutput, SchedulerOutput
from kdaserve.disagg.factory import resolve_engine_id
from kdaserve.distributed.parallel_state import (destroy_process_groups, init_parallel_state,
                                                 init_world)
from kdaserve.models.kimi_linear import check_tensor_parallel
from kdaserve.worker.input_batch import LaunchedStep
from kdaserve.worker.worker import Worker

logger = logging.getLogger(__name__)

RANK_DEATH_GRACE_S = 5.0
"""How long the watchdog lets the main thread report a dead rank before on_rank_death runs."""
_WATCHDOG_POLL_S = 0.5
_SHUTDOWN_WAIT_S = 10.0


class RankDiedError(RuntimeError):
    """A tensor-parallel rank's process is gone: the engine cannot step any more."""


def make_worker(config: EngineConfig) -> "Worker | DriverWorker":
    """The engine's worker: today's single Worker for one rank (no process, no group), rank 0
    driving the others for several."""
    if config.parallel_config.world_size == 1:
        return Worker(config)
    return DriverWorker(config)


def free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _die_with_parent() -> None:
    """In a rank subprocess (preexec_fn): SIGKILL when the process that started it dies."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)   # PR_SET_PDEATHSIG
    except OSError:
        pass


def start_ranks(pc: ParallelConfig, ranks: list[int], master_port: int
                ) -> dict[int, subprocess.Popen]:
    """Start rank processes of this node (`python -m kdaserve.worker.rank`); they join the
    world group at tcp://pc.master_addr:master_port."""
    procs = {}
    first = pc.node_ranks.start
    for rank in ranks:
        # torchrun's variables: the rank's place, read by `python -m kdaserve.worker.rank`
        env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank - first),
                   WORLD_SIZE=str(pc.world_size), MASTER_ADDR=pc.master_addr,
                   MASTER_PORT=str(master_port))
        procs[rank] = subprocess.Popen(
            [sys.executable, "-m", "kdaserve.worker.rank"], env=env,
            preexec_fn=_die_with_parent if sys.platform == "linux" else None)
    return procs


def _stop(procs: dict[int, subprocess.Popen], wait_s: float) -> None:
    deadline = time.monotonic() + wait_s
    for p in procs.values():
        try:
            p.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


class DriverWorker:
    """Rank 0: its own Worker plus the commands that make the other ranks follow it. Has the
    Worker's interface (the engine core cannot tell them apart)."""

    def __init__(self, config: EngineConfig) -> None:
        pc = config.parallel_config
        if pc.node_rank != 0:
            raise ValueError("the engine (rank 0) runs on node 0; worker nodes run "
                             "`kdaserve serve ... --headless`")
        check_tensor_parallel(config.model_config.arch, pc.tensor_parallel_size)
        port = pc.master_port or free_port(pc.master_addr)
        self.procs = start_ranks(pc, [r for r in pc.node_ranks if r != 0], port)
        self._finalizer = weakref.finalize(self, _stop, self.procs, 0.0)
        self.dead: str | None = None
        self._reported = False
        self.on_rank_death: Callable[[str], None] | None = None
        """Called (from the watchdog thread) when a rank died and the main thread has not
        reported it within RANK_DEATH_GRACE_S."""
        self._stopping = threading.Event()
        self._watchdog = threading.Thread(target=self._watch, name="kdaserve-rank-watchdog",
                                          daemon=True)
        self._watchdog.start()
        self._stepping = False
        """The ranks are in their command loop (start-up done): shutdown may broadcast."""
        try:
            self.world = init_world(pc, 0, port)
            if config.kv_transfer_config is not None:
                resolve_engine_id(config)   # before the broadcast: one id for every rank
            self.world.broadcast_object(config)
            _set_device(config.device, 0)
            self.parallel = init_parallel_state(pc, self.world, 0, config.device)
            self.worker = Worker(config, self.parallel)
        except Exception as e:
            # A configuration every rank refuses alike (ValueError) is the error to report;
            # otherwise a rank that died first is the cause (before shutdown kills the rest).
            died = None if isinstance(e, ValueError) else self._dead_message()
            self.shutdown()
            if died is not None:
                raise RankDiedError(died) from e
            raise

    # The Worker's interface -----------------------------------------------------------------

    @property
    def kv_connector(self):
        """Rank 0's connector worker (each rank has its own; Worker.collect agrees on them)."""
        return self.worker.kv_connector

    @property
    def kv_side_channel_ports(self) -> list[int | None]:
        return self.worker.kv_side_channel_ports

    @property
    def model_runner(self):
        return self.worker.model_runner

    @property
    def offload_spec(self):
        return self.worker.offload_spec

    @property
    def spec(self):
        return self.worker.spec

    @property
    def spec_stats(self):
        return self.worker.spec_stats

    def determine_num_blocks_and_slots(self) -> tuple[int, int]:
        return self._guarded(self.worker.determine_num_blocks_and_slots)

    def initialize_cache(self, num_blocks: int, num_slots: int) -> None:
        self._guarded(self.worker.initialize_cache, num_blocks, num_slots)
        self._stepping = True

    def launch(self, so: SchedulerOutput) -> LaunchedStep:
        def run() -> LaunchedStep:
            self.world.broadcast_object(("launch", so))
            return self.worker.launch(so)
        return self._guarded(run)

    def collect(self, step: LaunchedStep) -> ModelRunnerOutput:
        def run() -> ModelRunnerOutput:
            self.world.broadcast_object(("collect",))
            return self.worker.collect(step)
        return self._guarded(run)

    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        return self.collect(self.launch(so))

    # Liveness -------------------------------------------------------------------------------

    def dead_ranks(self) -> dict[int, int]:
        """rank -> exit code of the local rank processes that have exited."""
        return {r: p.returncode for r, p in self.procs.items() if p.poll() is not None}

    def check_alive(self) -> None:
        """RankDiedError if a rank is gone."""
        self._raise_if_dead(None)

    def _guarded(self, fn, *args):
        """fn(*args); any failure leaves the ranks out of step (a collective that some rank
        never reached), so it is final: RankDiedError naming the dead rank, or the error
        itself with `dead` set."""
        self.check_alive()
        try:
            return fn(*args)
        except Exception as e:
            time.sleep(0.2)   # a peer's failure reaches its socket before its exit status
            self._raise_if_dead(e)
            self.dead = f"rank 0 failed ({type(e).__name__}: {e}); the ranks are out of step"
            self._reported = True
            raise

    def _dead_message(self) -> str | None:
        dead = self.dead_ranks()
        return "; ".join(f"tensor-parallel rank {r} died (exit code {c})"
                         for r, c in sorted(dead.items())) or None

    def _raise_if_dead(self, cause: BaseException | None) -> None:
        if self.dead is None:
            self.dead = self._dead_message()
            if self.dead is None:
                return
        self._reported = True
        raise RankDiedError(self.dead) from cause

    def _watch(self) -> None:
        noticed: float | None = None
        while not self._stopping.wait(_WATCHDOG_POLL_S):
            dead = self.dead_ranks()
            if not dead:
                continue
            if noticed is None:
                noticed = time.monotonic()
                logger.error("tensor-parallel rank(s) %s died (exit codes %s)",
                             sorted(dead), [dead[r] for r in sorted(dead)])
            if (not self._reported and self.on_rank_death is not None
                    and time.monotonic() - noticed > RANK_DEATH_GRACE_S):
                self.on_rank_death(f"tensor-parallel rank(s) {sorted(dead)} died")
                return

    # Shutdown -------------------------------------------------------------------------------

    def shutdown(self) -> None:
        """Tell the ranks to exit, wait for them (killed after a while), leave the groups."""
        self._stopping.set()
        worker = getattr(self, "worker", None)
        if worker is not None:
            worker.shutdown()
        clean = self._stepping and not self.dead_ranks() and self.dead is None
        if clean:
            try:
                self.world.broadcast_object(("shutdown",))
            except Exception as e:  # noqa: BLE001 - the ranks are killed below anyway
                logger.warning("tensor-parallel shutdown broadcast failed: %s", e)
                clean = False
        self._stepping = False
        _stop(self.procs, _SHUTDOWN_WAIT_S if clean else 0.0)
        destroy_process_groups()


def _set_device(device: str, local_rank: int) -> None:
    """CUDA: this rank's GPU is the current device before the NCCL group exists (its
    communicator binds to the current device)."""
    if device == "cuda":
        import torch

        torch.cuda.set_device(local_rank)


def run_rank(rank: int, local_rank: int, world_size: int, master_addr: str,
             master_port: int) -> None:
    """A rank > 0: join, build the worker, follow rank 0's commands until it says shutdown
    (or its socket closes: rank 0 is gone, and the rank exits non-zero)."""
    pc = ParallelConfig(tensor_parallel_size=world_size, master_addr=master_addr,
                        master_port=master_port)
    world = init_world(pc, rank, master_port)
    config: EngineConfig = world.broadcast_object(None)
    _set_device(config.device, local_rank)
    parallel = init_parallel_state(config.parallel_config, world, local_rank, config.device)
    worker = Worker(config, parallel)
    num_blocks, num_slots = worker.determine_num_blocks_and_slots()
    worker.initialize_cache(num_blocks, num_slots)
    launched: collections.deque[LaunchedStep] = collections.deque()
    while True:
        msg = world.broadcast_object(None)
        if msg[0] == "launch":
            launched.append(worker.launch(msg[1]))
        elif msg[0] == "collect":
            worker.collect(launched.popleft())
        elif msg[0] == "shutdown":
            worker.shutdown()
            break
        else:
            raise RuntimeError(f"unknown command from rank 0: {msg[0]!r}")
    destroy_process_groups()


def exit_now(reason: str) -> None:
    """on_rank_death for a process that must not outlive its ranks (the engine core)."""
    logger.error("%s: exiting (status 1)", reason)
    os._exit(1)
