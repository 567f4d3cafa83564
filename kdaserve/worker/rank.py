"""`python -m kdaserve.worker.rank --rank R ...`: one tensor-parallel rank > 0 (started by the
engine on node 0, by `kdaserve serve --headless` on worker nodes); see worker/executor.py."""

from __future__ import annotations

import argparse
import logging
import signal

from kdaserve.worker.executor import run_rank


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m kdaserve.worker.rank")
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--local-rank", type=int, required=True)
    p.add_argument("--world-size", type=int, required=True)
    p.add_argument("--master-addr", required=True)
    p.add_argument("--master-port", type=int, required=True)
    p.add_argument("--log-level", default="INFO")
    a = p.parse_args(argv)
    logging.basicConfig(level=a.log_level.upper(),
                        format=f"%(asctime)s %(levelname)s [rank {a.rank}] %(message)s")
    signal.signal(signal.SIGINT, signal.SIG_IGN)   # the engine (rank 0) decides when to stop
    run_rank(a.rank, a.local_rank, a.world_size, a.master_addr, a.master_port)


if __name__ == "__main__":
    main()
