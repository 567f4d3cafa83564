# SPDX-License-Identifier: Apache-2.0
"""Metric definitions checked against hand-computed numbers."""

import pytest

from kdaserve.bench.metrics import (
    RequestRecord,
    guidellm_metrics,
    max_concurrent_requests,
    max_output_tokens_per_s,
    summarize,
    vllm_metrics,
    weighted_summarize,
)


def rec(req_id, start, events, out, end, prompt, tokens=None, ok=True):
    r = RequestRecord(req_id=req_id, start=start, prompt_len=prompt, success=ok)
    if ok:
        r.event_times = list(events)
        r.event_tokens = list(tokens or [])
        r.ttft, r.latency, r.request_end = events[0], events[-1], end
        r.first_text_time, r.last_text_time = events[0], events[-1]
        r.num_text_events = len(events)
        r.output_tokens, r.prompt_tokens = out, prompt
    else:
        r.error = "HTTP 500"
    return r


@pytest.fixture
def records():
    return [
        rec("a", 0.0, [0.1, 0.2, 0.4], 3, 0.45, 10),
        rec("b", 0.3, [0.2, 0.3], 2, 0.3, 20),
        rec("c", 0.5, [], 0, 0.0, 5, ok=False),
    ]


def test_summarize_matches_numpy_linear_percentiles():
    s = summarize([1.0, 2.0, 3.0, 4.0], percentiles=(50, 99), scale=10.0)
    assert s["mean"] == 25.0 and s["median"] == 25.0
    assert s["p99"] == pytest.approx(10 + 0.99 * 3 * 10)  # 39.7
    assert s["min"] == 10.0 and s["max"] == 40.0 and s["count"] == 4
    assert summarize([])["mean"] == 0.0 and summarize([])["count"] == 0


def test_weighted_summary():
    s = weighted_summarize([10.0, 20.0, 30.0], [1, 1, 2], percentiles=(25, 50, 75, 99))
    assert s["mean"] == pytest.approx((10 + 20 + 60) / 4)
    assert s["p25"] == 10.0 and s["p50"] == 20.0 and s["p75"] == 30.0 and s["p99"] == 30.0
    with pytest.raises(ValueError, match="differ in length"):
        weighted_summarize([1.0], [1, 2])


def test_vllm_definitions(records):
    m = vllm_metrics(records, duration=2.0, percentiles=(50, 99))
    assert m["completed"] == 2 and m["failed"] == 1
    assert m["total_input_tokens"] == 30 and m["total_output_tokens"] == 5
    assert m["request_throughput"] == pytest.approx(1.0)
    assert m["output_throughput"] == pytest.approx(2.5)
    assert m["total_token_throughput"] == pytest.approx(17.5)
    # TTFT: 100, 200 ms
    assert m["mean_ttft_ms"] == pytest.approx(150.0)
    assert m["p99_ttft_ms"] == pytest.approx(199.0)
    # TPOT: a (0.4 - 0.1) / 2 = 150 ms, b (0.3 - 0.2) / 1 = 100 ms
    assert m["mean_tpot_ms"] == pytest.approx(125.0)
    assert m["median_tpot_ms"] == pytest.approx(125.0)
    # ITL pooled over events: [100, 200] + [100]
    assert m["mean_itl_ms"] == pytest.approx(400 / 3)
    assert m["median_itl_ms"] == pytest.approx(100.0)
    assert m["p99_itl_ms"] == pytest.approx(198.0)
    # E2EL = last choices event: 400, 300 ms
    assert m["mean_e2el_ms"] == pytest.approx(350.0)
    assert m["max_concurrent_requests"] == 2  # a [0, 0.45] overlaps b [0.3, 0.6]


def test_vllm_goodput(records):
    m = vllm_metrics(records, 2.0, goodput_slos={"ttft": 150.0})
    assert m["good_requests"] == 1 and m["request_goodput"] == pytest.approx(0.5)
    m = vllm_metrics(records, 2.0, goodput_slos={"tpot": 120.0, "e2el": 500.0})
    assert m["good_requests"] == 1  # b: TPOT 100 ms; a: 150 ms


def test_guidellm_definitions(records):
    g = guidellm_metrics(records, duration=2.0, percentiles=(50,))
    assert g["time_to_first_token_ms"]["mean"] == pytest.approx(150.0)
    # guidellm ITL = (last - first) / (out - 1), weighted by out - 1: 150 ms x2, 100 ms x1
    assert g["inter_token_latency_ms"]["mean"] == pytest.approx(400 / 3)
    # guidellm TPOT = last / out (includes TTFT), weighted by out: 133.3 ms x3, 150 ms x2
    assert g["time_per_output_token_ms"]["mean"] == pytest.approx(140.0)
    assert g["request_latency"]["mean"] == pytest.approx(0.375)
    assert g["output_tokens_per_second"] == pytest.approx(2.5)
    assert g["tokens_per_second"] == pytest.approx(17.5)
    assert g["request_totals"] == {"successful": 2, "errored": 1, "total": 3}
    assert g["output_tokens_per_iteration"]["mean"] == pytest.approx(1.0)


def test_guidellm_ttft_skips_role_only_chunk():
    r = rec("a", 0.0, [0.1, 0.1, 0.2, 0.3], 3, 0.3, 10)
    r.first_text_time, r.num_text_events = 0.1, 3  # role chunk at 0.1 carried no text
    g = guidellm_metrics([r], 1.0)
    assert g["inter_token_latency_ms"]["mean"] == pytest.approx(100.0)
    assert vllm_metrics([r], 1.0)["mean_tpot_ms"] == pytest.approx(100.0)
    assert vllm_metrics([r], 1.0)["mean_itl_ms"] == pytest.approx(100 * 0.2 / 0.3)


def test_multi_token_events_tpot_vs_itl():
    # Spec-decode-like: 9 tokens in 3 events. TPOT is per token, ITL per event.
    r = rec("a", 0.0, [0.1, 0.4, 0.7], 9, 0.7, 10, tokens=[3, 3, 3])
    m = vllm_metrics([r], 1.0)
    assert m["mean_tpot_ms"] == pytest.approx(600 / 8)
    assert m["mean_itl_ms"] == pytest.approx(300.0)
    assert guidellm_metrics([r], 1.0)["output_tokens_per_iteration"]["mean"] == 3.0


def test_max_output_tokens_per_s_buckets():
    a = rec("a", 0.0, [0.1, 0.5, 0.9, 1.2], 4, 1.2, 1)
    b = rec("b", 0.8, [0.3, 0.5, 0.7], 6, 0.7, 1, tokens=[2, 2, 2])
    # arrivals: bucket 0: a 0.1, 0.5, 0.9 = 3; bucket 1: a 1.2, b 1.1, 1.3, 1.5 = 1 + 6 = 7
    assert max_output_tokens_per_s([a, b]) == 7.0
    assert max_concurrent_requests([a, b]) == 2
    c = rec("c", 1.2, [0.1], 1, 0.1, 1)  # starts exactly when a ends: no overlap
    assert max_concurrent_requests([a, c]) == 1


def test_duration_must_be_positive(records):
    with pytest.raises(ValueError, match="duration"):
        vllm_metrics(records, 0.0)


def test_prometheus_counters_and_deltas():
    from kdaserve.bench.server_metrics import level_counters, parse_prometheus

    before = parse_prometheus(
        '# HELP vllm:spec_decode_num_drafts_total drafts\n'
        'vllm:spec_decode_num_drafts_total{model_name="m"} 10.0\n'
        'vllm:spec_decode_num_draft_tokens_total{model_name="m"} 80.0\n'
        'vllm:spec_decode_num_accepted_tokens_total{model_name="m"} 30.0\n'
        'vllm:prefix_cache_queries_total{model_name="m",engine="0"} 100\n'
        'vllm:prefix_cache_queries_total{model_name="m",engine="1"} 100\n'
        'vllm:prefix_cache_hits_total{model_name="m"} 50\n'
        'process_cpu_seconds_total 3.5\n')
    assert before["prefix_cache_queries"] == 200.0 and before["process_cpu_seconds"] == 3.5
    after = dict(before, spec_decode_num_drafts=20.0, spec_decode_num_draft_tokens=160.0,
                 spec_decode_num_accepted_tokens=60.0, prefix_cache_queries=400.0,
                 prefix_cache_hits=200.0)
    d = level_counters(before, after)
    assert d["spec_decode_acceptance_rate"] == pytest.approx(30 / 80)
    assert d["spec_decode_acceptance_length"] == pytest.approx(1 + 30 / 10)
    assert d["prefix_cache_hit_rate"] == pytest.approx(150 / 200)
    assert "spec_decode_kda_state_bytes_per_verify" not in d   # vLLM has no such counter
    ours = level_counters(dict(before, spec_decode_kda_state_bytes_written=1e6),
                          dict(after, spec_decode_kda_state_bytes_written=3e6))
    assert ours["spec_decode_kda_state_bytes_per_verify"] == pytest.approx(2e6 / 10)
    assert level_counters(None, after) is None
