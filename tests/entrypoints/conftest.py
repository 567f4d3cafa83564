# SPDX-License-Identifier: Apache-2.0
"""A real `kdaserve serve` process on loopback with the tiny random model, shared per session."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest

API_KEY = "test-key"
MAX_MODEL_LEN = 512
BODY_LIMIT = 256 * 1024
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _descendants(pid: int) -> list[int]:
    """Every live process under pid (children first found, from /proc's parent links)."""
    parents: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        parents.setdefault(ppid, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        for child in parents.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def _zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


class RemoteServer:
    """`python -m kdaserve.entrypoints.cli serve ...` in a subprocess; stopped with SIGTERM."""

    def __init__(self, args: list[str], env: dict[str, str] | None = None,
                 startup_timeout: float = 180.0):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        full_env = dict(os.environ, OMP_NUM_THREADS="2", MKL_NUM_THREADS="2",
                        TOKENIZERS_PARALLELISM="false", PYTHONPATH=REPO, **(env or {}))
        self.log_path = f"/tmp/kdaserve-test-server-{self.port}.log"
        self.log = open(self.log_path, "w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kdaserve.entrypoints.cli", "serve", *args,
             "--port", str(self.port), "--disable-uvicorn-access-log"],
            stdout=self.log, stderr=subprocess.STDOUT, env=full_env, cwd=REPO)
        deadline = time.monotonic() + startup_timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.logs()}")
            try:
                if httpx.get(self.url + "/health", timeout=1.0).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"server did not start:\n{self.logs()}")
            time.sleep(0.25)

    def logs(self) -> str:
        if not self.log.closed:
            self.log.flush()
        if not os.path.exists(self.log_path):
            return ""
        with open(self.log_path) as f:
            return f.read()[-5000:]

    def kill(self) -> None:
        """SIGKILL the server and every process under it (the engine core, its ranks) and wait
        until they are gone: the instance dies at once, as in a crash. Killing the server alone
        leaves the engine core running until it notices its parent is gone, long enough to
        still serve a KV pull."""
        pids = _descendants(self.proc.pid) + [self.proc.pid]
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.proc.wait(10)
        deadline = time.monotonic() + 10
        while any(os.path.exists(f"/proc/{pid}") and not _zombie(pid) for pid in pids) \
                and time.monotonic() < deadline:
            time.sleep(0.05)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        if not self.log.closed:
            self.log.close()
            if self.proc.returncode == 0:
                os.unlink(self.log_path)

    def client(self, **kwargs):
        import openai

        return openai.OpenAI(base_url=self.url + "/v1", api_key=API_KEY, max_retries=0,
                             timeout=120.0, **kwargs)

    def async_client(self, **kwargs):
        import openai

        return openai.AsyncOpenAI(base_url=self.url + "/v1", api_key=API_KEY, max_retries=0,
                                  timeout=120.0, **kwargs)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> str:
    from kdaserve.models.make_model import make_model

    return make_model(str(tmp_path_factory.mktemp("entrypoints_tiny")), preset="tiny")


@pytest.fixture(scope="session")
def server(tiny_model):
    srv = RemoteServer([tiny_model, "--api-key", API_KEY, "--max-model-len",
                        str(MAX_MODEL_LEN), "--max-num-seqs", "64",
                        "--reasoning-parser", "kimi_k2", "--tool-call-parser", "kimi_k2",
                        "--enable-auto-tool-choice", "--served-model-name", tiny_model, "tiny",
                        "--additional-config", json.dumps({"max_request_body_bytes": BODY_LIMIT}),
                        "--seed", "0"])
    yield srv
    srv.stop()


@pytest.fixture(scope="session")
def tokenizer(tiny_model):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model)
