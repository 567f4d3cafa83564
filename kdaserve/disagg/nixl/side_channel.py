"""The producer's side channel (ZMQ REQ/REP over TCP): a consumer fetches a rank's agent
metadata and cache layout from it once per producer (the handshake), tells it which held
requests it will never pull (releases), so they are freed before their hold times out, and,
with host staging (kv_buffer_device "cpu"), asks it to stage a request before reading it."""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from typing import Any

import msgspec
import zmq

logger = logging.getLogger(__name__)

_POLL_MS = 100


class SideChannelServer:
    """A daemon thread answering {"op": "meta"} with the metadata blob, {"op": "release",
    "ids": [...]} by queueing the ids (`take_released`), and {"op": "stage", ...} with what
    `stage(msg)` returns (a dict; runs on this thread)."""

    def __init__(self, host: str, port: int, metadata: dict[str, Any],
                 stage: Callable[[dict[str, Any]], dict[str, Any]] | None = None) -> None:
        self._blob = msgspec.msgpack.encode(metadata)
        self._stage = stage
        self._released: queue.SimpleQueue[str] = queue.SimpleQueue()
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.REP)
        self._sock.setsockopt(zmq.LINGER, 0)
        addr = f"tcp://{host}"
        self.port = (self._sock.bind_to_random_port(addr) if port == 0
                     else (self._sock.bind(f"{addr}:{port}"), port)[1])
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="kdaserve-kv-side-channel",
                                        daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        while not self._stop.is_set():
            if not poller.poll(_POLL_MS):
                continue
            try:
                msg = msgspec.msgpack.decode(self._sock.recv())
                if msg.get("op") == "meta":
                    self._sock.send(self._blob)
                elif msg.get("op") == "release":
                    for rid in msg.get("ids", []):
                        self._released.put(str(rid))
                    self._sock.send(b"ok")
                elif msg.get("op") == "stage" and self._stage is not None:
                    self._sock.send(msgspec.msgpack.encode(self._stage(msg)))
                else:
                    self._sock.send(b"unknown op")
            except Exception:  # noqa: BLE001 - one bad message must not stop the channel
                logger.exception("kv side channel: bad message")
                try:
                    self._sock.send(b"error")
                except zmq.ZMQError:
                    pass
        self._sock.close(linger=0)
        self._ctx.term()

    def take_released(self) -> list[str]:
        ids = []
        while True:
            try:
                ids.append(self._released.get_nowait())
            except queue.Empty:
                return ids

    def close(self) -> None:
        self._stop.set()
        self._thread.join(2 * _POLL_MS / 1000)


def request(host: str, port: int, msg: dict[str, Any], timeout_s: float) -> bytes:
    """One request/reply with a producer's side channel; TimeoutError when it does not answer
    in time (a dead or unreachable producer)."""
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.REQ)
    sock.setsockopt(zmq.LINGER, 0)
    ms = max(1, int(timeout_s * 1000))
    sock.setsockopt(zmq.RCVTIMEO, ms)
    sock.setsockopt(zmq.SNDTIMEO, ms)
    try:
        sock.connect(f"tcp://{host}:{port}")
        sock.send(msgspec.msgpack.encode(msg))
        return sock.recv()
    except zmq.Again:
        raise TimeoutError(f"the KV side channel at {host}:{port} did not answer in "
                           f"{timeout_s:g} s") from None
    finally:
        sock.close(linger=0)


def fetch_metadata(host: str, port: int, timeout_s: float) -> dict[str, Any]:
    return msgspec.msgpack.decode(request(host, port, {"op": "meta"}, timeout_s))


def send_release(host: str, port: int, ids: list[str], timeout_s: float) -> None:
    request(host, port, {"op": "release", "ids": ids}, timeout_s)


def request_stage(host: str, port: int, msg: dict[str, Any], timeout_s: float) -> dict[str, Any]:
    """Ask a producer rank to stage a request: {"addr", "nbytes", "token"} or {"error"}."""
    reply = request(host, port, {"op": "stage", **msg}, timeout_s)
    try:
        out = msgspec.msgpack.decode(reply)
    except msgspec.DecodeError:
        out = None
    if not isinstance(out, dict):
        raise RuntimeError(f"the producer at {host}:{port} cannot stage requests "
                           f"(answered {reply[:40]!r})")
    return out
