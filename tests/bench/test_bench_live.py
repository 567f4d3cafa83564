# SPDX-License-Identifier: Apache-2.0
"""W5 `cpu-smoke`: `kdaserve bench serve` against a live tiny-model `kdaserve serve` on the CPU
(256-token prompts, 32 output tokens, concurrency 1 and 4)."""

import json

import pytest

from kdaserve.bench.launch import ServerProcess
from kdaserve.entrypoints.cli import main


@pytest.fixture(scope="module")
def live_server(tmp_path_factory):
    from kdaserve.models.make_model import make_model

    d = tmp_path_factory.mktemp("live")
    model = make_model(str(d / "tiny"), preset="tiny")
    server = ServerProcess(model, ["--device", "cpu", "--max-num-seqs", "8"],
                           log_path=str(d / "server.log"))
    try:
        server.start(timeout=180)
    except (RuntimeError, TimeoutError) as e:
        server.stop()
        pytest.fail(f"kdaserve serve did not start: {e}\n{server.log_tail()}")
    server.model = model  # the tokenizer folder: /v1/models shows no path
    yield server
    server.stop()


# chat: the W5 workload as specified; completions: token-id prompts (the W3 client path), one
# level to keep CI short.
@pytest.mark.parametrize("endpoint,levels", [("chat", "1,4"), ("completions", "4")])
def test_w5_bench_serve_against_live_server(live_server, tmp_path, endpoint, levels):
    out, png = tmp_path / "w5.json", tmp_path / "w5.png"
    extra = ["--token-ids"] if endpoint == "completions" else []
    rc = main(["bench", "serve", "--base-url", live_server.base_url, "--endpoint", endpoint,
               "--input-len", "256", "--output-len", "32", "--concurrency", levels,
               "--warmup", "1", "--seed", "42", "--temperature", "1.0", "--top-p", "0.95",
               "--label", "W5", "--server-flags", live_server.command_line,
               "--out", str(out), "--plot", str(png), "--save-detailed",
               "--tokenizer", live_server.model,
               *extra])
    assert rc == 0
    assert png.read_bytes()[:4] == b"\x89PNG"
    res = json.loads(out.read_text())
    assert res["server"]["models"]["data"][0]["root"]
    assert res["server"]["server_flags"] == live_server.command_line
    assert [lv["concurrency"] for lv in res["levels"]] == [int(c) for c in levels.split(",")]
    for lv in res["levels"]:
        m, n = lv["metrics"], 2 * lv["concurrency"]
        assert m["completed"] == n and m["failed"] == 0 and len(lv["requests"]) == n
        assert m["total_output_tokens"] == 32 * n
        assert m["total_input_tokens"] == 256 * n and lv["prompt_tokens_match_rate"] == 1.0
        for key in ("request_throughput", "output_throughput", "total_token_throughput",
                    "mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms", "mean_tpot_ms",
                    "median_tpot_ms", "p99_tpot_ms", "mean_itl_ms", "median_itl_ms",
                    "p99_itl_ms", "mean_e2el_ms", "p99_e2el_ms", "max_output_tokens_per_s"):
            assert m[key] > 0, key
        assert 0 < m["mean_ttft_ms"] < m["mean_e2el_ms"]
        assert m["max_concurrent_requests"] <= lv["concurrency"]
        g = lv["guidellm"]
        assert g["output_token_count"]["mean"] == 32 and g["prompt_token_count"]["mean"] == 256
        for key in ("time_to_first_token_ms", "inter_token_latency_ms",
                    "time_per_output_token_ms", "request_latency"):
            assert g[key]["count"] > 0 and g[key]["mean"] > 0, key
        c = lv["server_counters"]
        assert c is not None and c["generation_tokens"] >= 32 * n
        for r in lv["requests"]:
            assert r["success"] and r["output_tokens_source"] == "usage"
            assert r["output_tokens"] == 32 and r["prompt_tokens"] == 256
            assert 0 < r["ttft"] < r["latency"] <= r["request_end"]
            assert r["finish_reason"] == "length"
            assert sum(r["event_tokens"]) == 32
