# SPDX-License-Identifier: Apache-2.0
"""A step slower than its limit is logged with its composition (SLOW_STEP_S for a step with
prompt tokens, SLOW_DECODE_STEP_S for one without): a warning on CUDA, where mid-serving JIT or
autotuning is its likely cause; a debug line on the CPU, whose reference path is slow by nature.
Synchronous scheduling: each step() then processes the step it launched."""

import logging

import pytest

from kdaserve import SamplingParams
from kdaserve.engine import core, llm_engine
from kdaserve.models.make_model import make_model


def test_slow_step_level_by_device():
    assert core.slow_step_log_level("cuda") == logging.WARNING
    assert core.slow_step_log_level("cpu") == logging.DEBUG


def _slow_records(caplog) -> list[logging.LogRecord]:
    return [r for r in caplog.records if "slow step" in r.getMessage()]


def _engine_with_one_request(tmp_path) -> llm_engine.LLMEngine:
    """The tiny model on the CPU, synchronous, with one 20-token request of 3 output tokens
    queued: its first step is the prefill, the next ones decodes."""
    model = make_model(str(tmp_path / "tiny"), "tiny")
    engine = llm_engine.LLMEngine.from_engine_args(model=model, device="cpu", max_model_len=256,
                                                   enable_prefix_caching=False,
                                                   async_scheduling=False)
    engine.add_request("a", list(range(10, 30)), SamplingParams(max_tokens=3, ignore_eos=True))
    return engine


def test_slow_steps_are_logged(tmp_path, monkeypatch, caplog):
    engine = _engine_with_one_request(tmp_path)
    with caplog.at_level(logging.DEBUG, logger=core.__name__):
        # the prefill step is held to SLOW_STEP_S, not to the decode limit
        monkeypatch.setattr(core, "SLOW_STEP_S", 1e9)
        monkeypatch.setattr(core, "SLOW_DECODE_STEP_S", 0.0)
        engine.step()
        assert not _slow_records(caplog)
        # a decode step is held to SLOW_DECODE_STEP_S
        engine.step()
        # the CPU: a debug line, no warning and no JIT guess
        (record,) = _slow_records(caplog)
        assert record.levelno == logging.DEBUG
        assert "1 tokens of 1 requests (0 new) (decode only)" in record.getMessage()
        assert "JIT" not in record.getMessage()
        caplog.clear()
        # where JIT is the likely cause (CUDA): a warning that says so
        engine.engine_core._slow_step_level = core.slow_step_log_level("cuda")
        engine.step()
    (record,) = _slow_records(caplog)
    assert record.levelno == logging.WARNING
    message = record.getMessage()
    assert "1 tokens of 1 requests (0 new) (decode only)" in message, message
    assert "JIT compilation or autotuning" in message, message


def test_prefill_steps_have_their_own_limit(tmp_path, monkeypatch, caplog):
    engine = _engine_with_one_request(tmp_path)
    with caplog.at_level(logging.DEBUG, logger=core.__name__):
        monkeypatch.setattr(core, "SLOW_STEP_S", 0.0)
        monkeypatch.setattr(core, "SLOW_DECODE_STEP_S", 1e9)
        engine.step()                                 # the prefill: over its limit
        (record,) = _slow_records(caplog)
        assert "20 tokens of 1 requests (1 new)" in record.getMessage()
        assert "decode only" not in record.getMessage()
        caplog.clear()
        engine.step()                                 # a decode: under its limit
        assert not _slow_records(caplog)


def test_prefill_rows_count_drafts_as_decode():
    from kdaserve.core.sched_output import SchedulerOutput

    so = SchedulerOutput(num_scheduled_tokens={"a": 1, "b": 4},
                         scheduled_spec_decode_tokens={"b": [7, 8, 9]})
    assert so.prefill_req_ids() == [] and not so.has_prefill()
    so.num_scheduled_tokens["c"] = 2                  # a 2-token prompt chunk, no drafts
    assert so.prefill_req_ids() == ["c"] and so.has_prefill()


def test_serve_time_compiles_are_named(tmp_path, monkeypatch, caplog):
    """Where Triton runs (CUDA) the core keeps a CompileLog from the end of its start-up; a
    kernel built during a step is named: in the slow-step line when the step is slow, else in
    a warning of its own. On CPU the core keeps none; here one is installed by hand and fed
    an event as Triton's hook would."""
    pytest.importorskip("triton")
    from types import SimpleNamespace

    from triton import knobs

    from kdaserve.kernels.jit_log import CompileLog

    assert core.serve_compile_log("cpu") is None
    engine = _engine_with_one_request(tmp_path)
    ec = engine.engine_core
    assert ec._compiles is None
    hooks = knobs.runtime.jit_post_compile_hook
    ec._compiles = CompileLog()
    built = lambda name: ec._compiles._after(fn=SimpleNamespace(name=name),  # noqa: E731
                                             compile={"constants": {(5,): 1}})
    with caplog.at_level(logging.DEBUG, logger=core.__name__):
        monkeypatch.setattr(core, "SLOW_STEP_S", 1e9)
        monkeypatch.setattr(core, "SLOW_DECODE_STEP_S", 1e9)
        built("fold_kernel")
        engine.step()                                 # not slow: a warning of its own
        (record,) = [r for r in caplog.records if "while serving" in r.getMessage()]
        assert record.levelno == logging.WARNING
        assert "Triton built or loaded fold_kernel" in record.getMessage()
        assert "20 tokens of 1 requests" in record.getMessage()
        caplog.clear()
        engine.step()                                 # nothing built: nothing said
        assert not caplog.records
        monkeypatch.setattr(core, "SLOW_DECODE_STEP_S", 0.0)
        ec._slow_step_level = core.slow_step_log_level("cuda")
        built("verify_kernel")
        engine.step()                                 # slow: the slow-step line names it
    (record,) = _slow_records(caplog)
    assert ": Triton built or loaded verify_kernel" in record.getMessage()
    assert "JIT compilation" not in record.getMessage()
    engine.engine_core.shutdown()
    assert ec._compiles is None and knobs.runtime.jit_post_compile_hook is hooks
