# SPDX-License-Identifier: Apache-2.0
"""AsyncEngine over the real engine-core process: streaming, abort and stop strings free
everything, errors travel back, a dead core is detected, a consumer that stops taking its
outputs is aborted (backpressure)."""

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
    with pytest.raises(EngineStartupError, match="not divisible by tensor_parallel_size=3"):
        run(_start(tiny_model, tensor_parallel_size=3))


def test_a_consumer_that_stops_taking_is_aborted(tiny_model):
    """Backpressure: past stream_buffer_limit step outputs not taken, the request is aborted
    in the core (everything freed); the consumer, resuming, gets what was buffered and then
    the error. A consumer that keeps up is never aborted. After shutdown, a generator closed
    late sends nothing (no ZMQError from a closed socket) and new requests are refused."""
    async def main():
        engine = await AsyncEngine.start(dict(model=tiny_model, max_model_len=256,
                                              max_num_seqs=8), startup_timeout=120,
                                         stream_buffer_limit=4)
        try:
            before = await engine.get_stats()
            params = SamplingParams(max_tokens=200, ignore_eos=True)
            gen = engine.generate([3, 4, 5], params, "stalled", delta=True)
            tokens = list((await anext(gen)).outputs[0].token_ids)
            for _ in range(200):                         # stop taking its outputs
                stats = await engine.get_stats()
                if stats.num_running_reqs == 0:
                    break
                await asyncio.sleep(0.05)
            assert stats.num_running_reqs == 0
            assert stats.num_free_blocks == before.num_free_blocks
            assert stats.num_free_state_slots == before.num_free_state_slots
            with pytest.raises(RuntimeError, match="stopped reading"):
                async for out in gen:
                    tokens += out.outputs[0].token_ids
            assert 5 <= len(tokens) < 20, tokens
            assert engine.num_in_flight == 0

            outs = [o async for o in engine.generate([3, 4, 5], SamplingParams(
                max_tokens=30, ignore_eos=True), "keeps-up", delta=True)]
            assert outs[-1].finished
            assert sum(len(o.outputs[0].token_ids) for o in outs) == 30

            left_open = engine.generate([3, 4, 5], params, "left-open", delta=True)
            await anext(left_open)
        finally:
            await engine.shutdown()
        with pytest.raises(EngineDeadError, match="shut down"):
            await anext(left_open)
        await left_open.aclose()
        with pytest.raises(EngineDeadError):
            await anext(engine.generate([3], params, "late"))

    run(main())
