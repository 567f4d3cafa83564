"""Compile-ahead workers (kernels/compile_ahead.py) fill Triton's on-disk cache with exactly the
entry an in-process compile of the same variant then finds. Triton compiles for an sm_90 target
without a GPU (its bundled ptxas), so the CPU CI runs this; the deferral hook needs a driver
and is tested on the GPU."""

from pathlib import Path

import pytest

triton = pytest.importorskip("triton")

from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource, make_backend  # noqa: E402
from triton.runtime.jit import serialize_specialization_data  # noqa: E402

from kdaserve.kernels.compile_ahead import CompileAhead  # noqa: E402
from kdaserve.kernels.moe.triton_moe import moe_sum_kernel  # noqa: E402

TARGET = ("cuda", 90, 32)


def _variant(block_d: int):
    """moe_sum_kernel's signature, constexprs, attrs and options as Triton's launcher builds
    them (pointers 16-byte aligned, the strides divisible by 16)."""
    names = [p.name for p in moe_sum_kernel.params]
    types = {"buf_ptr": "*bf16", "topk_ids_ptr": "*i32", "out_ptr": "*bf16"}
    signature = {n: "constexpr" if n in ("BLOCK_D", "USE_PDL") else types.get(n, "i32")
                 for n in names}
    constexprs = {(names.index("BLOCK_D"),): block_d, (names.index("USE_PDL"),): False}
    attrs = {(names.index(n),): [["tt.divisibility", 16]]
             for n in ("buf_ptr", "topk_ids_ptr", "out_ptr", "stride_bm", "stride_om")}
    options = make_backend(GPUTarget(*TARGET)).parse_options({"num_warps": 4})
    return signature, constexprs, attrs, options


def _entries(cache: Path) -> set[str]:
    return {p.name for p in cache.iterdir()} if cache.is_dir() else set()


def test_worker_compile_is_the_in_process_cache_entry(tmp_path, monkeypatch):
    cache = tmp_path / "triton"
    monkeypatch.setenv("TRITON_CACHE_DIR", str(cache))     # the workers inherit it
    ahead = CompileAhead(2, TARGET)
    variants = [_variant(b) for b in (256, 512)]
    for signature, constexprs, attrs, options in variants:
        spec = serialize_specialization_data(
            "kdaserve.kernels.moe.triton_moe.moe_sum_kernel", signature, constexprs, attrs,
            options, key="test")
        ahead.submit(moe_sum_kernel.fn.__module__, moe_sum_kernel.fn.__qualname__, spec)
        ahead.submit(moe_sum_kernel.fn.__module__, moe_sum_kernel.fn.__qualname__, spec)
    stats = ahead.wait()
    assert (stats["variants"], stats["failed"]) == (2, 0)
    before = _entries(cache)
    assert len(before) >= 2
    for signature, constexprs, attrs, options in variants:
        kernel = triton.compile(ASTSource(moe_sum_kernel, signature, constexprs, attrs),
                                target=GPUTarget(*TARGET), options=options.__dict__)
        assert kernel.metadata.num_warps == 4
    assert _entries(cache) == before, "the in-process compile missed the workers' entries"
    # and a variant the workers did not build does add an entry (the check above can fail)
    signature, constexprs, attrs, options = _variant(128)
    triton.compile(ASTSource(moe_sum_kernel, signature, constexprs, attrs),
                   target=GPUTarget(*TARGET), options=options.__dict__)
    assert _entries(cache) - before


def test_a_failing_variant_is_reported_not_raised(tmp_path, monkeypatch):
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton"))
    ahead = CompileAhead(1, TARGET)
    ahead.submit("kdaserve.kernels.moe.triton_moe", "no_such_kernel", "{}")
    assert ahead.wait()["failed"] == 1


@pytest.mark.gpu
def test_deferred_launch_then_disk_load(tmp_path, monkeypatch):
    """Under deferring() a kdaserve kernel's first launch does nothing (its output keeps its
    fill) and its compile happens in a worker; after wait() the real launch loads that build
    from the disk cache (no compile in this process) and computes the sum."""
    import torch

    from kdaserve.kernels.jit_log import CompileLog

    if not torch.cuda.is_available():
        pytest.skip("CUDA")
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton"))
    from triton.runtime import driver

    t = driver.active.get_current_target()
    ahead = CompileAhead(2, (t.backend, t.arch, t.warp_size))
    n, top_k, hidden = 3, 2, 96           # a block size no other test launches
    buf = torch.randn(n * top_k, hidden, device="cuda", dtype=torch.bfloat16)
    ids = torch.zeros(n, top_k, device="cuda", dtype=torch.int32)
    out = torch.full((n, hidden), 7.0, device="cuda", dtype=torch.bfloat16)

    def launch():
        moe_sum_kernel[(n, hidden // 32)](buf, ids, out, hidden, 4, top_k, buf.stride(0),
                                          out.stride(0), BLOCK_D=32)

    with ahead.deferring():
        launch()
    torch.cuda.synchronize()
    assert (out == 7.0).all()
    assert ahead.wait()["variants"] == 1
    built = _entries(tmp_path / "triton")
    assert built
    log = CompileLog()
    try:
        launch()
        torch.cuda.synchronize()
    finally:
        log.close()
    ref = buf.float().view(n, top_k, hidden).sum(1)
    torch.testing.assert_close(out.float(), ref, rtol=1e-2, atol=1e-2)
    events = [e for e in log.events if e["kernel"] == "moe_sum_kernel"]
    assert len(events) == 1, events
    assert _entries(tmp_path / "triton") == built, "the launch compiled instead of loading"
