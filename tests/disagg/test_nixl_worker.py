"""The NIXL connector's worker side: a producer and a consumer in one process over loopback
(UCX over TCP): a load copies exactly the request's MLA blocks and KDA state slot, the
producer learns of the pull by its notification, layouts that cannot exchange state are
refused at the handshake, and an unreachable producer or a missed deadline fails the load."""

from __future__ import annotations

import os
import socket
import time

import pytest
import torch

if not torch.cuda.is_available():
    # CPU machines: loopback TCP only. With a GPU, UCX keeps its defaults: restricted to tcp it
    # cannot create its backend next to a CUDA context (seen on the H200).
    os.environ.setdefault("UCX_TLS", "tcp")
    os.environ.setdefault("UCX_NET_DEVICES", "lo")

from kdaserve.config import KVTransferConfig  # noqa: E402
from kdaserve.disagg.nixl.metadata import LoadSpec, NixlConnectorMetadata  # noqa: E402
from kdaserve.disagg.params import RemotePrefill, RemoteRef  # noqa: E402
from kdaserve.disagg.nixl.worker import NixlConnectorWorker, import_nixl  # noqa: E402

try:
    import_nixl()
except RuntimeError:   # the test extra installs nixl-cu12; a GPU image may carry none
    pytest.skip("NIXL is not installed", allow_module_level=True)

BS, NB, NS, KV, H, D, W = 4, 16, 6, 12, 2, 4, 4


def caches(seed: int, kv_dim: int = KV, num_mla: int = 2, num_kda: int = 3):
    g = torch.Generator().manual_seed(seed)
    mla = [torch.randn(NB, BS, kv_dim, generator=g) for _ in range(num_mla)]
    rec = [torch.randn(NS + 2, H, D, D, generator=g) for _ in range(num_kda)]
    conv = [torch.randn(NS + 2, 3 * H * D, W - 1, generator=g) for _ in range(num_kda)]
    return mla, rec, conv


def worker(role: str, engine_id: str, tensors, tp_size: int = 1, buffer: str = "cuda",
           tp_rank: int = 0, **extra):
    kvt = KVTransferConfig("NixlConnector", role, engine_id=engine_id,
                           kv_connector_extra_config={"handshake_timeout_s": 2.0, **extra},
                           kv_buffer_device=buffer, kv_buffer_size=2**20)
    w = NixlConnectorWorker(kvt, BS, tp_rank, tp_size)
    w.register_caches(*tensors, NB, NS)
    return w


@pytest.fixture(scope="module")
def producer():
    tensors = caches(1)
    w = worker("kv_producer", "prod", tensors)
    yield w, tensors
    w.shutdown()


def spec(req_id: str, port: int, remote_blocks, local_blocks, remote_slot, local_slot,
         deadline: float, tp_size: int = 1, engine: str = "prod") -> LoadSpec:
    remote = RemotePrefill(RemoteRef(engine, "127.0.0.1", (port,) * tp_size, req_id), tp_size,
                           tuple(remote_blocks), remote_slot, len(remote_blocks) * BS, "h", 5,
                           60.0)
    return LoadSpec(req_id, remote, list(local_blocks), local_slot, deadline)


def wait_finished(w: NixlConnectorWorker, key: str, ids: set[str], timeout: float = 20.0):
    got = set()
    deadline = time.monotonic() + timeout
    while got != ids and time.monotonic() < deadline:
        out = w.get_finished()
        got |= getattr(out, key)
        time.sleep(0.005)
    return got


def assert_copied(prod, cons, before) -> None:
    """Producer blocks 3, 4, 9 and slot 2 landed in consumer blocks 7, 0, 1 and slot 5; every
    other block and slot of the consumer is untouched."""
    (p_mla, p_rec, p_conv), (c_mla, c_rec, c_conv) = prod, cons
    for layer in range(2):
        for rb, lb in zip([3, 4, 9], [7, 0, 1]):
            assert torch.equal(c_mla[layer][lb], p_mla[layer][rb])
        others = [b for b in range(NB) if b not in (7, 0, 1)]
        assert torch.equal(c_mla[layer][others], before[layer][others])
    for layer in range(3):
        assert torch.equal(c_rec[layer][5], p_rec[layer][2])
        assert torch.equal(c_conv[layer][5], p_conv[layer][2])
        keep = [s for s in range(NS + 2) if s != 5]
        assert torch.equal(c_rec[layer][keep], before[2 + layer][keep])
        assert torch.equal(c_conv[layer][keep], before[5 + layer][keep])


def test_load_copies_blocks_and_state(producer):
    prod, p_tensors = producer
    tensors = caches(2)
    cons = worker("kv_consumer", "cons", tensors)
    before = [t.clone() for t in sum(tensors, [])]
    # producer holds its request "r1" (blocks 3, 4, 9 and slot 2) before the pull starts
    prod.start_step(NixlConnectorMetadata(holds={"r1": time.monotonic() + 60}))
    cons.start_step(NixlConnectorMetadata(loads=[spec("r1", prod.side_channel_port,
                                                      [3, 4, 9], [7, 0, 1], 2, 5,
                                                      time.monotonic() + 20)]))
    assert cons.wait_for_loads(20.0)
    assert cons.get_finished().finished_recving == {"r1"}
    assert_copied(p_tensors, tensors, before)
    # the READ's notification reaches the producer: the hold is done
    assert wait_finished(prod, "finished_sending", {"r1"}) == {"r1"}
    cons.shutdown()


def test_acknowledgement_before_the_hold_is_known(producer):
    prod, _ = producer
    cons = worker("kv_consumer", "cons2", caches(3))
    cons.start_step(NixlConnectorMetadata(loads=[spec("r2", prod.side_channel_port, [1], [2],
                                                      0, 1, time.monotonic() + 20)]))
    assert wait_finished(cons, "finished_recving", {"r2"}) == {"r2"}
    time.sleep(0.2)
    assert prod.get_finished().finished_sending == set()   # not held (yet): kept aside
    prod.start_step(NixlConnectorMetadata(holds={"r2": time.monotonic() + 60}))
    assert prod.get_finished().finished_sending == {"r2"}
    cons.shutdown()


def test_release_over_the_side_channel(producer):
    prod, _ = producer
    cons = worker("kv_consumer", "cons3", caches(4))
    prod.start_step(NixlConnectorMetadata(holds={"r3": time.monotonic() + 60}))
    cons.start_step(NixlConnectorMetadata(releases=[
        RemoteRef("prod", "127.0.0.1", (prod.side_channel_port,), "r3")]))
    assert wait_finished(prod, "finished_sending", {"r3"}) == {"r3"}
    cons.shutdown()


@pytest.mark.parametrize("case", ["kv_dim", "num_layers", "tp_size"])
def test_handshake_refuses_another_layout(producer, case, caplog):
    prod, (p_mla, _, _) = producer
    if case == "kv_dim":
        cons = worker("kv_consumer", f"c-{case}", caches(5, kv_dim=KV + 4))
    elif case == "num_layers":
        cons = worker("kv_consumer", f"c-{case}", caches(5, num_kda=2))
    else:
        cons = worker("kv_consumer", f"c-{case}", caches(5), tp_size=1)
    tp = 2 if case == "tp_size" else 1
    cons.start_step(NixlConnectorMetadata(loads=[spec(f"x-{case}", prod.side_channel_port,
                                                      [1], [1], 0, 0, time.monotonic() + 20,
                                                      tp_size=tp)]))
    with caplog.at_level("WARNING"):
        assert wait_finished(cons, "failed_recving", {f"x-{case}"}) == {f"x-{case}"}
    want = {"kv_dim": "mla cache", "num_layers": "kda_recurrent cache",
            "tp_size": "tensor_parallel_size=2, this one 1"}[case]
    assert want in caplog.text
    cons.shutdown()


def test_unreachable_producer_fails_the_load():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]    # nobody listens here
    cons = worker("kv_consumer", "c-dead", caches(6), handshake_timeout_s=0.5)
    t0 = time.monotonic()
    cons.start_step(NixlConnectorMetadata(loads=[spec("d1", port, [1], [1], 0, 0,
                                                      time.monotonic() + 20, engine="dead")]))
    assert wait_finished(cons, "failed_recving", {"d1"}) == {"d1"}
    assert time.monotonic() - t0 < 5
    cons.shutdown()


def test_deadline_fails_the_load(producer):
    prod, _ = producer
    cons = worker("kv_consumer", "c-late", caches(7))
    cons.start_step(NixlConnectorMetadata(loads=[spec("late", prod.side_channel_port, [1], [1],
                                                      0, 0, time.monotonic() - 1)]))
    assert wait_finished(cons, "failed_recving", {"late"}) == {"late"}
    cons.shutdown()


@pytest.mark.parametrize("buffer", ["cuda", "cpu"])
def test_tp2_state_shards_and_one_mla_source(buffer):
    """Two ranks a side: each consumer rank reads the (replicated) MLA blocks from producer
    rank 0 and its own KDA state shard from the producer rank of its index; producer rank 0
    is done after both consumer ranks' reads, rank 1 after its one. Also through host
    buffers (kv_buffer_device "cpu")."""
    prod_tensors = [caches(10), caches(11)]
    prods = [worker("kv_producer", f"tp-prod-{buffer}", prod_tensors[r], 2, buffer, r)
             for r in range(2)]
    ports = tuple(w.side_channel_port for w in prods)
    cons_tensors = [caches(12), caches(13)]
    conss = [worker("kv_consumer", f"tp-cons-{buffer}", cons_tensors[r], 2, buffer, r)
             for r in range(2)]
    try:
        for w in prods:
            w.start_step(NixlConnectorMetadata(holds={"t1": time.monotonic() + 60}))
        remote = RemotePrefill(RemoteRef(f"tp-prod-{buffer}", "127.0.0.1", ports, "t1"), 2,
                               (2, 3), 4, 8, "h", 5, 60.0)
        for w in conss:
            w.start_step(NixlConnectorMetadata(loads=[
                LoadSpec("t1", remote, [5, 6], 1, time.monotonic() + 20)]))
        for w in conss:
            assert wait_finished(w, "finished_recving", {"t1"}) == {"t1"}
        p_mla = prod_tensors[0][0]
        for r in range(2):
            c_mla, c_rec, c_conv = cons_tensors[r]
            _, p_rec, p_conv = prod_tensors[r]
            for layer in range(2):
                assert torch.equal(c_mla[layer][[5, 6]], p_mla[layer][[2, 3]])
            for layer in range(3):
                assert torch.equal(c_rec[layer][1], p_rec[layer][4])
                assert torch.equal(c_conv[layer][1], p_conv[layer][4])
        # rank 1's MLA blocks came from producer rank 0, not from producer rank 1
        assert not torch.equal(cons_tensors[1][0][0][5], prod_tensors[1][0][0][2])
        for w in prods:
            assert wait_finished(w, "finished_sending", {"t1"}) == {"t1"}
        if buffer == "cpu":   # every extent on both sides was freed
            assert all(w._extents.used_bytes == 0 for w in prods + conss)
    finally:
        for w in conss + prods:
            w.shutdown()


# ---------------------------------------------------------------------------------------------
# host staging (kv_buffer_device "cpu")
# ---------------------------------------------------------------------------------------------


def test_extent_pool_first_fit_and_merge():
    from kdaserve.disagg.nixl.staging import ExtentPool

    pool = ExtentPool(1024)
    a, b, c = pool.alloc(100), pool.alloc(200), pool.alloc(300)
    assert (a, b, c) == (0, 112, 320)            # 16-byte rounded, first fit
    assert pool.alloc(500) is None               # 1024 - 624 = 400 left
    pool.free(b)
    assert pool.alloc(150) == 112                # the hole b left
    pool.free(a)
    pool.free(112)
    pool.free(c)
    assert pool.used_bytes == 0 and pool.alloc(1024) == 0   # holes merged back into one


@pytest.fixture(scope="module")
def staged_producer():
    tensors = caches(21)
    w = worker("kv_producer", "sprod", tensors, buffer="cpu")
    yield w, tensors
    w.shutdown()


def test_staged_load_copies_blocks_and_state(staged_producer):
    prod, p_tensors = staged_producer
    tensors = caches(22)
    cons = worker("kv_consumer", "scons", tensors, buffer="cpu")
    before = [t.clone() for t in sum(tensors, [])]
    prod.start_step(NixlConnectorMetadata(holds={"s1": time.monotonic() + 60}))
    cons.start_step(NixlConnectorMetadata(loads=[spec("s1", prod.side_channel_port,
                                                      [3, 4, 9], [7, 0, 1], 2, 5,
                                                      time.monotonic() + 20, engine="sprod")]))
    assert cons.wait_for_loads(20.0)
    assert cons.get_finished().finished_recving == {"s1"}
    assert_copied(p_tensors, tensors, before)
    assert wait_finished(prod, "finished_sending", {"s1"}) == {"s1"}
    # the acknowledgement freed the producer's extent; the consumer's was freed on copy
    assert prod._extents.used_bytes == 0 and cons._extents.used_bytes == 0
    cons.shutdown()


def test_staged_load_waits_for_buffer_space(staged_producer):
    """A full host buffer on the producer makes the consumer ask again, not fail."""
    prod, (p_mla, _, _) = staged_producer
    tensors = caches(23)
    cons = worker("kv_consumer", "scons2", tensors, buffer="cpu")
    hog = prod._extents.alloc(prod._extents.nbytes)
    assert hog is not None
    prod.start_step(NixlConnectorMetadata(holds={"s2": time.monotonic() + 60}))
    cons.start_step(NixlConnectorMetadata(loads=[spec("s2", prod.side_channel_port, [1], [2],
                                                      0, 1, time.monotonic() + 20,
                                                      engine="sprod")]))
    time.sleep(0.3)
    assert cons.get_finished().finished_recving == set()
    assert "s2" in cons._loads
    prod._extents.free(hog)
    assert wait_finished(cons, "finished_recving", {"s2"}) == {"s2"}
    assert torch.equal(tensors[0][1][2], p_mla[1][1])
    assert wait_finished(prod, "finished_sending", {"s2"}) == {"s2"}
    cons.shutdown()


def test_staged_and_direct_sides_refused(staged_producer, caplog):
    prod, _ = staged_producer
    cons = worker("kv_consumer", "scons3", caches(24))   # kv_buffer_device "cuda"
    cons.start_step(NixlConnectorMetadata(loads=[spec("s3", prod.side_channel_port, [1], [1],
                                                      0, 0, time.monotonic() + 20,
                                                      engine="sprod")]))
    with caplog.at_level("WARNING"):
        assert wait_finished(cons, "failed_recving", {"s3"}) == {"s3"}
    assert "give both the same kv_buffer_device" in caplog.text
    cons.shutdown()


def test_staged_release_frees_the_extent(staged_producer):
    """A consumer that gives up after the producer staged: its release frees the extent."""
    prod, _ = staged_producer
    prod.start_step(NixlConnectorMetadata(holds={"s4": time.monotonic() + 60}))
    answer = prod._stage({"rid": "s4", "blocks": [1, 2], "slot": 0})
    assert answer["nbytes"] > 0 and prod._extents.used_bytes > 0
    assert "error" in prod._stage({"rid": "s4", "blocks": [NB], "slot": None})
    cons = worker("kv_consumer", "scons4", caches(25), buffer="cpu")
    cons.start_step(NixlConnectorMetadata(releases=[
        RemoteRef("sprod", "127.0.0.1", (prod.side_channel_port,), "s4")]))
    assert wait_finished(prod, "finished_sending", {"s4"}) == {"s4"}
    assert prod._extents.used_bytes == 0
    cons.shutdown()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_staged_load_between_device_caches():
    """Device caches through pinned host buffers: the producer's copy stream and the
    consumer's copies on the engine's stream (then its extents freed by event)."""
    dev = torch.device("cuda")
    p_tensors = [[t.to(dev) for t in ts] for ts in caches(31)]
    c_tensors = [[t.to(dev) for t in ts] for ts in caches(32)]
    prod = worker("kv_producer", "gprod", p_tensors, buffer="cpu")
    cons = worker("kv_consumer", "gcons", c_tensors, buffer="cpu")
    try:
        assert prod._buf.is_pinned() and prod._stage_stream is not None
        prod.start_step(NixlConnectorMetadata(holds={"g1": time.monotonic() + 60}))
        cons.start_step(NixlConnectorMetadata(loads=[spec("g1", prod.side_channel_port,
                                                          [3, 4, 9, 10], [7, 0, 1, 2], 2, 5,
                                                          time.monotonic() + 20,
                                                          engine="gprod")]))
        assert wait_finished(cons, "finished_recving", {"g1"}) == {"g1"}
        torch.cuda.synchronize()
        for layer in range(2):
            assert torch.equal(c_tensors[0][layer][[7, 0, 1, 2]],
                               p_tensors[0][layer][[3, 4, 9, 10]])
        for layer in range(3):
            assert torch.equal(c_tensors[1][layer][5], p_tensors[1][layer][2])
            assert torch.equal(c_tensors[2][layer][5], p_tensors[2][layer][2])
        assert wait_finished(prod, "finished_sending", {"g1"}) == {"g1"}
        cons.get_finished()
        assert prod._extents.used_bytes == 0 and cons._extents.used_bytes == 0
    finally:
        cons.shutdown()
        prod.shutdown()
