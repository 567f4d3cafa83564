"""CompileLog keeps what tells two variants of one kernel apart: the arguments'
specialisations, the constexpr values and the launch's warps and stages. On CPU the hook is
called as Triton's JIT calls it on a cache miss (its keyword arguments as of Triton 3.6)."""

from types import SimpleNamespace

import pytest

pytest.importorskip("triton")


def test_cache_miss_event_names_constexprs():
    from triton import knobs

    from kdaserve.kernels.jit_log import CompileLog

    before = knobs.runtime.jit_post_compile_hook
    log = CompileLog()
    try:
        assert knobs.runtime.jit_post_compile_hook == log._after
        fn = SimpleNamespace(name="k")
        assert log._before(fn=fn) is False
        log._after(fn=fn, compile={"configs": [{(2,): [["tt.divisibility", 16]]}],
                                   "constants": {(30,): 2, (33,): True},
                                   "num_warps": 8, "num_stages": 2})
        (event,) = log.take()
        assert event["kernel"] == "k" and event["s"] >= 0
        assert "tt.divisibility" in event["attrs"]
        assert event["constexprs"] == "{30: 2, 33: True}"
        assert event["warps_stages"] == (8, 2)
        assert log.take() == []
    finally:
        log.close()
    assert knobs.runtime.jit_post_compile_hook == before


def test_logs_stack():
    """A log opened while another is open passes each event on to it (the engine core keeps
    one while a benchmark or a test keeps its own); closing restores the hooks in order."""
    from triton import knobs

    from kdaserve.kernels.jit_log import CompileLog

    before = (knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook)
    outer = CompileLog()
    inner = CompileLog()
    fn = SimpleNamespace(name="k")
    assert knobs.runtime.jit_cache_hook(fn=fn) is False
    knobs.runtime.jit_post_compile_hook(fn=fn, compile={})
    assert [e["kernel"] for e in inner.take()] == ["k"]
    assert [e["kernel"] for e in outer.take()] == ["k"]
    inner.close()
    assert knobs.runtime.jit_post_compile_hook == outer._after
    outer.close()
    assert (knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook) == before
