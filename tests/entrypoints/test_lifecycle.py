# SPDX-License-Identifier: Apache-2.0
"""The server's lifetime against a real `kdaserve serve` process (tiny model, CPU).

- 256 concurrent streams, half of which disconnect: one info line per disconnect, no
  traceback, and afterwards every KV block and state slot is free.
- Backpressure: a client that stops reading is aborted once its buffer limit is passed (its
  blocks and slots come back while its connection is still open) and a normal request is
  served meanwhile.
- SIGTERM with a client that never reads: the process exits within the graceful-shutdown
  timeout, a reading stream ends with an error event, and the log holds no exception.
- Killing the engine-core process: the in-flight stream ends with an error event and the server
  exits non-zero within 10 s (a supervisor restarts it).

A client that does not read is a raw socket with the smallest receive buffer and segment size,
so that the kernel absorbs little of the stream before the server's sends block.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import subprocess
import threading
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.entrypoints.conftest import RemoteServer

MAX_MODEL_LEN = 4096
READ_TOKENS = 4000
"""A request that the graceful timeout cuts short (seconds of generation on the CPU)."""
GRACEFUL_TIMEOUT = 3.0
STREAM_BUFFER_LIMIT = 8
DISCONNECT_LINE = "disconnected mid-stream"
STALLED_LINE = "its client has not read"


def _supports_additional_config() -> bool:
    from kdaserve.entrypoints.openai import cli_args

    parser = argparse.ArgumentParser()
    serve = cli_args.add_parser(parser.add_subparsers())
    return "--additional-config" in serve.format_help()


def _settings() -> tuple[list[str], float, int]:
    """(extra serve args, graceful timeout, stream buffer limit): small values through
    --additional-config where the CLI has it, else the server's defaults."""
    from kdaserve.entrypoints.openai import server

    if _supports_additional_config():
        config = {"graceful_shutdown_timeout": GRACEFUL_TIMEOUT,
                  "stream_buffer_limit": STREAM_BUFFER_LIMIT}
        return (["--additional-config", json.dumps(config)], GRACEFUL_TIMEOUT,
                STREAM_BUFFER_LIMIT)
    return [], server.GRACEFUL_SHUTDOWN_TIMEOUT_S, server.STREAM_BUFFER_LIMIT


def _start(tiny_model: str) -> tuple[RemoteServer, float, int]:
    extra, graceful, limit = _settings()
    srv = RemoteServer([tiny_model, "--served-model-name", "tiny", "--max-model-len",
                        str(MAX_MODEL_LEN), "--max-num-seqs", "64", "--seed", "0", *extra])
    return srv, graceful, limit


@pytest.fixture(scope="module")
def lifecycle(tiny_model):
    srv, graceful, limit = _start(tiny_model)
    yield srv, graceful, limit
    srv.stop()


def full_log(srv: RemoteServer) -> str:
    srv.log.flush()
    with open(srv.log_path) as f:
        return f.read()


def assert_no_exception(log: str) -> None:
    for marker in ("Traceback", "Exception", "ZMQError", "RuntimeError"):
        assert marker not in log, log[-4000:]


def wait_for(predicate, timeout: float, what: str, interval: float = 0.2):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(interval)


def scrape(url: str) -> dict[str, float]:
    values = {}
    for family in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=30).text):
        for sample in family.samples:
            values.setdefault(sample.name, sample.value)
    return values


def engine_is_idle(url: str) -> dict[str, float] | None:
    m = scrape(url)
    idle = (m["kdaserve:num_requests_running"] == 0
            and m["kdaserve:num_requests_waiting"] == 0
            and m["kdaserve:num_free_kv_blocks"] == m["kdaserve:num_total_kv_blocks"]
            and m["kdaserve:num_free_state_slots"] == m["kdaserve:num_total_state_slots"])
    return m if idle else None


def non_reading_stream(port: int, payload: dict) -> socket.socket:
    """POST a streaming completion and never read the answer."""
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1024)
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_MAXSEG, 88)
    s.connect(("127.0.0.1", port))
    body = json.dumps(payload).encode()
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
              b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
    return s


def stalling_payload(max_tokens: int = 1500) -> dict:
    # n samples with logprobs: each step writes a few KB, so the buffers fill in few steps
    return {"model": "tiny", "prompt": "never read", "stream": True, "ignore_eos": True,
            "max_tokens": max_tokens, "n": 4, "logprobs": 5}


def read_stream(url: str, payload: dict, started: threading.Event | None = None) -> list[str]:
    """A reading client: the stream's data events (the connection may end abruptly); sets
    `started` at the first one."""
    events = []
    try:
        with httpx.stream("POST", url + "/v1/completions", json=payload, timeout=120) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
                    if started is not None:
                        started.set()
    except httpx.RemoteProtocolError:
        pass
    return events


class Reader:
    """read_stream in a thread, for a long request (READ_TOKENS tokens)."""

    def __init__(self, url: str):
        self.started = threading.Event()
        self.events: list[str] = []
        payload = {"model": "tiny", "prompt": "reading", "stream": True, "ignore_eos": True,
                   "max_tokens": READ_TOKENS}
        self.thread = threading.Thread(target=self._run, args=(url, payload), daemon=True)
        self.thread.start()
        assert self.started.wait(60), "the reading stream did not start"

    def _run(self, url: str, payload: dict) -> None:
        self.events = read_stream(url, payload, self.started)

    def join(self) -> list[str]:
        self.thread.join(30)
        assert not self.thread.is_alive()
        return self.events


def engine_core_pid(server_pid: int) -> int:
    with open(f"/proc/{server_pid}/task/{server_pid}/children") as f:
        children = [int(pid) for pid in f.read().split()]
    for pid in children:
        with open(f"/proc/{pid}/cmdline") as f:
            if "spawn_main" in f.read():
                return pid
    raise AssertionError(f"no engine-core child among {children}")


# ------------------------------------------------------------------------------------ tests


async def _one(client: httpx.AsyncClient, i: int, disconnect: bool) -> dict:
    payload = {"model": "tiny", "stream": True, "ignore_eos": True, "temperature": 1.0,
               "seed": i, "max_tokens": 300 if disconnect else 8,
               "stream_options": {"include_usage": True}}
    if i % 2:
        path = "/v1/chat/completions"
        payload["messages"] = [{"role": "user", "content": f"request {i}"}]
    else:
        path = "/v1/completions"
        payload["prompt"] = f"request {i} says"
    events = []
    async with client.stream("POST", path, json=payload) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if line:
                events.append(line.removeprefix("data: "))
            if disconnect and len(events) >= 2:
                break  # leaving the context closes the connection mid-stream
    return {"disconnect": disconnect, "events": events}


def test_256_streams_half_disconnect_log_no_error_and_free_everything(lifecycle):
    srv, _, _ = lifecycle
    logged = full_log(srv).count(DISCONNECT_LINE)

    async def main():
        limits = httpx.Limits(max_connections=300, max_keepalive_connections=0)
        async with httpx.AsyncClient(base_url=srv.url, timeout=300, limits=limits) as client:
            return await asyncio.gather(*(_one(client, i, disconnect=i % 2 == 0)
                                          for i in range(256)))

    results = asyncio.run(main())
    kept = [r for r in results if not r["disconnect"]]
    assert len(kept) == 128
    for r in kept:
        assert r["events"][-1] == "[DONE]"
        assert json.loads(r["events"][-2])["usage"]["completion_tokens"] == 8
        assert not any('"error"' in e for e in r["events"])
    m = wait_for(lambda: engine_is_idle(srv.url), 60, "every block and slot to be free")
    assert m["kdaserve:kv_cache_usage_perc"] == 0.0
    log = full_log(srv)
    assert log.count(DISCONNECT_LINE) - logged == 128
    assert_no_exception(log)
    assert " ERROR " not in log and "ERROR:" not in log, log[-4000:]


def test_a_client_that_stops_reading_is_aborted_and_starves_no_one(lifecycle):
    srv, _, limit = lifecycle
    before = scrape(srv.url)
    stalled = [non_reading_stream(srv.port, stalling_payload()) for _ in range(2)]
    try:
        wait_for(lambda: scrape(srv.url)["kdaserve:num_requests_running"] > 0, 60,
                 "the stalled requests to run")
        # a normal request is served while the stalled ones are running or aborted
        events = read_stream(srv.url, {"model": "tiny", "prompt": "normal", "stream": True,
                                       "ignore_eos": True, "max_tokens": 16,
                                       "stream_options": {"include_usage": True}})
        assert events[-1] == "[DONE]"
        assert json.loads(events[-2])["usage"]["completion_tokens"] == 16
        # both stalled requests are aborted past their buffer limit, connections still open
        wait_for(lambda: full_log(srv).count(STALLED_LINE) >= 2, 120,
                 "both stalled requests to be aborted")
        m = wait_for(lambda: engine_is_idle(srv.url), 30, "every block and slot to be free")
        generated = (m["kdaserve:generation_tokens_total"]
                     - before["kdaserve:generation_tokens_total"])
        assert generated < 2 * 4 * 1500 // 2, generated
        assert f"not read {limit + 1} step outputs" in full_log(srv)
    finally:
        for s in stalled:
            s.close()
    assert_no_exception(full_log(srv))


def test_sigterm_with_a_non_reading_client_exits_within_the_graceful_timeout(lifecycle):
    srv, graceful, _ = lifecycle
    stalled = non_reading_stream(srv.port, stalling_payload(max_tokens=1900))
    try:
        # the stalled request is aborted: its response is blocked in a full send buffer
        seen = full_log(srv).count(STALLED_LINE)
        wait_for(lambda: full_log(srv).count(STALLED_LINE) > seen, 120,
                 "the non-reading request to be stalled")
        reader = Reader(srv.url)
        start = time.monotonic()
        srv.proc.send_signal(signal.SIGTERM)
        srv.proc.wait(graceful + 15)
        elapsed = time.monotonic() - start
        events = reader.join()
    finally:
        stalled.close()
    assert srv.proc.returncode == 0
    assert graceful - 0.5 <= elapsed < graceful + 5, elapsed
    # the stream that was read ends with an error event, not a cut connection
    assert events[-1] == "[DONE]"
    assert json.loads(events[-2])["error"]["message"] == "the server is shutting down"
    log = full_log(srv)
    assert_no_exception(log)
    assert "closing 1 connections whose clients do not read" in log


def test_engine_death_fails_the_streams_and_exits_nonzero(tiny_model):
    srv, _, _ = _start(tiny_model)
    try:
        stalled = non_reading_stream(srv.port, stalling_payload())
        reader = Reader(srv.url)
        os.kill(engine_core_pid(srv.proc.pid), signal.SIGKILL)
        start = time.monotonic()
        try:
            srv.proc.wait(10)
        except subprocess.TimeoutExpired:
            pytest.fail("the server is still up 10 s after its engine died")
        elapsed = time.monotonic() - start
        events = reader.join()
        stalled.close()
        assert srv.proc.returncode == 1
        assert elapsed < 10
        assert events[-1] == "[DONE]"
        error = json.loads(events[-2])["error"]
        assert "the engine process died" in error["message"] and error["code"] is None
        log = full_log(srv)
        assert "the engine is dead" in log
        assert_no_exception(log)
    finally:
        srv.stop()
