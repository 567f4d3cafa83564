"""`kdaserve serve MODEL ... --nnodes N --node-rank R --master-addr A --master-port P
--headless`: a worker node. It starts this node's tensor-parallel ranks (worker/executor.py
start_ranks), which join node 0's world group and follow its engine; no API server, no
scheduler. The model folder must exist here too (every rank loads its own shard). Exits when
its ranks do: 0 when all ended cleanly (node 0 shut down), 1 otherwise; SIGINT / SIGTERM stop
the ranks."""

from __future__ import annotations

import logging
import signal
import time
from typing import Any

logger = logging.getLogger("kdaserve.serve")

_POLL_S = 0.5


def run_headless(engine_kwargs: dict[str, Any]) -> int:
    from kdaserve.config import ParallelConfig
    from kdaserve.worker.executor import start_ranks

    pc = ParallelConfig(**{k: engine_kwargs[k] for k in (
        "tensor_parallel_size", "nnodes", "node_rank", "master_addr", "master_port",
        "dist_timeout") if k in engine_kwargs})
    if pc.node_rank == 0:
        raise ValueError("--headless is for worker nodes (--node-rank > 0); node 0 runs the "
                         "server")
    ranks = list(pc.node_ranks)
    logger.info("worker node %d/%d: ranks %s, rendezvous at %s:%d", pc.node_rank, pc.nnodes,
                ranks, pc.master_addr, pc.master_port)
    procs = start_ranks(pc, ranks, pc.master_port)
    stop = []
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.append(True))
    while not stop and any(p.poll() is None for p in procs.values()):
        if any(p.poll() not in (None, 0) for p in procs.values()):
            break   # one rank failed: the others cannot go on
        time.sleep(_POLL_S)
    for p in procs.values():
        if p.poll() is None:
            p.terminate()
    codes = {r: p.wait() for r, p in procs.items()}
    failed = {r: c for r, c in codes.items() if c != 0}
    if failed and not stop:
        logger.error("worker node %d: rank(s) exited with %s", pc.node_rank, failed)
        return 1
    return 0
