# SPDX-License-Identifier: Apache-2.0
"""Start a `kdaserve serve` subprocess for a benchmark and stop it afterwards."""

from __future__ import annotations

import os
import re
import shlex
import signal
import socket
import subprocess
import sys

from kdaserve.bench.client import wait_for_health


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """`python -m kdaserve.entrypoints.cli serve MODEL --port P <args>` in its own process group,
    output to `log_path`. Use as a context manager; `start()` returns once /health answers 200
    or raises (RuntimeError if the server exited: `refused` is then True).
    tensor_parallel_size: appended as `--tensor-parallel-size N` (the server starts its other
    ranks itself; the process group stop() signals holds them too); decode_context_parallel_size
    as `--decode-context-parallel-size N`."""

    def __init__(self, model: str, args: list[str], log_path: str, port: int | None = None,
                 host: str = "127.0.0.1", python: str = sys.executable,
                 tensor_parallel_size: int | None = None,
                 decode_context_parallel_size: int | None = None):
        self.port = port or free_port()
        self.host = host
        tp = [] if tensor_parallel_size is None else ["--tensor-parallel-size",
                                                     str(tensor_parallel_size)]
        if decode_context_parallel_size is not None:
            tp += ["--decode-context-parallel-size", str(decode_context_parallel_size)]
        self.cmd = [python, "-m", "kdaserve.entrypoints.cli", "serve", model,
                    "--host", host, "--port", str(self.port), *args, *tp]
        self.log_path = log_path
        self.proc: subprocess.Popen | None = None
        self.startup_s: float | None = None
        self.refused = False

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def command_line(self) -> str:
        return shlex.join(self.cmd)

    def start(self, timeout: float) -> float:
        os.makedirs(os.path.dirname(os.path.abspath(self.log_path)), exist_ok=True)
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen(self.cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                                         start_new_session=True)
        try:
            self.startup_s = wait_for_health(self.base_url, timeout, proc=self.proc)
        except RuntimeError:
            self.refused = True
            raise
        return self.startup_s

    def log_tail(self, n: int = 40) -> str:
        try:
            with open(self.log_path, errors="replace") as f:
                return "".join(f.readlines()[-n:])
        except OSError:
            return ""

    def capacity(self) -> dict:
        """The cache capacity the server logged at start-up (kdaserve's lines; {} for servers
        that log none): MLA KV tokens, KDA state slots, max concurrency at max_model_len, and
        the speculative decoding state-memory line."""
        try:
            with open(self.log_path, errors="replace") as f:
                return parse_capacity(f.read())
        except OSError:
            return {}

    def stop(self, grace: float = 30.0) -> int | None:
        """SIGTERM the server's process group (the one this object started), SIGKILL after
        `grace` seconds; returns the exit code."""
        if self.proc is None or self.proc.poll() is not None:
            return None if self.proc is None else self.proc.returncode
        pgid = self.proc.pid  # start_new_session: the server leads its own group
        try:
            os.killpg(pgid, signal.SIGTERM)
            self.proc.wait(grace)
        except subprocess.TimeoutExpired:
            os.killpg(pgid, signal.SIGKILL)
            self.proc.wait(10)
        except ProcessLookupError:
            pass
        return self.proc.returncode

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


_KV_LINE = re.compile(r"MLA KV cache: (\d+) tokens; KDA state slots: (\d+) .*?"
                      r"max concurrency at max_model_len: ([\d.]+)")
_SPEC_LINE = re.compile(r"(spec decode \(.*verify records per request)")


def parse_capacity(log_text: str) -> dict:
    out: dict = {}
    if m := _KV_LINE.search(log_text):
        out.update(kv_cache_tokens=int(m.group(1)), kda_state_slots=int(m.group(2)),
                   max_concurrency_at_max_model_len=float(m.group(3)))
    if m := _SPEC_LINE.search(log_text):
        out["spec_state_memory"] = m.group(1)
    return out


def start_recorded(server: ServerProcess, timeout: float, record: dict, log) -> bool:
    """Start `server` (at least 1 s of timeout) and note the outcome in `record`: the start-up
    time, or status "refused" / "startup_timeout" with the error and the log tail. True if up."""
    try:
        record["server_startup_s"] = server.start(max(timeout, 1.0))
    except (RuntimeError, TimeoutError) as e:
        record["status"] = "refused" if server.refused else "startup_timeout"
        record["error"] = str(e)
        record["server_log_tail"] = server.log_tail()
        log(f"{record['status']}: {e}\n{record['server_log_tail']}")
        return False
    record["server_capacity"] = server.capacity()
    log(f"up after {record['server_startup_s']:.0f} s; {record['server_capacity']}")
    return True
