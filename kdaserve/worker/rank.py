"""`python -m kdaserve.worker.rank`: one tensor-parallel rank > 0 (started by the engine on
node 0, by `kdaserve serve --headless` on worker nodes, with torchrun's RANK / LOCAL_RANK /
WORLD_SIZE / MASTER_ADDR / MASTER_PORT in its environment, or the same as flags); see
worker/executor.py."""

from __future__ import annotations

import argparse
import logging
import os
import signal

from kdaserve.worker.executor import run_rank


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m kdaserve.worker.rank",
                                description="Defaults: torchrun's environment variables.")
    env = os.environ.get
    p.add_argument("--rank", type=int, default=env("RANK"))
    p.add_argument("--local-rank", type=int, default=env("LOCAL_RANK"))
    p.add_argument("--world-size", type=int, default=env("WORLD_SIZE"))
    p.add_argument("--master-addr", default=env("MASTER_ADDR", "127.0.0.1"))
    p.add_argument("--master-port", type=int, default=env("MASTER_PORT"))
    p.add_argument("--log-level", default="INFO")
    a = p.parse_args(argv)
    missing = [k for k in ("rank", "local_rank", "world_size", "master_port")
               if getattr(a, k) is None]
    if missing:
        p.error(f"missing {', '.join(missing)} (flags or RANK / LOCAL_RANK / WORLD_SIZE / "
                "MASTER_PORT)")
    logging.basicConfig(level=a.log_level.upper(),
                        format=f"%(asctime)s %(levelname)s [rank {a.rank}] %(message)s")
    signal.signal(signal.SIGINT, signal.SIG_IGN)   # the engine (rank 0) decides when to stop
    run_rank(a.rank, a.local_rank, a.world_size, a.master_addr, a.master_port)


if __name__ == "__main__":
    main()
