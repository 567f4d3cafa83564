# SPDX-License-Identifier: Apache-2.0
"""benchmarks/parallel_equality.py on the CPU (gloo, two rank processes): TP=2 and TP=2 with
DCP=2 give TP=1's greedy tokens exactly on the tiny preset in fp32 (as
tests/distributed/test_dcp_engine.py asserts), each layout in its own child process, and the
JSON carries the capacities (DCP=2 holds twice TP=2's KV tokens in the same blocks); the
comparison's verdicts on a divergence within and outside the top-k."""

import json

import pytest


@pytest.fixture(scope="module")
def pe(load_benchmark):
    return load_benchmark("parallel_equality")


@pytest.mark.timeout(900)
def test_tp_and_dcp_layouts_equal_tp1_on_cpu(pe, tmp_path, capsys):
    from kdaserve.models.make_model import make_model

    model = make_model(str(tmp_path / "tiny"), preset="tiny")
    out = tmp_path / "eq.json"
    rc = pe.main([model, "--layouts", "1,2,2x2", "--prompt-len", "150,96,40",
                  "--max-tokens", "8", "--device", "cpu", "--max-model-len", "512",
                  "--num-gpu-blocks", "64", "--block-size", "16",
                  "--max-num-batched-tokens", "48", "--layout-timeout", "300",
                  "--out", str(out)])
    assert rc == 0
    assert "verdict: exact" in capsys.readouterr().out
    res = json.loads(out.read_text())
    assert res["verdict"] == "exact" and res["errors"] == []
    assert res["reference_layout"] == "1" and res["prompt_lens"] == [150, 96, 40]
    by = {r["layout"]: r for r in res["results"]}
    assert [r["status"] for r in res["results"]] == ["ok"] * 3
    assert [(by[k]["tp"], by[k]["dcp"]) for k in ("1", "2", "2x2")] == [(1, 1), (2, 1), (2, 2)]
    for r in res["results"]:
        assert r["tokens"] == by["1"]["tokens"]
        assert [len(t) for t in r["tokens"]] == [8, 8, 8]
        assert len(r["top_logprobs"][0][0]) >= 5 and r["engine_start_s"] > 0
    assert [c["verdict"] for c in res["comparisons"]] == ["exact", "exact"]
    caps = {k: by[k]["capacity"] for k in by}
    assert caps["1"]["num_total_kv_tokens"] == caps["2"]["num_total_kv_tokens"] == 64 * 16
    assert caps["2x2"]["num_total_kv_tokens"] == 2 * caps["2"]["num_total_kv_tokens"]
    assert caps["2x2"]["num_total_blocks"] == 64 and caps["2x2"]["tokens_per_block"] == 32
    assert res["kv_tokens"] == {"1": 1024, "2": 1024, "2x2": 2048}
    assert res["commit"] and res["command"].endswith(str(out))


def _rec(layout, tokens, tops):
    return {"layout": layout, "tokens": tokens, "top_logprobs": tops}


def test_compare_divergence_within_and_outside_top_k(pe):
    top = [[[5, -0.1], [6, -0.2], [7, -3.0]], [[1, -0.5], [2, -0.6], [3, -2.0]]]
    ref = _rec("1", [[5, 1]], [top])
    same = pe.compare(ref, _rec("2", [[5, 1]], [top]), k=2)
    assert same["verdict"] == "exact" and same["prompts"][0]["first_divergence"] is None
    # a near-tie flips at position 1: each side's token is in the other's top 2
    flip = [top[0], [[2, -0.55], [1, -0.56], [3, -2.0]]]
    close = pe.compare(ref, _rec("2", [[5, 2]], [flip]), k=2)
    row = close["prompts"][0]
    assert close["verdict"] == "close" and row["first_divergence"] == 1
    assert row["ref_token_in_got_top"] and row["got_token_in_ref_top"]
    assert row["max_abs_logprob_diff"] == 0.0
    # the other side's token is outside the reference's top 2
    far = [top[0], [[3, -0.1], [1, -0.5], [2, -0.6]]]
    bad = pe.compare(ref, _rec("2", [[5, 3]], [far]), k=2)
    assert bad["verdict"] == "mismatch" and not bad["prompts"][0]["got_token_in_ref_top"]


def test_layout_parsing(pe):
    assert pe.parse_layout("1") == (1, 1) and pe.parse_layout("2x2") == (2, 2)
    assert pe.layout_name(8, 1) == "8" and pe.layout_name(2, 2) == "2x2"
    with pytest.raises(Exception, match="TP or TPxDCP"):
        pe.parse_layout("2x")
