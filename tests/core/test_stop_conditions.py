"""Stop checks in update_from_output: EOS, stop_token_ids, min_tokens, max_tokens, max_model_len."""

from __future__ import annotations

from sched_driver import make_request, reference_tokens, run_until_done

PROMPT_LEN = 6


def _ref(n):
    return reference_tokens(make_request("x", PROMPT_LEN).prompt_token_ids, n)


def _run(make_scheduler, max_model_len=128, **kwargs):
    sched, runner = make_scheduler(max_model_len=max_model_len)
    req = make_request("a", PROMPT_LEN, **kwargs)
    sched.add_request(req)
    result = run_until_done(sched, runner)
    return req, result


def _first_index(tokens, token, start=0):
    return tokens.index(token, start)


def test_eos_stops_and_is_included(make_scheduler):
    ref = _ref(30)
    eos = ref[4]
    stop_at = _first_index(ref, eos)
    req, result = _run(make_scheduler, max_tokens=30, eos=[eos, 9999])
    assert result.tokens["a"] == ref[:stop_at + 1]
    assert result.finish["a"] == "stop" and result.stop_reason["a"] is None


def test_ignore_eos_runs_to_max_tokens(make_scheduler):
    ref = _ref(12)
    req, result = _run(make_scheduler, max_tokens=12, eos=ref[0], ignore_eos=True)
    assert result.tokens["a"] == ref and result.finish["a"] == "length"


def test_min_tokens_delays_eos_and_stop_tokens(make_scheduler):
    ref = _ref(40)
    eos = ref[1]
    min_tokens = 5
    expect = _first_index(ref, eos, min_tokens - 1) + 1  # first eos at output count >= 5
    req, result = _run(make_scheduler, max_tokens=40, eos=eos, min_tokens=min_tokens)
    assert result.tokens["a"] == ref[:expect] and result.finish["a"] == "stop"

    stop_tok = ref[0]
    expect = _first_index(ref, stop_tok, min_tokens - 1) + 1
    req, result = _run(make_scheduler, max_tokens=40, stop_token_ids=[stop_tok],
                       min_tokens=min_tokens)
    assert result.tokens["a"] == ref[:expect]
    assert result.finish["a"] == "stop" and result.stop_reason["a"] == stop_tok


def test_stop_token_ids_report_stop_reason(make_scheduler):
    ref = _ref(20)
    tok = ref[3]
    req, result = _run(make_scheduler, max_tokens=20, stop_token_ids=[tok])
    assert result.tokens["a"] == ref[:_first_index(ref, tok) + 1]
    assert result.stop_reason["a"] == tok and req.stop_reason == tok


def test_max_tokens_and_max_model_len(make_scheduler):
    req, result = _run(make_scheduler, max_tokens=7)
    assert result.tokens["a"] == _ref(7) and result.finish["a"] == "length"
    # max_tokens=None: up to max_model_len (prompt 6 + 10 outputs = 16).
    req, result = _run(make_scheduler, max_model_len=16, max_tokens=None)
    assert result.tokens["a"] == _ref(10) and result.finish["a"] == "length"
    assert req.num_tokens == 16


def test_logprobs_follow_tokens(make_scheduler):
    req, result = _run(make_scheduler, max_tokens=3, logprobs=1)
    lps = [lp for o in result.outputs for lp in (o.new_logprobs or [])]
    assert [next(iter(d)) for d in lps] == result.tokens["a"]
