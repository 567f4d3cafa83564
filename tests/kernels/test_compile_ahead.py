"""Compile-ahead workers (kernels/compile_ahead.py) fill Triton's on-disk cache with exactly the
entry an in-process compile of the same variant then finds. Triton compiles for an sm_90 target
without a GPU (its bundled ptxas), so the CPU CI runs this; the deferral hook's launches need a
driver and are tested on the GPU."""

from pathlib import Path

import pytest

triton = pytest.importorskip("triton")

from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource, make_backend  # noqa: E402
from triton.runtime.jit import serialize_specialization_data  # noqa: E402

from kdaserve.kernels.compile_ahead import CompileAhead  # noqa: E402
from kdaserve.kernels.moe.triton_moe import moe_sum_kernel  # noqa: E402

TARGET = ("cuda", 90, 32)


@triton.autotune(configs=[triton.Config({"BLOCK": b}, num_warps=w) for b in (64, 128)
                          for w in (1, 2)], key=["n"])
@triton.jit
def _triple_kernel(x_ptr, y_ptr, n, BLOCK: triton.language.constexpr):
    """An autotuned kernel outside kdaserve (as fla's are): launched, not deferred."""
    offs = triton.language.program_id(0) * BLOCK + triton.language.arange(0, BLOCK)
    mask = offs < n
    x = triton.language.load(x_ptr + offs, mask=mask)
    triton.language.store(y_ptr + offs, x * 3.0, mask=mask)


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


def test_autotune_candidates_are_the_in_process_entries(tmp_path, monkeypatch):
    """candidate_variants turns one launch's specialisation into each config's, which the
    workers build into exactly the entries an in-process compile of that config finds; and
    benchmarking_autotuner finds the tuner from inside its _bench."""
    from triton import Config
    from triton.runtime.autotuner import Autotuner

    from kdaserve.kernels.compile_ahead import (benchmarking_autotuner, candidate_variants,
                                                variant_identity)

    cache = tmp_path / "triton"
    monkeypatch.setenv("TRITON_CACHE_DIR", str(cache))
    configs = [Config({"BLOCK_D": 64}, num_warps=2, num_stages=2),
               Config({"BLOCK_D": 128}, num_warps=8, num_stages=3)]
    signature, constexprs, attrs, _ = _variant(256)        # the launch that asked: a config
    names = [p.name for p in moe_sum_kernel.params]        # with a register cap, its own key
    backend = make_backend(GPUTarget(*TARGET))
    asked = Config({"BLOCK_D": 256}, num_warps=4, maxnreg=128)
    spec = serialize_specialization_data("x", signature, constexprs, attrs,
                                         backend.parse_options(asked.all_kwargs()), key="k-256")
    specs = candidate_variants(spec, moe_sum_kernel.arg_names, configs)
    for i, c in enumerate(configs):    # what Triton serialises when that candidate launches
        consts = dict(constexprs)
        consts[(names.index("BLOCK_D"),)] = c.kwargs["BLOCK_D"]
        own = serialize_specialization_data("x", signature, consts, attrs,
                                            backend.parse_options(c.all_kwargs()), key=f"k{i}")
        assert variant_identity(specs[i]) == variant_identity(own)
        assert specs[i] != own                              # only the key differs
    ahead = CompileAhead(2, TARGET)
    for s in specs:
        ahead.submit(moe_sum_kernel.fn.__module__, moe_sum_kernel.fn.__qualname__, s)
    assert ahead.wait()["failed"] == 0
    before = _entries(cache)
    assert len(before) >= 2
    for c in configs:
        consts = dict(constexprs)
        consts[(names.index("BLOCK_D"),)] = c.kwargs["BLOCK_D"]
        opts = backend.parse_options(c.all_kwargs())       # what a tuned launch passes
        kernel = triton.compile(ASTSource(moe_sum_kernel, signature, consts, attrs),
                                target=GPUTarget(*TARGET), options=opts.__dict__)
        assert kernel.metadata.num_warps == c.num_warps
    assert _entries(cache) == before, "a candidate's in-process compile missed the workers'"

    tuner = Autotuner(moe_sum_kernel, moe_sum_kernel.arg_names, configs, key=[],
                      reset_to_zero=None, restore_value=None)

    def _bench(self, *args, config, **meta):      # Autotuner._bench's signature
        return benchmarking_autotuner()

    assert _bench(tuner, config=configs[0], x=1) == (tuner, {"x": 1})
    assert benchmarking_autotuner() is None


def test_a_failing_variant_is_reported_not_raised(tmp_path, monkeypatch):
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton"))
    ahead = CompileAhead(1, TARGET)
    ahead.submit("kdaserve.kernels.moe.triton_moe", "no_such_kernel", "{}")
    assert ahead.wait()["failed"] == 1


@pytest.mark.parametrize("cpus, ranks, want", [(16, 1, 15), (128, 8, 15), (64, 1, 16),
                                               (3, 1, 2), (2, 1, 0), (16, 8, 0)])
def test_default_pool_shares_the_cpus(monkeypatch, cpus, ranks, want):
    import os

    from kdaserve.kernels.compile_ahead import default_compile_workers

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(cpus)), raising=False)
    assert default_compile_workers(ranks) == want


def test_compile_workers_is_checked(tmp_path):
    from kdaserve.engine.arg_utils import config_from_kwargs
    from kdaserve.models.make_model import make_model

    model = make_model(str(tmp_path / "m"), "tiny")
    assert config_from_kwargs(dict(model=model, device="cpu")).compile_workers is None
    off = config_from_kwargs(dict(model=model, device="cpu", compile_workers=0))
    assert off.compile_workers == 0
    for bad in (-1, 2.0, True, "4"):
        with pytest.raises(ValueError, match=f"compile_workers must be an int >= 0 or None "
                                             f".*got {bad!r}"):
            config_from_kwargs(dict(model=model, device="cpu", compile_workers=bad))


def test_workers_refuse_to_build_an_engine(tmp_path, monkeypatch):
    """The workers carry WORKER_ENV (and no GPU); building an engine config there is refused
    with the main-guard advice, so a script that builds its engine at its top level does not
    build one in every worker. The parent's environment is left as it was."""
    import os

    from kdaserve.engine.arg_utils import config_from_kwargs
    from kdaserve.kernels.compile_ahead import WORKER_ENV
    from kdaserve.models.make_model import make_model

    monkeypatch.delenv(WORKER_ENV, raising=False)
    before = os.environ.get("CUDA_VISIBLE_DEVICES")
    ahead = CompileAhead(2, TARGET)
    seen = [ahead.pool.submit(os.getenv, k).result() for k in (WORKER_ENV, "CUDA_VISIBLE_DEVICES")]
    ahead.wait()
    assert seen == ["1", ""]
    assert WORKER_ENV not in os.environ and os.environ.get("CUDA_VISIBLE_DEVICES") == before
    model = make_model(str(tmp_path / "m"), "tiny")
    config_from_kwargs(dict(model=model, device="cpu"))
    monkeypatch.setenv(WORKER_ENV, "1")
    with pytest.raises(RuntimeError, match="if __name__ == .__main__.:.*compile_workers=0"):
        config_from_kwargs(dict(model=model, device="cpu"))


def test_no_processes_no_pool(monkeypatch, caplog):
    """Where processes cannot start, start() logs it and returns None (the worker then
    compiles in its own thread) instead of failing the engine's start."""
    import concurrent.futures

    import kdaserve.kernels.compile_ahead as ca

    def refuse(*a, **k):
        raise OSError(38, "Function not implemented")

    monkeypatch.setattr(ca, "ProcessPoolExecutor", refuse)
    assert ca.CompileAhead.start(2, TARGET) is None
    assert "no worker processes (OSError" in caplog.text
    monkeypatch.setattr(ca, "ProcessPoolExecutor", concurrent.futures.ProcessPoolExecutor)
    ahead = ca.CompileAhead.start(1, TARGET)
    assert ahead is not None and ahead.wait()["variants"] == 0


UNGUARDED = """
import logging, sys
logging.basicConfig(level=logging.WARNING)
from kdaserve.engine.arg_utils import config_from_kwargs
from kdaserve.kernels.compile_ahead import CompileAhead

config_from_kwargs(dict(model=sys.argv[1] if len(sys.argv) > 1 else MODEL, device="cpu"))
ahead = CompileAhead(1, ("cuda", 90, 32))
ahead.submit("kdaserve.kernels.moe.triton_moe", "moe_sum_kernel", "{}")
print("stats", ahead.wait())
"""


def test_an_unguarded_script_gets_the_advice_not_an_engine_per_worker(tmp_path):
    """A main script that builds its engine config at its top level (no main guard) and then
    starts the pool: the worker, importing the script again, is refused before it builds
    anything; the parent's pool reports the broken workers with the main-guard advice and the
    script goes on."""
    import subprocess
    import sys

    from kdaserve.models.make_model import make_model

    model = make_model(str(tmp_path / "m"), "tiny")
    script = tmp_path / "unguarded.py"
    script.write_text(UNGUARDED.replace("MODEL", repr(model)))
    run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                         timeout=300, cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "stats {'variants': 1, 'failed': 1" in run.stdout, run.stdout
    assert "kdaserve's start-up compile workers import the main script again" in run.stderr
    assert "guard it with `if __name__ == \"__main__\":`" in run.stderr


def _moe_sum_launch(n: int, hidden: int, top_k: int = 2, block_d: int = 32):
    """(buf, out, launch) on CUDA: launch() sums each token's top_k rows of buf into out
    (filled with 7.0 until a launch runs). Each test takes its own block_d: a variant another
    test compiled in this process is hidden under deferring(), never resubmitted."""
    import torch

    buf = torch.randn(n * top_k, hidden, device="cuda", dtype=torch.bfloat16)
    ids = torch.zeros(n, top_k, device="cuda", dtype=torch.int32)
    out = torch.full((n, hidden), 7.0, device="cuda", dtype=torch.bfloat16)

    def launch():
        moe_sum_kernel[(n, hidden // block_d)](buf, ids, out, hidden, 4, top_k, buf.stride(0),
                                               out.stride(0), BLOCK_D=block_d)

    return buf, out, launch


def test_deferring_hides_compiled_variants(tmp_path, monkeypatch):
    """Inside deferring() a kdaserve kernel's compiled variants are hidden (so even they are not
    launched: they would read the uninitialised outputs of skipped kernels) and a launch of one
    is skipped without a worker compile; on leaving, the entries are back."""
    from types import SimpleNamespace

    from kdaserve.kernels.compile_ahead import package_kernels

    assert any(fn is moe_sum_kernel for fn in package_kernels())
    monkeypatch.setitem(moe_sum_kernel.device_caches, "test-device",
                        ({"compiled-key": "kernel"}, {}, None, None, None))
    ahead = CompileAhead(1, TARGET)
    from triton import knobs

    try:
        with ahead.deferring():
            assert moe_sum_kernel.device_caches["test-device"][0] == {}
            info = SimpleNamespace(module=moe_sum_kernel.module, name="moe_sum_kernel",
                                   jit_function=moe_sum_kernel)
            skip = knobs.runtime.jit_cache_hook(
                key="compiled-key", fn=info,
                compile={"key": "compiled-key", "specialization_data": "{}"})
            assert skip is True
            assert ahead._futures == {}                 # no worker compile for it
        assert moe_sum_kernel.device_caches["test-device"][0] == {"compiled-key": "kernel"}
    finally:
        assert ahead.wait()["variants"] == 0


@pytest.mark.gpu
def test_compiled_variant_not_launched_under_deferral(tmp_path, monkeypatch):
    """A variant compiled (and launched) before deferring() is not launched inside it: its
    output keeps its fill; after, it launches again from the in-process cache."""
    import torch

    if not torch.cuda.is_available():
        pytest.skip("CUDA")
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton"))
    from triton.runtime import driver

    t = driver.active.get_current_target()
    buf, out, launch = _moe_sum_launch(n=2, hidden=64)
    launch()                                     # compiled in this process
    ref = buf.float().view(2, 2, 64).sum(1)
    torch.testing.assert_close(out.float(), ref, rtol=1e-2, atol=1e-2)
    out.fill_(7.0)
    ahead = CompileAhead(2, (t.backend, t.arch, t.warp_size))
    with ahead.deferring():
        launch()
    torch.cuda.synchronize()
    assert (out == 7.0).all()
    assert ahead.wait()["variants"] == 0
    launch()
    torch.testing.assert_close(out.float(), ref, rtol=1e-2, atol=1e-2)


@pytest.mark.gpu
def test_deferred_launch_then_disk_load(tmp_path, monkeypatch):
    """Under deferring() a kdaserve kernel's first launch does nothing (its output keeps its
    fill) and its compile happens in a worker; after wait() the real launch loads that build
    from the disk cache (no compile in this process) and computes the sum."""
    import torch

    if not torch.cuda.is_available():
        pytest.skip("CUDA")
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton"))
    from triton.runtime import driver

    t = driver.active.get_current_target()
    ahead = CompileAhead(2, (t.backend, t.arch, t.warp_size))
    n, top_k, hidden = 3, 2, 96
    buf, out, launch = _moe_sum_launch(n, hidden, top_k, block_d=16)   # no other test's variant

    with ahead.deferring():
        launch()
    torch.cuda.synchronize()
    assert (out == 7.0).all()
    assert ahead.wait()["variants"] == 1
    built = _entries(tmp_path / "triton")
    assert built
    from triton import knobs

    hits = []

    def listener(*, src, cache_hit, **_):
        if getattr(getattr(src, "fn", None), "__name__", "") == "moe_sum_kernel":
            hits.append(cache_hit)

    knobs.compilation.listener = listener    # (the cache folder also gains the launcher's
    try:                                     # module, which no worker builds)
        launch()
        torch.cuda.synchronize()
    finally:
        knobs.compilation.listener = None
    ref = buf.float().view(n, top_k, hidden).sum(1)
    torch.testing.assert_close(out.float(), ref, rtol=1e-2, atol=1e-2)
    assert hits == [True], "the launch compiled instead of loading the workers' build"


@pytest.mark.gpu
def test_autotune_under_deferral_loads_its_candidates(tmp_path, monkeypatch):
    """An autotuner benchmarking under deferring(): its kernel is not kdaserve's, so it runs
    (the result is right), and its four candidates were built by the workers first (each
    in-process compile of the benchmark is a disk-cache hit)."""
    import torch
    from triton import knobs
    from triton.runtime import driver

    if not torch.cuda.is_available():
        pytest.skip("CUDA")
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton"))
    t = driver.active.get_current_target()
    ahead = CompileAhead(2, (t.backend, t.arch, t.warp_size))
    n = 1000 + 7                          # a key no other test tunes
    x = torch.randn(n, device="cuda")
    y = torch.zeros_like(x)
    hits = []

    def listener(*, src, cache_hit, **_):
        if getattr(getattr(src, "fn", None), "__name__", "") == "_triple_kernel":
            hits.append(cache_hit)

    knobs.compilation.listener = listener
    try:
        with ahead.deferring():
            _triple_kernel[lambda m: (triton.cdiv(n, m["BLOCK"]),)](x, y, n)
        torch.cuda.synchronize()
    finally:
        knobs.compilation.listener = None
    assert ahead.wait()["variants"] == 4
    torch.testing.assert_close(y, 3 * x)
    assert hits == [True] * 4, hits
