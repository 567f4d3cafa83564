"""Prefill/decode disaggregation end to end on loopback (UCX over TCP): a kv_producer and a
kv_consumer server with the tiny model, and `kdaserve proxy` in front.

Greedy output through the proxy equals the decode server answering alone (the same code path
as a single server) for 32 mixed requests, completions and chat, streaming and not; transfers
are counted on /metrics and neither side keeps a block or slot afterwards. Failure cases use a
prefill server of their own: a hold nobody pulls is freed by its timeout; a prefill killed
after answering makes the decode side recompute (same output, nothing leaked)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kdaserve.disagg.nixl.worker import import_nixl
from tests.entrypoints.conftest import REPO, RemoteServer, free_port

try:
    import_nixl()
except RuntimeError:   # the test extra installs nixl-cu12; a GPU image may carry none
    pytest.skip("NIXL is not installed", allow_module_level=True)

UCX_ENV = {"UCX_TLS": "tcp", "UCX_NET_DEVICES": "lo"}
MAX_LEN = 512
WORDS = ("alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi "
         "rho sigma tau upsilon phi chi psi omega").split()


def kv_config(role: str, top: dict | None = None, **extra) -> str:
    cfg = {"kv_connector": "NixlConnector", "kv_role": role, **(top or {})}
    if extra:
        cfg["kv_connector_extra_config"] = extra
    return json.dumps(cfg)


def serve_args(model: str, role: str, top: dict | None = None, **extra) -> list[str]:
    return [model, "--max-model-len", str(MAX_LEN), "--max-num-seqs", "16", "--seed", "0",
            "--served-model-name", "tiny", "--kv-transfer-config", kv_config(role, top, **extra)]


class ProxyProcess:
    def __init__(self, prefill: list[str], decode: list[str], timeout: float = 600.0):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = f"/tmp/kdaserve-test-proxy-{self.port}.log"
        self.log = open(self.log_path, "w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kdaserve.entrypoints.cli", "proxy", "--prefill", *prefill,
             "--decode", *decode, "--port", str(self.port), "--timeout", str(timeout)],
            stdout=self.log, stderr=subprocess.STDOUT, cwd=REPO,
            env=dict(os.environ, PYTHONPATH=REPO))
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(self.url + "/v1/models", timeout=1.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"proxy did not start: {open(self.log_path).read()}")
            time.sleep(0.2)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self.log.close()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    from kdaserve.models.make_model import make_model

    return make_model(str(tmp_path_factory.mktemp("pd_tiny")), preset="tiny")


@pytest.fixture(scope="module")
def pd(tiny):
    """(prefill, decode, proxy) shared by the module's tests."""
    # generous timeouts: a loaded CI machine must not turn a pull into a recompute here
    prefill = RemoteServer(serve_args(tiny, "kv_producer", hold_timeout_s=300.0), env=UCX_ENV)
    decode = RemoteServer(serve_args(tiny, "kv_consumer", load_timeout_s=120.0), env=UCX_ENV)
    proxy = ProxyProcess([prefill.url], [decode.url])
    yield prefill, decode, proxy
    proxy.stop()
    prefill.stop()
    decode.stop()


def scrape(url: str) -> dict[str, float]:
    values = {}
    for family in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=30).text):
        for sample in family.samples:
            values.setdefault(sample.name, sample.value)
    return values


def wait_idle(url: str, timeout: float = 30.0) -> dict[str, float]:
    """Metrics once every block and slot is free and nothing is held or loading."""
    deadline = time.monotonic() + timeout
    while True:
        m = scrape(url)
        if ((m["kdaserve:num_free_kv_blocks"] == m["kdaserve:num_total_kv_blocks"]
             and m["kdaserve:num_free_state_slots"] == m["kdaserve:num_total_state_slots"]
             and m["kdaserve:kv_transfer_num_held"] == 0
             and m["kdaserve:kv_transfer_num_loading"] == 0
             and m["kdaserve:num_requests_running"] == 0)
                or time.monotonic() > deadline):
            return m
        time.sleep(0.2)


def assert_idle(m: dict[str, float]) -> None:
    assert m["kdaserve:num_free_kv_blocks"] == m["kdaserve:num_total_kv_blocks"], m
    assert m["kdaserve:num_free_state_slots"] == m["kdaserve:num_total_state_slots"], m
    assert m["kdaserve:kv_transfer_num_held"] == 0 and m["kdaserve:kv_transfer_num_loading"] == 0


def prompt(i: int) -> str:
    n = 3 + (i * 37) % 48      # 3 .. 50 words (~7 .. 120 tokens): 1 .. 8 blocks
    return " ".join(WORDS[(i + k) % len(WORDS)] for k in range(n))


def request(i: int) -> tuple[str, dict]:
    body = {"model": "tiny", "temperature": 0.0, "max_tokens": 4 + i % 4, "ignore_eos": True,
            "stream": i % 2 == 1}
    if i % 4 < 2:
        return "/v1/completions", body | {"prompt": prompt(i)}
    return "/v1/chat/completions", body | {"messages": [{"role": "user", "content": prompt(i)}]}


async def call(client: httpx.AsyncClient, base: str, path: str, body: dict) -> str:
    """The answer's text (content for chat), streamed or not; raises on any error."""
    if not body.get("stream"):
        r = await client.post(base + path, json=body)
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        return choice["text"] if "text" in choice else choice["message"]["content"]
    text = ""
    async with client.stream("POST", base + path, json=body) as r:
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            assert "error" not in chunk, chunk
            for c in chunk["choices"]:
                text += c.get("text") or (c.get("delta") or {}).get("content") or ""
    return text


def run_all(base: str, reqs: list[tuple[str, dict]], concurrency: int = 16) -> list[str]:
    async def main():
        sem = asyncio.Semaphore(concurrency)
        async with httpx.AsyncClient(timeout=600) as client:
            async def one(path, body):
                async with sem:
                    return await call(client, base, path, body)
            return await asyncio.gather(*(one(p, b) for p, b in reqs))
    return asyncio.run(main())


def test_proxy_equals_single_server(pd):
    prefill, decode, proxy = pd
    reqs = [request(i) for i in range(32)]
    expected = run_all(decode.url, reqs)       # the decode server alone: a single server
    before = scrape(decode.url)
    got = run_all(proxy.url, reqs)
    for i, (a, b) in enumerate(zip(got, expected)):
        assert a == b, (i, reqs[i], a, b)
    m = wait_idle(decode.url)
    assert_idle(m)
    loads = m["kdaserve:kv_transfer_loads_total"] - before["kdaserve:kv_transfer_loads_total"]
    assert loads == 32, m
    assert m["kdaserve:kv_transfer_failures_total"] == before[
        "kdaserve:kv_transfer_failures_total"]
    assert m["kdaserve:kv_transfer_bytes_total"] > before["kdaserve:kv_transfer_bytes_total"]
    assert m["kdaserve:kv_transfer_seconds_total"] > 0
    p = wait_idle(prefill.url)
    assert_idle(p)
    assert p["kdaserve:kv_transfer_sends_total"] >= 32 and p[
        "kdaserve:kv_transfer_expired_total"] == 0


def test_staged_proxy_equals_single_server(tiny):
    """Both instances with kv_buffer_device "cpu" (pulls through host buffers): the same
    answers as one server, every pull a load, nothing left held or allocated."""
    top = {"kv_buffer_device": "cpu", "kv_buffer_size": 2**22}
    prefill = RemoteServer(serve_args(tiny, "kv_producer", top, hold_timeout_s=300.0),
                           env=UCX_ENV)
    decode = RemoteServer(serve_args(tiny, "kv_consumer", top, load_timeout_s=120.0),
                          env=UCX_ENV)
    proxy = ProxyProcess([prefill.url], [decode.url])
    try:
        reqs = [request(i) for i in range(16)]
        expected = run_all(decode.url, reqs)
        got = run_all(proxy.url, reqs)
        for i, (a, b) in enumerate(zip(got, expected)):
            assert a == b, (i, reqs[i], a, b)
        m = wait_idle(decode.url)
        assert_idle(m)
        assert m["kdaserve:kv_transfer_loads_total"] == 16, m
        assert m["kdaserve:kv_transfer_failures_total"] == 0
        p = wait_idle(prefill.url)
        assert_idle(p)
        assert p["kdaserve:kv_transfer_sends_total"] >= 16
    finally:
        proxy.stop()
        prefill.stop()
        decode.stop()


def test_first_token_ends_the_request(pd):
    """max_tokens=1: the decode side answers with the prefill's token, pulls nothing and
    releases the prefill's hold at once (long before its timeout)."""
    prefill, decode, proxy = pd
    body = {"model": "tiny", "prompt": prompt(5), "max_tokens": 1, "temperature": 0.0}
    before = scrape(decode.url)
    direct = httpx.post(decode.url + "/v1/completions", json=body, timeout=60).json()
    via = httpx.post(proxy.url + "/v1/completions", json=body, timeout=60).json()
    assert via["choices"][0]["text"] == direct["choices"][0]["text"]
    assert via["usage"]["completion_tokens"] == 1
    assert_idle(wait_idle(prefill.url, timeout=10))
    after = scrape(decode.url)
    assert after["kdaserve:kv_transfer_loads_total"] == before["kdaserve:kv_transfer_loads_total"]


def test_kv_transfer_params_checked(pd):
    prefill, decode, _ = pd
    body = {"model": "tiny", "prompt": "hi", "max_tokens": 2}
    r = httpx.post(decode.url + "/v1/completions", timeout=30,
                   json=body | {"kv_transfer_params": {"do_remote_prefill": True}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "kv_transfer_params"
    r = httpx.post(decode.url + "/v1/completions", timeout=30,
                   json=body | {"kv_transfer_params": {"do_remote_decode": True}})
    assert r.status_code == 400 and "kv_consumer" in r.json()["error"]["message"]
    r = httpx.post(prefill.url + "/v1/completions", timeout=30,
                   json=body | {"prompt": ["a", "b"],
                                "kv_transfer_params": {"do_remote_decode": True}})
    assert r.status_code == 400 and "one prompt" in r.json()["error"]["message"]


def test_proxy_errors(pd, tiny):
    prefill, decode, proxy = pd
    r = httpx.post(proxy.url + "/v1/completions", timeout=30,
                   json={"model": "nope", "prompt": "hi", "max_tokens": 2})
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
    dead = f"http://127.0.0.1:{free_port()}"
    broken = ProxyProcess([dead], [decode.url], timeout=5.0)
    try:
        r = httpx.post(broken.url + "/v1/completions", timeout=30,
                       json={"model": "tiny", "prompt": "hi", "max_tokens": 2})
        assert r.status_code == 502 and "unreachable" in r.json()["error"]["message"]
        r = httpx.post(broken.url + "/v1/completions", timeout=30,
                       json={"model": "tiny", "prompt": "hi", "max_tokens": 2, "stream": True})
        assert r.status_code == 502
    finally:
        broken.stop()


def test_hold_timeout_then_killed_prefill(pd, tiny):
    """A prefill of its own (hold_timeout_s=4): a hold nobody pulls is freed by the timeout;
    then a prefill killed after answering makes the decode side recompute the request."""
    _, decode, _ = pd
    own = RemoteServer(serve_args(tiny, "kv_producer", hold_timeout_s=4.0), env=UCX_ENV)
    try:
        body = {"model": "tiny", "prompt": prompt(7), "max_tokens": 1, "temperature": 0.0,
                "kv_transfer_params": {"do_remote_decode": True}}
        r = httpx.post(own.url + "/v1/completions", json=body, timeout=60).json()
        assert r["kv_transfer_params"]["do_remote_prefill"]
        m = scrape(own.url)
        assert m["kdaserve:kv_transfer_num_held"] == 1
        assert m["kdaserve:num_free_kv_blocks"] < m["kdaserve:num_total_kv_blocks"]
        assert m["kdaserve:num_free_state_slots"] < m["kdaserve:num_total_state_slots"]
        m = wait_idle(own.url, timeout=20)
        assert_idle(m)
        assert m["kdaserve:kv_transfer_expired_total"] == 1

        # one good pull from this prefill (the decode side then knows its agent)
        plain = {"model": "tiny", "prompt": prompt(8), "max_tokens": 5, "temperature": 0.0,
                 "ignore_eos": True}
        expected = httpx.post(decode.url + "/v1/completions", json=plain, timeout=60).json()
        params = httpx.post(own.url + "/v1/completions", timeout=60, json=plain | {
            "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}}).json()
        got = httpx.post(decode.url + "/v1/completions", timeout=60, json=plain | {
            "kv_transfer_params": params["kv_transfer_params"]}).json()
        assert got["choices"][0]["text"] == expected["choices"][0]["text"]

        before = scrape(decode.url)
        plain["prompt"] = prompt(9)
        expected = httpx.post(decode.url + "/v1/completions", json=plain, timeout=60).json()
        params = httpx.post(own.url + "/v1/completions", timeout=60, json=plain | {
            "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}}).json()
        own.kill()
        got = httpx.post(decode.url + "/v1/completions", timeout=60, json=plain | {
            "kv_transfer_params": params["kv_transfer_params"]}).json()
        assert got["choices"][0]["text"] == expected["choices"][0]["text"]
        m = wait_idle(decode.url)
        assert_idle(m)
        # the failure is counted in the stats snapshot after the failed load's step: poll
        want = before["kdaserve:kv_transfer_failures_total"] + 1
        deadline = time.monotonic() + 20
        while m["kdaserve:kv_transfer_failures_total"] < want and time.monotonic() < deadline:
            time.sleep(0.2)
            m = scrape(decode.url)
        assert m["kdaserve:kv_transfer_failures_total"] == want
    finally:
        own.stop()
