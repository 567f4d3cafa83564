"""NIXL READ bandwidth between two processes on one machine, the way the PD connector moves
a request: the consumer reads N items (MLA blocks or KDA state slots) from the producer's
registered cache in one transfer of N descriptors, and polls it to completion.

Each run prints and records the first pull (connection set-up included) and the steady
pulls, so the transport UCX picked (``UCX_TLS``, ``UCX_PROTO_INFO=y`` in the environment) can
be compared on the GPU and on the CPU:

    python benchmarks/nixl_probe.py --device cuda --items 2000 --item-kb 18 --out probe.json
    UCX_TLS=cuda_ipc,cuda_copy,tcp python benchmarks/nixl_probe.py --device cuda ...

``--busy-ms`` makes the producer's main thread hold the GIL-free CPU in a loop between polls,
as an engine step would: it shows whether the READs progress without the producer's thread.
``--gpu-busy default|side`` keeps the GPU of both processes busy with matmuls during the
pulls, on the legacy default stream or on a non-blocking stream, as a serving engine's steps
would: it shows whether the transport's own copies wait for the engine's kernels.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import sys
import threading
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from kdaserve.disagg.nixl.worker import import_nixl

MEM_TYPES = {"cuda": "VRAM", "cpu": "DRAM"}


def _buffer(device: str, nbytes: int) -> torch.Tensor:
    # [nbytes] uint8: one region, as one layer's cache tensor
    return torch.zeros(nbytes, dtype=torch.uint8, device=device)


def _descs(base: int, items: int, item_bytes: int, stride: int, dev: int) -> np.ndarray:
    """[items, 3] uint64 rows (address, length, device id), items `stride` bytes apart."""
    addrs = base + np.arange(items, dtype=np.uint64) * np.uint64(stride)
    return np.stack([addrs, np.full(items, item_bytes, np.uint64),
                     np.full(items, dev, np.uint64)], 1)


class GpuLoad:
    """Matmuls queued back to back on one stream from a thread, until stopped: the GPU never
    idles. `stream`: "default" (the legacy default stream, which the engine's steps use) or
    "side" (a non-blocking stream)."""

    def __init__(self, stream: str) -> None:
        self.stream = (torch.cuda.default_stream() if stream == "default"
                       else torch.cuda.Stream())
        self.a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        with torch.cuda.stream(self.stream):
            while not self.stop.is_set():
                for _ in range(50):   # ~10 ms of work, then wait for it: a bounded queue
                    self.a = (self.a @ self.a) * 1e-2
                done = torch.cuda.Event()
                done.record(self.stream)
                done.synchronize()

    def close(self) -> None:
        self.stop.set()
        self.thread.join()


def producer(conn, device: str, nbytes: int, busy_ms: float, prog_thread: bool,
             gpu_busy: str) -> None:
    nixl = import_nixl()
    load = GpuLoad(gpu_busy) if gpu_busy != "none" else None
    agent = nixl.nixl_agent("probe-producer", nixl.nixl_agent_config(
        enable_prog_thread=prog_thread, backends=["UCX"]))
    buf = _buffer(device, nbytes)
    buf.fill_(7)
    reg = agent.register_memory([buf])
    conn.send((agent.get_agent_metadata(), buf.data_ptr()))
    while not conn.poll():
        agent.get_new_notifs()   # the engine's poll between steps
        if busy_ms > 0:
            t = time.perf_counter() + busy_ms / 1e3
            while time.perf_counter() < t:
                pass
        else:
            time.sleep(0.001)
    conn.recv()
    if load is not None:
        load.close()
    agent.deregister_memory(reg)
    conn.send("bye")


def consume(args) -> dict:
    nixl = import_nixl()
    stride = args.item_kb * 1024 * (2 if args.gaps else 1)
    nbytes = stride * args.items
    parent, child = mp.get_context("spawn").Pipe()
    proc = mp.get_context("spawn").Process(
        target=producer, args=(child, args.device, nbytes, args.busy_ms, not args.no_prog_thread,
                               args.gpu_busy))
    proc.start()
    meta, remote_base = parent.recv()
    agent = nixl.nixl_agent("probe-consumer", nixl.nixl_agent_config(
        enable_prog_thread=not args.no_prog_thread, backends=["UCX"]))
    buf = _buffer(args.device, nbytes)
    reg = agent.register_memory([buf])
    remote = agent.add_remote_agent(meta)
    dev = 0   # device 0 on both sides
    mem = MEM_TYPES[args.device]
    item_bytes = args.item_kb * 1024
    local_d = agent.get_xfer_descs(_descs(buf.data_ptr(), args.items, item_bytes, stride, dev), mem)
    remote_d = agent.get_xfer_descs(_descs(remote_base, args.items, item_bytes, stride, dev), mem)
    load = GpuLoad(args.gpu_busy) if args.gpu_busy != "none" else None
    pulls = []
    for rep in range(args.reps):
        t0 = time.perf_counter()
        handle = agent.initialize_xfer("READ", local_d, remote_d, remote, b"probe")
        t_init = time.perf_counter()
        state = agent.transfer(handle)
        t_post = time.perf_counter()
        polls = 0
        while state not in ("DONE", "ERR"):
            state = agent.check_xfer_state(handle)
            polls += 1
        t1 = time.perf_counter()
        handle.release()
        moved = args.items * item_bytes
        pulls.append({"rep": rep, "state": state, "ms": (t1 - t0) * 1e3,
                      "init_ms": (t_init - t0) * 1e3, "post_ms": (t_post - t_init) * 1e3,
                      "polls": polls, "GBps": moved / (t1 - t0) / 1e9})
        print(f"pull {rep}: {state} {pulls[-1]['ms']:.2f} ms (init {pulls[-1]['init_ms']:.2f}, "
              f"post {pulls[-1]['post_ms']:.2f}), {pulls[-1]['GBps']:.2f} GB/s", flush=True)
    if load is not None:
        load.close()
    ok = bool((buf.view(-1)[: item_bytes] == 7).all().item())
    parent.send("stop")
    parent.recv()
    proc.join(10)
    agent.remove_remote_agent(remote)
    agent.deregister_memory(reg)
    steady = sorted(p["ms"] for p in pulls[1:]) or [pulls[0]["ms"]]
    return {"device": args.device, "items": args.items, "item_kb": args.item_kb,
            "gaps": args.gaps, "busy_ms": args.busy_ms, "prog_thread": not args.no_prog_thread,
            "gpu_busy": args.gpu_busy,
            "bytes": args.items * item_bytes, "data_ok": ok,
            "UCX_TLS": os.environ.get("UCX_TLS", ""), "first_ms": pulls[0]["ms"],
            "steady_median_ms": steady[len(steady) // 2],
            "steady_GBps": args.items * item_bytes / (steady[len(steady) // 2] / 1e3) / 1e9,
            "pulls": pulls}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                    choices=sorted(MEM_TYPES))
    ap.add_argument("--items", type=int, default=2000)
    ap.add_argument("--item-kb", type=int, default=18)
    ap.add_argument("--gaps", action="store_true",
                    help="leave an item-sized gap after each item (no two descriptors merge)")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--busy-ms", type=float, default=0.0)
    ap.add_argument("--no-prog-thread", action="store_true")
    ap.add_argument("--gpu-busy", default="none", choices=["none", "default", "side"])
    ap.add_argument("--label", default="")
    ap.add_argument("--out", default=None, help="append the run to this JSON list")
    args = ap.parse_args()
    res = {"label": args.label, "host": platform.node(), **consume(args)}
    print(json.dumps({k: v for k, v in res.items() if k != "pulls"}), flush=True)
    if args.out:
        runs = []
        if os.path.exists(args.out):
            with open(args.out) as f:
                runs = json.load(f)
        runs.append(res)
        with open(args.out, "w") as f:
            json.dump(runs, f, indent=1)


if __name__ == "__main__":
    main()
