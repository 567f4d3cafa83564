"""Prefill/decode disaggregation at tensor_parallel_size=2 on both sides (CPU: gloo between a
server's ranks, UCX over TCP between the servers): each consumer rank pulls the replicated
latent KV from the producer's rank 0 and its own KDA state shard from the producer's rank of
its index, and a transfer counts as done only once both ranks are done with it. Greedy output
through the proxy equals the decode server answering alone; neither side keeps a block or a
slot afterwards."""

from __future__ import annotations

import pytest

from tests.disagg.test_pd_serving import (UCX_ENV, ProxyProcess, assert_idle, request,
                                          run_all, scrape, serve_args, wait_idle)
from tests.entrypoints.conftest import RemoteServer

pytestmark = pytest.mark.timeout(900)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    from kdaserve.models.make_model import make_model

    return make_model(str(tmp_path_factory.mktemp("pd_tp_tiny")), preset="tiny")


def test_tp2_proxy_equals_single_server(tiny):
    tp = ["--tensor-parallel-size", "2"]
    prefill = RemoteServer(serve_args(tiny, "kv_producer", hold_timeout_s=300.0) + tp,
                           env=UCX_ENV, startup_timeout=300.0)
    decode = proxy = None
    try:
        decode = RemoteServer(serve_args(tiny, "kv_consumer", load_timeout_s=120.0) + tp,
                              env=UCX_ENV, startup_timeout=300.0)
        proxy = ProxyProcess([prefill.url], [decode.url])
        reqs = [request(i) for i in range(12)]
        expected = run_all(decode.url, reqs, concurrency=6)
        got = run_all(proxy.url, reqs, concurrency=6)
        for i, (a, b) in enumerate(zip(got, expected)):
            assert a == b, (i, reqs[i], a, b)
        m = wait_idle(decode.url)
        assert_idle(m)
        assert m["kdaserve:kv_transfer_loads_total"] == 12, decode.logs()
        assert m["kdaserve:kv_transfer_failures_total"] == 0
        p = wait_idle(prefill.url)
        assert_idle(p)
        assert p["kdaserve:kv_transfer_sends_total"] == 12
        assert p["kdaserve:kv_transfer_expired_total"] == 0
    finally:
        for s in (proxy, decode, prefill):
            if s is not None:
                s.stop()
