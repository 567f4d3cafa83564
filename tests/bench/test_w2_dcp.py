# SPDX-License-Identifier: Apache-2.0
"""benchmarks/w2_dcp.py on the CPU at W2's shape scaled down (tiny model, gloo ranks): a server
per layout (TP=2, then TP=2 with DCP=2), shared-prefix token-id prompts whose later requests hit
the prefix cache, the capacity from the log and /metrics (DCP=2 holds twice the KV tokens),
TPOT p50 and no request errors."""

import json

import pytest


@pytest.fixture(scope="module")
def w2(load_benchmark):
    return load_benchmark("w2_dcp")


@pytest.mark.timeout(900)
def test_w2_tp2_and_dcp2_on_cpu(w2, tmp_path, capsys):
    from kdaserve.models.make_model import make_model

    model = make_model(str(tmp_path / "tiny"), preset="tiny")
    out = tmp_path / "w2.json"
    rc = w2.main([model, "--layouts", "2,2x2", "--base-server-args",
                  "--device cpu --max-model-len 1024 --max-num-seqs 4 --enable-prefix-caching",
                  "--input-len", "640", "--shared-prefix-len", "576", "--output-len", "6",
                  "--num-requests", "2", "--time-budget", "600", "--out-dir", str(tmp_path),
                  "--out", str(out)])
    assert rc == 0
    assert "| 2x2 | 2 |" in capsys.readouterr().out
    res = json.loads(out.read_text())
    assert res["status"] == {"2": "ok", "2x2": "ok"}
    caps = res["kv_cache_tokens"]
    assert caps["2x2"] == 2 * caps["2"]
    assert [(r["layout"], r["concurrency"]) for r in res["rows"]] == [
        ("2", 1), ("2", 2), ("2x2", 1), ("2x2", 2)]
    for r in res["rows"]:
        assert r["completed"] == 2 and r["errors"] == 0 and r["warmup_errors"] == 0
        assert r["p50_tpot_ms"] > 0 and r["prompt_tokens_match_rate"] == 1.0
        assert r["prefix_cache_hit_rate"] > 0.5      # the prefix up to its 512-token KDA checkpoint
    for rec in res["layouts"]:
        assert rec["kv_capacity_metric"] == rec["server_capacity"]["kv_cache_tokens"]
        assert "--enable-prefix-caching" in rec["server_command"]
    assert "--decode-context-parallel-size 2" in res["layouts"][1]["server_command"]
    assert res["reference"]["kv_cache_tokens"]["dcp8"] == 19_750_000
