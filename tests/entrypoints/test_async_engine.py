# SPDX-License-Identifier: Apache-2.0
"""AsyncEngine over the real engine-core process: streaming, abort and stop strings free
everything, errors travel back, a dead core is detected."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest

from kdaserve.engine.async_engine import AsyncEngine, EngineDeadError, EngineStartupError
from kdaserve.sampling_params import SamplingParams


def run(coro):
    return asyncio.run(coro)


async def _start(tiny_model, **kwargs):
    return await AsyncEngine.start(dict(model=tiny_model, max_model_len=256, max_num_seqs=8,
                                        **kwargs), startup_timeout=120)


def test_generate_delta_and_cumulative_abort_and_stats(tiny_model):
    async def main():
        engine = await _start(tiny_model)
        try:
            before = await engine.get_stats()
            params = SamplingParams(max_tokens=6, ignore_eos=True, temperature=0.0)
            cumulative = [o async for o in engine.generate([3, 4, 5, 6], params, "a")]
            deltas = [o async for o in engine.generate([3, 4, 5, 6], params, "b", delta=True)]
            final = cumulative[-1].outputs[0]
            assert cumulative[-1].finished and final.finish_reason == "length"
            assert len(final.token_ids) == 6
            # deltas concatenate to the cumulative result (greedy: same tokens)
            assert sum((o.outputs[0].token_ids for o in deltas), []) == final.token_ids
            assert "".join(o.outputs[0].text for o in deltas) == final.text
            lengths = [len(o.outputs[0].token_ids) for o in cumulative]
            assert lengths == sorted(lengths)

            # leave a long request early: it is aborted in the core, and everything is freed
            gen = engine.generate([7] * 20, SamplingParams(max_tokens=200, ignore_eos=True),
                                  "c")
            async for _ in gen:
                break
            await gen.aclose()
            for _ in range(50):
                stats = await engine.get_stats()
                if stats.num_running_reqs == 0 and stats.num_free_blocks == before.num_free_blocks:
                    break
                await asyncio.sleep(0.05)
            assert stats.num_running_reqs == 0 and stats.num_waiting_reqs == 0
            assert stats.num_free_blocks == before.num_free_blocks
            assert stats.num_free_state_slots == before.num_free_state_slots
            assert stats.num_generation_tokens >= 12

            # a stop string ends the request in the front: the streamed text stops before it,
            # the core aborts the request and frees it, the counter ends at the stop
            params = SamplingParams(max_tokens=40, ignore_eos=True, temperature=0.0)
            full = [o async for o in engine.generate([3, 4, 5, 6], params, "full")][-1]
            text = full.outputs[0].text
            assert len(text) >= 4
            stop = text[2:4]
            counted = (await engine.get_stats()).num_generation_tokens
            params = SamplingParams(max_tokens=40, ignore_eos=True, temperature=0.0, stop=[stop])
            deltas = [o async for o in engine.generate([3, 4, 5, 6], params, "stop", delta=True)]
            comp = deltas[-1].outputs[0]
            assert (comp.finish_reason, comp.stop_reason) == ("stop", stop)
            assert "".join(o.outputs[0].text for o in deltas) == text[:text.index(stop)]
            tokens = sum((o.outputs[0].token_ids for o in deltas), [])
            assert len(tokens) < 40 and tokens == full.outputs[0].token_ids[:len(tokens)]
            for _ in range(50):
                stats = await engine.get_stats()
                if stats.num_running_reqs == 0 and stats.num_free_blocks == before.num_free_blocks:
                    break
                await asyncio.sleep(0.05)
            assert stats.num_running_reqs == 0
            assert stats.num_free_blocks == before.num_free_blocks
            assert stats.num_free_state_slots == before.num_free_state_slots
            assert stats.num_generation_tokens - counted == len(tokens)

            # engine-side rejection comes back as ValueError
            with pytest.raises(ValueError, match="outside the vocabulary"):
                async for _ in engine.generate([10**9], params, "bad"):
                    pass
            assert engine.num_in_flight == 0
        finally:
            await engine.shutdown()
        assert not engine.proc.is_alive()

    run(main())


def test_dead_core_is_detected(tiny_model):
    async def main():
        engine = await _start(tiny_model)
        try:
            gen = engine.generate([3, 4], SamplingParams(max_tokens=10_000 // 50, ignore_eos=True),
                                  "x", delta=True)
            await anext(gen)
            os.kill(engine.proc.pid, signal.SIGKILL)
            with pytest.raises(EngineDeadError):
                async for _ in gen:
                    pass
            deadline = time.monotonic() + 5
            while engine.is_healthy and time.monotonic() < deadline:
                await asyncio.sleep(0.1)
            assert not engine.is_healthy
            with pytest.raises(EngineDeadError):
                await engine.get_stats()
        finally:
            await engine.shutdown()

    run(main())


def test_startup_error_names_the_problem(tiny_model):
    with pytest.raises(EngineStartupError, match="tensor_parallel_size"):
        run(_start(tiny_model, tensor_parallel_size=2))
