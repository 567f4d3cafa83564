"""The NIXL connector's scheduler side inside the real Scheduler (no NIXL: the worker's reports
are written by hand): holds on the producer, loads on the consumer, failures, aborts, expiry,
and every block and slot back at the end."""

from __future__ import annotations

import pytest

from kdaserve.config import CacheConfig, KVTransferConfig, SchedulerConfig
from kdaserve.core.sched_output import KVConnectorOutput, ModelRunnerOutput
from kdaserve.core.scheduler import Scheduler
from kdaserve.disagg.nixl.scheduler import NixlConnectorScheduler
from kdaserve.disagg.params import prompt_hash
from kdaserve.request import Request, RequestStatus
from kdaserve.sampling_params import SamplingParams

BS = 4
EOS = 2


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def make(role: str, clock: Clock, hold: float = 10.0, load: float = 30.0,
         prefix: bool = False) -> Scheduler:
    kvt = KVTransferConfig("NixlConnector", role, engine_id=f"eng-{role}",
                           kv_connector_extra_config={"hold_timeout_s": hold,
                                                      "load_timeout_s": load})
    conn = NixlConnectorScheduler(kvt, BS, "127.0.0.1", [5555], clock=clock)
    return Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64,
                                     max_model_len=128),
                     CacheConfig(block_size=BS, enable_prefix_caching=prefix),
                     num_gpu_blocks=32, num_state_slots=8, max_model_len=128, connector=conn)


def req(rid: str, prompt: list[int], max_tokens: int = 8, params: dict | None = None,
        **sp) -> Request:
    return Request(rid, prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0, **sp),
                   eos_token_ids=EOS, kv_transfer_params=params)


def run_step(s: Scheduler, tokens: dict[str, int] | None = None,
             kvo: KVConnectorOutput | None = None):
    so = s.schedule()
    ids = list(so.num_scheduled_tokens)
    sampled = [[(tokens or {}).get(r, 50)] if r in so.sampling_req_ids else [] for r in ids]
    outs = s.update_from_output(so, ModelRunnerOutput(req_ids=ids, sampled_token_ids=sampled,
                                                      kv_connector_output=kvo))
    return so, outs


def assert_all_free(s: Scheduler) -> None:
    kv = s.kv_cache_manager
    assert kv.num_free_blocks == kv.num_gpu_blocks
    assert kv.num_free_slots == kv.num_state_slots
    assert not s.has_pending_transfers()


def prefill_params(s: Scheduler, rid: str, prompt: list[int]) -> dict:
    """Run a do_remote_decode request on a producer to its end; its transfer params."""
    s.add_request(req(rid, prompt, max_tokens=1, params={"do_remote_decode": True}))
    outs = []
    while s.has_unfinished_requests():
        outs += run_step(s, {rid: 77})[1]
    final = [o for o in outs if o.finished]
    assert len(final) == 1 and final[0].new_token_ids == [77]
    return final[0].kv_transfer_params


PROMPT = list(range(10, 21))   # 11 tokens: 3 blocks, the last partial


def test_producer_holds_until_acknowledged():
    clock = Clock()
    s = make("kv_producer", clock)
    params = prefill_params(s, "p1", PROMPT)
    assert params["do_remote_prefill"] and params["remote_request_id"] == "p1"
    assert params["num_prompt_tokens"] == 11 and params["first_token_id"] == 77
    assert len(params["remote_block_ids"]) == 3
    assert params["prompt_hash"] == prompt_hash(PROMPT)
    kv = s.kv_cache_manager
    assert kv.num_free_blocks < kv.num_gpu_blocks and kv.num_free_slots == kv.num_state_slots - 1
    assert s.get_stats().num_kv_transfer_held == 1
    so, _ = run_step(s)
    assert so.kv_connector_metadata.holds == {"p1": pytest.approx(110.0)}
    run_step(s, kvo=KVConnectorOutput(finished_sending={"p1"}))
    assert_all_free(s)
    assert s.get_stats().kv_transfer_sends == 1


def test_producer_hold_expires():
    clock = Clock()
    s = make("kv_producer", clock, hold=5.0)
    prefill_params(s, "p1", PROMPT)
    clock.t += 4.9
    run_step(s)
    assert s.has_pending_transfers()
    clock.t += 0.2
    so, _ = run_step(s)
    assert so.kv_connector_metadata.unholds == ["p1"]
    assert_all_free(s)
    assert s.get_stats().kv_transfer_expired == 1
    # a late acknowledgement changes nothing
    run_step(s, kvo=KVConnectorOutput(finished_sending={"p1"}))
    assert_all_free(s)


@pytest.mark.parametrize("case", ["aborted", "two_tokens", "no_flag"])
def test_producer_does_not_hold(case):
    s = make("kv_producer", Clock())
    params = None if case == "no_flag" else {"do_remote_decode": True}
    r = req("p1", PROMPT, max_tokens=2 if case == "two_tokens" else 1, params=params)
    s.add_request(r)
    if case == "aborted":
        s.finish_requests("p1", RequestStatus.FINISHED_ABORTED)
    outs = []
    while s.has_unfinished_requests():
        outs += run_step(s)[1]
    assert all(o.kv_transfer_params is None for o in outs)
    assert_all_free(s)


def test_consumer_loads_then_decodes():
    clock = Clock()
    prod = make("kv_producer", clock)
    params = prefill_params(prod, "p1", PROMPT)
    cons = make("kv_consumer", clock)
    cons.add_request(req("d1", PROMPT, max_tokens=4, params=params))
    # the first token comes out before any step computes
    so, outs = run_step(cons)
    assert [(o.req_id, o.new_token_ids, o.finished) for o in outs] == [("d1", [77], False)]
    assert so.num_scheduled_tokens == {}
    (load,) = so.kv_connector_metadata.loads
    assert load.remote.block_ids == tuple(params["remote_block_ids"])
    assert len(load.block_ids) == 3 and load.deadline == pytest.approx(100.0 + 5.0)
    assert cons.has_unfinished_requests() and cons.get_stats().num_kv_transfer_loading == 1
    # nothing scheduled while loading
    so, outs = run_step(cons)
    assert not so.num_scheduled_tokens and not outs
    # loaded: one token (the first output) is computed on top of the prompt's state
    run_step(cons, kvo=KVConnectorOutput(finished_recving={"d1"}, num_bytes_recved=1000,
                                         recv_seconds=0.5))
    so, outs = run_step(cons)
    (new,) = so.scheduled_new_reqs
    assert new.num_computed_tokens == 11 and new.output_token_ids == [77]
    assert so.num_scheduled_tokens == {"d1": 1} and "d1" in so.sampling_req_ids
    assert new.block_ids[:3] == load.block_ids and new.state_slot == load.state_slot
    total = [77] + [t for o in outs for t in o.new_token_ids]
    while cons.has_unfinished_requests():
        total += [t for o in run_step(cons)[1] for t in o.new_token_ids]
    assert total == [77, 50, 50, 50]
    st = cons.get_stats()
    assert (st.kv_transfer_loads, st.kv_transfer_bytes, st.kv_transfer_seconds) == (1, 1000, 0.5)
    assert_all_free(cons)
    run_step(prod, kvo=KVConnectorOutput(finished_sending={"p1"}))
    assert_all_free(prod)


def test_consumer_failed_load_recomputes():
    clock = Clock()
    params = prefill_params(make("kv_producer", clock), "p1", PROMPT)
    cons = make("kv_consumer", clock)
    cons.add_request(req("d1", PROMPT, max_tokens=3, params=params))
    run_step(cons)
    run_step(cons, kvo=KVConnectorOutput(failed_recving={"d1"}))
    so, _ = run_step(cons)
    (new,) = so.scheduled_new_reqs
    # the whole prompt and the first token are computed here
    assert new.num_computed_tokens == 0 and so.num_scheduled_tokens == {"d1": 12}
    assert not so.kv_connector_metadata.loads
    while cons.has_unfinished_requests():
        run_step(cons)
    assert cons.get_stats().kv_transfer_failures == 1
    assert_all_free(cons)


def test_consumer_abort_during_load_frees_after_load_ends():
    clock = Clock()
    params = prefill_params(make("kv_producer", clock), "p1", PROMPT)
    cons = make("kv_consumer", clock)
    cons.add_request(req("d1", PROMPT, params=params))
    run_step(cons)
    cons.finish_requests("d1", RequestStatus.FINISHED_ABORTED)
    assert not cons.has_unfinished_requests()
    kv = cons.kv_cache_manager
    assert kv.num_free_slots == kv.num_state_slots - 1     # the transfer still writes there
    assert cons.has_pending_transfers()
    run_step(cons, kvo=KVConnectorOutput(finished_recving={"d1"}))
    assert_all_free(cons)


def test_consumer_first_token_finishes():
    """max_tokens=1 (or an EOS first token): done at once, never loads, the hold released."""
    clock = Clock()
    params = prefill_params(make("kv_producer", clock), "p1", PROMPT)
    cons = make("kv_consumer", clock)
    cons.add_request(req("d1", PROMPT, max_tokens=1, params=params))
    so, outs = run_step(cons)
    assert [(o.new_token_ids, o.finish_reason) for o in outs] == [([77], "length")]
    assert not so.kv_connector_metadata.loads
    assert [r.request_id for r in so.kv_connector_metadata.releases] == ["p1"]
    assert_all_free(cons)


@pytest.mark.parametrize("case", ["other_prompt", "logprobs", "too_late"])
def test_consumer_computes_when_it_cannot_load(case):
    clock = Clock()
    params = prefill_params(make("kv_producer", clock, hold=10.0), "p1", PROMPT)
    cons = make("kv_consumer", clock)
    prompt = PROMPT[:-1] + [99] if case == "other_prompt" else PROMPT
    extra = {"logprobs": 1} if case == "logprobs" else {}
    cons.add_request(req("d1", prompt, max_tokens=2, params=params, **extra))
    if case == "too_late":    # past half the producer's hold before it could start
        clock.t += 5.0
    so, outs = run_step(cons)
    assert not so.kv_connector_metadata.loads
    assert [r.request_id for r in so.kv_connector_metadata.releases] == ["p1"]
    first = so.num_scheduled_tokens["d1"]
    # too late: the first token stays (it was sent); otherwise the prompt alone is computed
    assert first == (12 if case == "too_late" else 11)
    while cons.has_unfinished_requests():
        run_step(cons)
    assert_all_free(cons)


def test_consumer_load_blocks_not_hit_before_they_arrive():
    """Prefix caching on: a second request with the same prompt must not hit the blocks a
    load is still writing (they enter the prefix cache only once loaded)."""
    clock = Clock()
    params = prefill_params(make("kv_producer", clock), "p1", PROMPT + PROMPT)
    cons = make("kv_consumer", clock, prefix=True)
    cons.add_request(req("d1", PROMPT + PROMPT, params=params))
    run_step(cons)
    assert cons.kv_cache_manager.find_cached_kv_prefix(req("x", PROMPT + PROMPT)) == []
    run_step(cons, kvo=KVConnectorOutput(finished_recving={"d1"}))
    run_step(cons)
    assert len(cons.kv_cache_manager.find_cached_kv_prefix(req("x", PROMPT + PROMPT))) == 5
    cons.finish_requests("d1", RequestStatus.FINISHED_ABORTED)
    run_step(cons)
    assert_all_free(cons)


def test_config_errors():
    with pytest.raises(ValueError, match="kv_connector must be one of"):
        KVTransferConfig.from_dict({"kv_connector": "Lmcache", "kv_role": "kv_both"})
    with pytest.raises(ValueError, match="kv_role must be one of"):
        KVTransferConfig.from_dict({"kv_connector": "NixlConnector", "kv_role": "leader"})
    with pytest.raises(ValueError, match="needs 'kv_role'"):
        KVTransferConfig.from_dict({"kv_connector": "NixlConnector"})
    with pytest.raises(ValueError, match="unknown kv_transfer_config keys"):
        KVTransferConfig.from_dict({"kv_connector": "NixlConnector", "kv_role": "kv_both",
                                    "kv_buffer": 1})
    with pytest.raises(ValueError, match="kv_buffer_size must be a number of bytes"):
        KVTransferConfig.from_dict({"kv_connector": "NixlConnector", "kv_role": "kv_both",
                                    "kv_buffer_size": 1})
    with pytest.raises(ValueError, match="kv_buffer_device must be 'cuda' or 'cpu', got 'tpu'"):
        KVTransferConfig("NixlConnector", "kv_both", kv_buffer_device="tpu")
    assert KVTransferConfig.from_dict({"kv_connector": "NixlConnector", "kv_role": "kv_both",
                                       "kv_buffer_device": "cpu"}).staged
    with pytest.raises(ValueError, match="unknown kv_connector_extra_config keys"):
        KVTransferConfig("NixlConnector", "kv_both", kv_connector_extra_config={"x": 1})
    with pytest.raises(ValueError, match="hold_timeout_s"):
        KVTransferConfig("NixlConnector", "kv_both",
                         kv_connector_extra_config={"hold_timeout_s": 0})
