# SPDX-License-Identifier: Apache-2.0
"""A step slower than SLOW_STEP_S is logged with its composition (mid-serving JIT stalls).
Synchronous scheduling: each step() then processes the step it launched."""

import logging

from kdaserve import SamplingParams
from kdaserve.engine import core, llm_engine
from kdaserve.models.make_model import make_model


def test_slow_steps_are_logged(tmp_path, monkeypatch, caplog):
    model = make_model(str(tmp_path / "tiny"), "tiny")
    engine = llm_engine.LLMEngine.from_engine_args(model=model, device="cpu", max_model_len=256,
                                                   enable_prefix_caching=False,
                                                   async_scheduling=False)
    engine.add_request("a", list(range(10, 30)), SamplingParams(max_tokens=2, ignore_eos=True))
    with caplog.at_level(logging.WARNING, logger=core.__name__):
        engine.step()                                 # the prefill: fast enough
        assert not [r for r in caplog.records if "slow step" in r.message]
        monkeypatch.setattr(core, "SLOW_STEP_S", 0.0)
        engine.step()
    slow = [r.getMessage() for r in caplog.records if "slow step" in r.getMessage()]
    assert len(slow) == 1 and "1 tokens of 1 requests (0 new) (decode only)" in slow[0], slow
