"""Speculative decoding with n > 1 and with min_tokens/stop-token bans that fall on draft
positions: output equals the run without speculation (tiny model drafting for itself)."""

from __future__ import annotations

from kdaserve import SamplingParams


def _self_draft(tiny_model_dir, k=3):
    return {"method": "draft_model", "model": tiny_model_dir, "num_speculative_tokens": k}


PROMPT = {"prompt_token_ids": [17, 4, 99, 23, 8, 61, 5, 42, 77]}


def test_n2_greedy_with_spec_equals_plain(make_llm, tiny_model_dir):
    sp = SamplingParams(n=2, temperature=0.0, max_tokens=20, ignore_eos=True)
    plain = make_llm().generate([PROMPT], sp, use_tqdm=False)[0]
    llm = make_llm(speculative_config=_self_draft(tiny_model_dir))
    spec = llm.generate([PROMPT], sp, use_tqdm=False)[0]
    assert [c.token_ids for c in spec.outputs] == [c.token_ids for c in plain.outputs]
    assert llm.llm_engine.get_stats().spec_num_accepted_tokens > 0


def test_min_tokens_ban_inside_draft_window(make_llm, tiny_model_dir):
    plain_llm = make_llm()
    free = plain_llm.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=12,
                                                       ignore_eos=True), use_tqdm=False)
    stop_tok = free[0].outputs[0].token_ids[2]     # greedy emits it third: inside a window
    sp = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True,
                        stop_token_ids=[stop_tok], min_tokens=6)
    plain = plain_llm.generate([PROMPT], sp, use_tqdm=False)[0].outputs[0]
    spec_llm = make_llm(speculative_config=_self_draft(tiny_model_dir))
    spec = spec_llm.generate([PROMPT], sp, use_tqdm=False)[0].outputs[0]
    assert spec_llm.llm_engine.get_stats().spec_num_draft_tokens > 0
    assert stop_tok not in plain.token_ids[:6]       # the ban held without speculation
    assert spec.token_ids == plain.token_ids and spec.finish_reason == plain.finish_reason


def test_abort_mid_spec_frees_draft_model_state(make_llm, tiny_model_dir):
    llm = make_llm(speculative_config=_self_draft(tiny_model_dir), max_num_batched_tokens=32)
    engine = llm.llm_engine
    drafter = engine.model_runner.spec.proposer
    blocks0, slots0 = len(drafter._blocks.free), len(drafter._slots.free)
    prompts = [[(7 * i + j) % 120 + 3 for j in range(20 + 9 * i)] for i in range(4)]
    for step_at in (1, 3, 6):
        ids = [f"a{step_at}-{i}" for i in range(len(prompts))]
        for rid, p in zip(ids, prompts):
            engine.add_request(rid, p, SamplingParams(n=1 + len(rid) % 2, temperature=0.0,
                                                      max_tokens=30, ignore_eos=True))
        for _ in range(step_at):
            engine.step()
        if step_at == 6:
            assert drafter.requests             # the drafter holds state for running samples
        engine.abort_request(ids)
        engine.step()                      # the worker hears of the aborts
        assert not engine.has_unfinished_requests()
        assert not drafter.requests
        assert (len(drafter._blocks.free), len(drafter._slots.free)) == (blocks0, slots0)
